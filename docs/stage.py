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
- docs/_zh/: the Chinese site's sources (stage_zh, for the second Sphinx run that build.py makes into
  _build/html/zh/): notebooks/zh/NN_*.ipynb (built from the catalogs, transformed as above), the
  bilingual glossary, the Chinese instructor's guide where there is one, and a landing page from
  README.zh.md (its course part) with the Chinese table of contents. A link to an English-only page
  becomes a plain link into the English site, which build.py's link check follows.
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
PAGE_LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")   # [label](target#anchor)
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


def copy_linked_files(text, source_dir=NOTEBOOKS, to_docs="../", staged=None, files=None):
    """Markdown links to repository files that are not pages point to copies under docs/_files/.
    to_docs: the way from the page's folder to docs/ (for the Chinese site: to docs/_zh/);
    staged, files: where notebooks/ and the other files are copied (the English site's by default)."""
    staged, files = staged or STAGED, files or FILES

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
        if rel.parts[0] == "notebooks" and rel.parts[1] != "zh":
            dest = staged / Path(*rel.parts[1:])
            new = str(Path(*rel.parts[1:]))
        else:
            dest = files / rel
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


def stage_notebook(path, dest, fix_links):
    """One notebook as a page: widgets to pictures, test markers out, links fixed, diagrams drawn."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    replace_widgets(nb)
    strip_test_markers(nb)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = mermaid_diagrams(fix_links("".join(cell["source"])))
    dest.write_text(json.dumps(nb, indent=1, ensure_ascii=False), encoding="utf-8")


def to_chinese(text, source_dir, up):
    """An English page's links to the Chinese edition (README.zh.md, notebooks/zh/NN_*.ipynb) become HTML
    links into the Chinese site (zh/ of this one). up: the way from the page's folder to the site's root."""
    def fix(match):
        label, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        path = (source_dir / target).resolve()
        if path == (ROOT / "README.zh.md").resolve():
            page = "index"
        elif path.parent == (NOTEBOOKS / "zh").resolve() and path.suffix == ".ipynb" and NUMBERED.match(path.name):
            page = f"notebooks/{path.stem}"
        else:
            return match.group(0)
        return f'<a href="{up}zh/{page}.html{html.escape(anchor)}">{label}</a>'

    return PAGE_LINK.sub(fix, text)


def stage():
    for folder in (STAGED, FILES, STATIC):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    staged = []
    for path in course_notebooks():
        stage_notebook(path, STAGED / path.name, lambda text: copy_linked_files(to_chinese(text, NOTEBOOKS, "../")))
        staged.append(path.name)
    readme = to_chinese((ROOT / "README.md").read_text(encoding="utf-8"), ROOT, "")
    readme = copy_linked_files(readme, source_dir=ROOT, to_docs="")
    course, project = split_readme(readme)
    (DOCS / "_readme.md").write_text(mermaid_diagrams(course), encoding="utf-8")
    (DOCS / "_project.md").write_text(mermaid_diagrams(project), encoding="utf-8")
    glossary = NOTEBOOKS / "glossary.md"
    if glossary.is_file():
        text = mermaid_diagrams(copy_linked_files(to_chinese(glossary.read_text(encoding="utf-8"), NOTEBOOKS, "../")))
        (STAGED / "glossary.md").write_text(text, encoding="utf-8")
        staged.append("glossary.md")
    else:
        raise SystemExit("docs: notebooks/glossary.md is missing (the site's glossary page)")
    guide = NOTEBOOKS / "instructors.md"          # the instructor's guide; its links to README sections
    if guide.is_file():                             # point at the landing page, which includes the README
        text = to_chinese(guide.read_text(encoding="utf-8"), NOTEBOOKS, "../")
        text = readme_anchors(copy_linked_files(text), project, "../")
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


# ------------------------------------------------------------------ the Chinese site
ZH = DOCS / "_zh"                       # its sources; built into _build/html/zh/ with this conf.py
ZH_NOTEBOOKS = NOTEBOOKS / "zh"
ZH_README = ROOT / "README.zh.md"
ZH_GUIDE = ZH_NOTEBOOKS / "instructors.md"
ZH_INDEX = """{readme}

```{{toctree}}
:caption: 课程
:maxdepth: 1
:glob:

notebooks/[0-9]*
```

```{{toctree}}
:caption: 参考
:maxdepth: 1

{reference}
```
"""
ZH_NO_README = "# 动手学分布式 PyTorch\n\n本课程的中文版。英文原版见 <a href=\"../index.html\">English</a>。\n"


def zh_notebooks():
    """The Chinese edition's notebooks (notebooks/zh/NN_*.ipynb, built from the catalogs)."""
    return sorted(p for p in ZH_NOTEBOOKS.glob("*.ipynb") if NUMBERED.match(p.name))


def zh_pages():
    """The pages of the Chinese site, by page name (notebooks/00_welcome, ...): both sites have them."""
    pages = {"index"} | {f"notebooks/{p.stem}" for p in zh_notebooks()} | {"notebooks/glossary"}
    return pages | ({"notebooks/instructors"} if ZH_GUIDE.is_file() else set())


def zh_links(text, source_dir, page_dir):
    """Links of a Chinese page. source_dir: where its source lives in the repository; page_dir: its folder
    in the Chinese site ('' or 'notebooks'). A link to a page the Chinese site has goes there; one to an
    English-only page (README.md, the English guide) becomes an HTML link into the English site, one
    folder up; files (code, pictures) are copied under docs/_zh/_files/."""
    up = "../" * (page_dir.count("/") + 1 if page_dir else 0)
    zh_here = {(ZH_NOTEBOOKS / f"{p.split('/', 1)[1]}.ipynb").resolve(): p
               for p in zh_pages() if p.startswith("notebooks/") and p != "notebooks/glossary"}
    zh_here[(NOTEBOOKS / "glossary.md").resolve()] = "notebooks/glossary"
    if ZH_GUIDE.is_file():
        zh_here[ZH_GUIDE.resolve()] = "notebooks/instructors"
    zh_here[ZH_README.resolve()] = "index"
    _, project = split_readme((ROOT / "README.md").read_text(encoding="utf-8"))
    project_anchors = {heading_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", project, flags=re.M)}

    def fix(match):
        label, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        path = (source_dir / target).resolve()
        if path.suffix not in (".ipynb", ".md") or not path.is_file():
            return match.group(0)
        if path in zh_here:
            page = zh_here[path]
            return f"[{label}]({up}{page}{'.ipynb' if path.suffix == '.ipynb' else '.md'}{anchor})"
        rel = path.relative_to(ROOT)
        if rel == Path("README.md"):        # the landing page, or the project page where the heading is there
            english = "project.html" if anchor[1:] in project_anchors else "index.html"
        elif rel.parts[0] == "notebooks" and len(rel.parts) == 2:
            english = f"notebooks/{path.stem}.html"
        else:
            return match.group(0)            # Sphinx judges it
        return f'<a href="{up}../{english}{html.escape(anchor)}">{label}</a>'

    return PAGE_LINK.sub(fix, text)


def stage_zh():
    """docs/_zh/: the Chinese site's sources. Returns the staged names."""
    if not zh_notebooks():
        raise SystemExit("docs: notebooks/zh/ has no notebooks (scripts/zh_catalogs.py build makes them)")
    shutil.rmtree(ZH, ignore_errors=True)
    (ZH / "notebooks").mkdir(parents=True)
    staged = []

    def fix(source_dir, page_dir, to_docs):
        return lambda text: copy_linked_files(zh_links(text, source_dir, page_dir), source_dir=source_dir,
                                              to_docs=to_docs, staged=ZH / "notebooks", files=ZH / "_files")

    for path in zh_notebooks():
        stage_notebook(path, ZH / "notebooks" / path.name, fix(ZH_NOTEBOOKS, "notebooks", "../"))
        staged.append(path.name)
    glossary = fix(NOTEBOOKS, "notebooks", "../")((NOTEBOOKS / "glossary.md").read_text(encoding="utf-8"))
    (ZH / "notebooks" / "glossary.md").write_text(mermaid_diagrams(glossary), encoding="utf-8")
    reference = ["notebooks/glossary"]
    if ZH_GUIDE.is_file():
        guide = fix(ZH_NOTEBOOKS, "notebooks", "../")(ZH_GUIDE.read_text(encoding="utf-8"))
        (ZH / "notebooks" / "instructors.md").write_text(mermaid_diagrams(guide), encoding="utf-8")
        reference.insert(0, "notebooks/instructors")
    if ZH_README.is_file():
        readme = ZH_README.read_text(encoding="utf-8")
        at = readme.find(README_SPLIT)          # the course part, where it marks one as the English does
        readme = readme[:at] if at >= 0 else readme
        readme = mermaid_diagrams(fix(ROOT, "", "")(readme))
    else:
        readme = ZH_NO_README
    (ZH / "index.md").write_text(ZH_INDEX.format(readme=readme, reference="\n".join(reference)), encoding="utf-8")
    return staged


if __name__ == "__main__":
    print("\n".join(stage()))
