"""Sphinx configuration of the course's site: `python docs/build.py` (see README, "The site")."""
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS))
sys.path.insert(1, str(DOCS.parent))

import stage  # noqa: E402

# Two sites from this one configuration (docs/build.py runs both): the English one from docs/, and the
# Chinese one (DOCS_LANG=zh) from docs/_zh/ into _build/html/zh/. Each page links to its counterpart.
CHINESE = os.environ.get("DOCS_LANG") == "zh"
if CHINESE:
    stage.stage_zh()   # notebooks/zh/ (built from the catalogs), the glossary, README.zh.md: see stage.py
else:
    stage.stage()      # notebooks (with their committed outputs), glossary, API page: see stage.py

project = "Hands-on distributed PyTorch"
author = "the course's authors"
copyright = "the course's authors"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "_zh", "_files", "_vendor", "_static_gen", "_readme.md", "_project.md",
                    "**.ipynb_checkpoints",
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
language = "en"
if CHINESE:
    html_title = "动手学分布式 PyTorch"
    language = "zh_CN"          # the theme's words (搜索, 目录), <html lang="zh-CN">, the search's word splitting
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


COUNTERPART = ('<p class="counterpart" lang="{lang}"><a class="counterpart-link" href="{href}">{text}</a></p>\n')


def _link_to_counterpart(app, pagename, templatename, context, doctree):
    """A line at the top of each page that both sites have: the same page in the other language.
    The Chinese site lies in zh/ of the English one, so the link is a relative one (build.py checks it)."""
    if "body" not in context or pagename not in stage.zh_pages():
        return
    up = "../" * pagename.count("/")
    if CHINESE:
        line = COUNTERPART.format(lang="en", href=f"{up}../{pagename}.html", text="English version of this page")
    else:
        line = COUNTERPART.format(lang="zh-CN", href=f"{up}zh/{pagename}.html", text="本页中文版")
    context["body"] = line + context["body"]


def setup(app):
    if CHINESE:
        # Sphinx's Chinese search (9.0) stems Latin words with the English stemmer, but its language_data.js
        # asks for a ChineseStemmer that no script defines: the search page stopped with an error.
        from sphinx.search.zh import SearchChinese

        class _SearchChinese(SearchChinese):
            language_name = "English"     # names the stemmer language_data.js takes: EnglishStemmer

        app.add_search_language(_SearchChinese)
    app.connect("html-page-context", _mermaid_on_pages_that_draw)
    app.connect("html-page-context", _link_to_counterpart)
