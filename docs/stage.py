"""Lay out the site's sources from the repository: run by conf.py before every build.

Nothing here executes a notebook: the pages show the outputs committed in notebooks/*.ipynb,
the ones CI re-produces. What is copied into docs/ (all of it git-ignored):

- docs/notebooks/NN_*.ipynb and A*_*.ipynb: every numbered notebook, in course order (by file name),
  then the appendices, so a
  notebook added or renamed is picked up without a list to keep. On the way:
  - a widget that needs a kernel (the ring slider of notebook 03) would be a dead box: its output
    becomes a note that points at the step-by-step picture the notebook draws above it (or a copy of
    the nearest picture above, where the cell before has none);
  - the notebook's widget state is dropped, so no page loads widget JavaScript from the internet;
  - `# NBVAL_...` comment lines (test markers, not course content) leave the code shown.
- docs/notebooks/glossary.md: notebooks/glossary.md; docs/notebooks/instructors.md: notebooks/instructors.md
  (its README links point at the landing page, which includes the README).
- docs/_readme.md: README.md, which the landing page (index.md) includes, its links fixed alike.
- docs/_files/...: files that the notebooks or the README link to outside notebooks/ (e.g. ../ddp_helpers/train.py),
  so the page links to a copy instead of a broken path.
- docs/api.md: the API page, from ddp_helpers' docstrings (api_page.py).
- Mermaid diagrams (```mermaid fences, which JupyterLab draws) become <pre class="mermaid"> that the
  site's own copy of mermaid.min.js draws (build.py gets it, conf.py serves it); without that copy,
  their source is shown as text.
"""
import copy
import html
import json
import os
import re
import shutil
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
NOTEBOOKS = ROOT / "notebooks"
STAGED = DOCS / "notebooks"
FILES = DOCS / "_files"
NUMBERED = re.compile(r"^(\d\d|A\d)_\w+\.ipynb$")   # the course (00_...), then the appendices (A1_...)
WIDGET = "application/vnd.jupyter.widget-view+json"
MERMAID = re.compile(r"^```mermaid[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
STATIC = DOCS / "_static_gen"
NBVAL_COMMENT = re.compile(r"^\s*#\s*NBVAL_[A-Z_]+\s*$")
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
WIDGET_NOTE = ("*In JupyterLab this cell shows a slider that needs a running kernel. "
               "{where} shows every step of it.*")


def course_notebooks():
    """The numbered notebooks in course order (00_, 01_, ... by name), then the appendices (A1_, ...)."""
    return sorted(p for p in NOTEBOOKS.glob("*.ipynb") if NUMBERED.match(p.name))


def _images(cell):
    return [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]


def replace_widgets(nb):
    """Each widget output becomes a note pointing at the picture above it. Returns how many."""
    replaced = 0
    last_image, previous_code = None, None
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            if WIDGET not in out.get("data", {}):
                outputs.append(out)
                continue
            replaced += 1
            if previous_code is not None and _images(previous_code):
                outputs.append(_markdown(WIDGET_NOTE.format(where="The picture above")))
            elif last_image is not None:
                outputs.append(copy.deepcopy(last_image))
                outputs.append(_markdown(WIDGET_NOTE.format(where="This picture")))
            else:
                outputs.append(_markdown("*In JupyterLab this cell shows a widget that needs a running kernel.*"))
        cell["outputs"] = outputs
        images = _images(cell)
        if images:
            last_image = {"output_type": "display_data", "metadata": {},
                          "data": {"image/png": images[-1]["data"]["image/png"]}}
        previous_code = cell
    nb["metadata"].pop("widgets", None)
    return replaced


def _markdown(text):
    return {"output_type": "display_data", "metadata": {}, "data": {"text/markdown": text}}


def mermaid_diagrams(text):
    """```mermaid fences -> HTML that mermaid.min.js draws (or plain text without it)."""
    if os.environ.get("DOCS_MERMAID_JS"):
        return MERMAID.sub(lambda m: '```{raw} html\n<pre class="mermaid">\n' + html.escape(m.group(1))
                           + "</pre>\n```", text)
    return MERMAID.sub(lambda m: "```text\n" + m.group(1) + "```", text)


def strip_test_markers(nb):
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines(keepends=True)
            kept = [line for line in lines if not NBVAL_COMMENT.match(line)]
            cell["source"] = "".join(kept)


def copy_linked_files(text, source_dir=NOTEBOOKS, to_docs="../"):
    """Markdown links to repository files that are not pages point to copies under docs/_files/.
    to_docs: the way from the page's folder to docs/."""
    def fix(match):
        target = match.group(2)
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        path = (source_dir / target).resolve()
        if path.suffix in (".ipynb", ".md") or not path.is_file():
            return match.group(0)         # a page, or a broken link: Sphinx judges it (and warns)
        try:
            rel = path.relative_to(ROOT)
        except ValueError:
            return match.group(0)
        if rel.parts[0] == "notebooks":
            dest = STAGED / Path(*rel.parts[1:])
            new = str(Path(*rel.parts[1:]))
        else:
            dest = FILES / rel
            new = to_docs + "_files/" + rel.as_posix()
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        return match.group(1) + new + match.group(3)

    return LINK.sub(fix, text)


README_SPLIT = "<!-- The site's landing page ends here"


def heading_anchor(title):
    """The anchor MyST (and GitHub) give a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def split_readme(readme):
    """The README's course part (the site's landing page) and the rest (the project page). Links from
    one part to a heading of the other are pointed at the other page."""
    at = readme.find(README_SPLIT)
    if at < 0:
        raise SystemExit("docs: README.md has no line starting with " + README_SPLIT)
    course, project = readme[:at], readme[readme.index("\n", at) + 1:]
    in_project = {heading_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", project, flags=re.M)}
    in_course = {heading_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", course, flags=re.M)}
    course = re.sub(r"\]\(#([\w-]+)\)", lambda m: f"](project.md#{m.group(1)})"
                    if m.group(1) in in_project else m.group(0), course)
    project = re.sub(r"\]\(#([\w-]+)\)", lambda m: f"](index.md#{m.group(1)})"
                     if m.group(1) in in_course else m.group(0), project)
    return course, "# The project: how it works, its layout, its tests\n\n" + project


def readme_anchors(text, project, to_docs):
    """Links to README.md#anchor: to the project page where that heading is there, else the landing page."""
    in_project = {heading_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", project, flags=re.M)}
    return re.sub(r"\]\(\.\./README\.md#([\w-]+)\)",
                  lambda m: f"]({to_docs}{'project' if m.group(1) in in_project else 'index'}.md#{m.group(1)})", text)


def stage():
    for folder in (STAGED, FILES, STATIC):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    staged = []
    for path in course_notebooks():
        nb = json.loads(path.read_text(encoding="utf-8"))
        replace_widgets(nb)
        strip_test_markers(nb)
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                cell["source"] = mermaid_diagrams(copy_linked_files("".join(cell["source"])))
        (STAGED / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")
        staged.append(path.name)
    readme = copy_linked_files((ROOT / "README.md").read_text(encoding="utf-8"), source_dir=ROOT, to_docs="")
    course, project = split_readme(readme)
    (DOCS / "_readme.md").write_text(mermaid_diagrams(course), encoding="utf-8")
    (DOCS / "_project.md").write_text(mermaid_diagrams(project), encoding="utf-8")
    glossary = NOTEBOOKS / "glossary.md"
    if glossary.is_file():
        text = mermaid_diagrams(copy_linked_files(glossary.read_text(encoding="utf-8")))
        (STAGED / "glossary.md").write_text(text, encoding="utf-8")
        staged.append("glossary.md")
    else:
        raise SystemExit("docs: notebooks/glossary.md is missing (the site's glossary page)")
    guide = NOTEBOOKS / "instructors.md"          # the instructor's guide; its links to README sections
    if guide.is_file():                             # point at the landing page, which includes the README
        text = readme_anchors(copy_linked_files(guide.read_text(encoding="utf-8")), project, "../")
        (STAGED / "instructors.md").write_text(mermaid_diagrams(text), encoding="utf-8")
        staged.append("instructors.md")
    mathjax = os.environ.get("DOCS_MATHJAX")
    if mathjax:
        shutil.copytree(mathjax, STATIC / "mathjax")
    mermaid = os.environ.get("DOCS_MERMAID_JS")
    if mermaid:
        shutil.copy2(mermaid, STATIC / "mermaid.min.js")
        (STATIC / "mermaid-init.js").write_text(
            'mermaid.initialize({startOnLoad: true, theme: "neutral", securityLevel: "strict"});\n')
    from api_page import write_api_page
    write_api_page(DOCS / "api.md")
    return staged


if __name__ == "__main__":
    print("\n".join(stage()))
