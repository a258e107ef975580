"""Sphinx configuration of the course's site: `python docs/build.py` (see README, "The site")."""
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS))
sys.path.insert(1, str(DOCS.parent))

import stage  # noqa: E402

stage.stage()   # notebooks (with their committed outputs), glossary, API page: see stage.py

project = "Hands-on distributed PyTorch"
author = "the course's authors"
copyright = "the course's authors"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "_files", "_vendor", "_static_gen", "_readme.md", "_project.md", "**.ipynb_checkpoints",
                    "Thumbs.db", ".DS_Store"]
root_doc = "index"

# The notebooks are never run here: the pages show the committed outputs (the ones CI re-produces).
nb_execution_mode = "off"
nb_ipywidgets_js = {}          # no widget JavaScript from the internet (the slider becomes a picture)
nb_merge_streams = True        # one block per cell for a rank's interleaved stdout/stderr
myst_heading_anchors = 3
# not "smartquotes" or "replacements": text stays as written. "dollarmath": $...$ and $$...$$ are formulas, as
# in JupyterLab; MathJax is served by the site itself (docs/build.py), never from a CDN.
myst_enable_extensions = ["colon_fence", "dollarmath"]
if (stage.STATIC / "mathjax" / "tex-chtml.js").is_file():
    mathjax_path = "mathjax/tex-chtml.js"
# No typographic replacement (docutils' SmartQuotes): "--allow-root" outside backticks stayed a command
# only without it (it became an en dash), and quotes after Chinese text became two closing quotes.
smartquotes = False
suppress_warnings = []

html_theme = "furo"
html_title = "Hands-on distributed PyTorch"
html_favicon = "favicon.svg"   # four ranks in a ring (browsers ask for one: without it, a 404 on every site)
html_static_path = ["_static_gen", "_static"]
html_css_files = ["course.css"]   # shell commands wrap, code and outputs scroll (_static/course.css)
html_show_sourcelink = False
html_copy_source = False
html_last_updated_fmt = None


def _mermaid_on_pages_that_draw(app, pagename, templatename, context, doctree):
    """mermaid.min.js (3.5 MB) only on the pages with a diagram."""
    if 'class="mermaid"' in context.get("body", "") and (stage.STATIC / "mermaid.min.js").is_file():
        app.add_js_file("mermaid.min.js")
        app.add_js_file("mermaid-init.js")


def setup(app):
    app.connect("html-page-context", _mermaid_on_pages_that_draw)
