"""Build the course's site into docs/_build/html, then check its internal links.

    .venv/bin/pip install -e ".[docs]" -c constraints.txt    # requirements.txt installs it too
    .venv/bin/python docs/build.py            # then open docs/_build/html/index.html

Two sites: the English one, and the Chinese one (from notebooks/zh/, README.zh.md) in _build/html/zh/;
each page that both have links to its counterpart at the top (conf.py).

Sphinx runs with warnings as errors (-W). The notebooks are not executed: their committed outputs
are shown. The diagrams (Mermaid, as JupyterLab draws them) need mermaid.min.js, which the site
serves itself, so no page fetches anything from the internet; it comes from the npm registry once
(`npm pack`, checked against a pinned SHA-256) into the git-ignored docs/_vendor/. Without npm the
diagrams are shown as their source text, with a notice; CI (CI=true) requires them.
"""
import contextlib
import hashlib
import html.parser
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

DOCS = Path(__file__).resolve().parent
OUT = DOCS / "_build" / "html"
VENDOR = DOCS / "_vendor"
MERMAID_VERSION = "11.17.2"
MERMAID_SHA256 = "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"
MERMAID_JS = VENDOR / f"mermaid-{MERMAID_VERSION}.min.js"
# Formulas ($...$ in the notebooks' markdown) are drawn by MathJax, served by the site itself as well:
# its CommonHTML build and web fonts, from the npm package, checked against a pinned SHA-256.
MATHJAX_VERSION = "3.2.2"
MATHJAX_SHA256 = "1b9c0a1c44df864e915690558e72adb9cc5203360daefd385084ced3b6c64c09"
MATHJAX_DIR = VENDOR / f"mathjax-{MATHJAX_VERSION}"


@contextlib.contextmanager
def _npm_pack(package, version):
    """The npm registry's tarball of package@version, in a temporary folder while the block runs; None
    (with the reason printed) where npm is missing or the pack fails."""
    npm = shutil.which("npm")
    with tempfile.TemporaryDirectory() as tmp:
        done = (subprocess.run([npm, "pack", f"{package}@{version}", "--silent", "--pack-destination", tmp],
                               capture_output=True, text=True, timeout=300) if npm else None)
        tarballs = list(Path(tmp).glob(f"{package}-*.tgz"))
        if done is not None and (done.returncode != 0 or not tarballs):
            print(f"docs: npm pack {package}@{version} failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
        yield tarballs[0] if done is not None and done.returncode == 0 and tarballs else None


def fetch_mermaid():
    """docs/_vendor/mermaid-VERSION.min.js, from the npm registry once. Returns the path or None."""
    if MERMAID_JS.is_file() and _sha256(MERMAID_JS) == MERMAID_SHA256:
        return MERMAID_JS
    with _npm_pack("mermaid", MERMAID_VERSION) as tarball:
        if tarball is None:
            return None
        with tarfile.open(tarball) as tar:
            data = tar.extractfile("package/dist/mermaid.min.js").read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != MERMAID_SHA256:
        raise SystemExit(f"docs: mermaid.min.js {MERMAID_VERSION} from npm has SHA-256 {digest}, "
                         f"expected {MERMAID_SHA256}")
    VENDOR.mkdir(exist_ok=True)
    MERMAID_JS.write_bytes(data)
    return MERMAID_JS


def fetch_mathjax():
    """docs/_vendor/mathjax-VERSION/ (tex-chtml.js and its fonts), from the npm registry once, or None."""
    if (MATHJAX_DIR / "tex-chtml.js").is_file():
        return MATHJAX_DIR
    with _npm_pack("mathjax", MATHJAX_VERSION) as tarball:
        if tarball is None:
            return None
        digest = _sha256(tarball)
        if digest != MATHJAX_SHA256:
            raise SystemExit(f"docs: mathjax {MATHJAX_VERSION} from npm has SHA-256 {digest}, "
                             f"expected {MATHJAX_SHA256}")
        partial = VENDOR / f"mathjax-{MATHJAX_VERSION}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix("package/es5/")
                if member.isfile() and (name == "tex-chtml.js" or name.startswith("output/chtml/fonts/woff-v2/")):
                    target = partial / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
    shutil.rmtree(MATHJAX_DIR, ignore_errors=True)
    partial.rename(MATHJAX_DIR)
    return MATHJAX_DIR


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key) and not (tag == "link" and attrs.get("rel") in ("canonical",)):
                self.refs.append((tag, attrs[key]))


def check_links(root=OUT):
    """Every relative href/src in the site resolves to a file, and every #anchor to an id there."""
    pages, problems = {}, []
    for page in sorted(root.rglob("*.html")):
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        pages[page.resolve()] = parser
    for page, parser in pages.items():
        for tag, ref in parser.refs:
            parts = urlsplit(ref)
            if parts.scheme or ref.startswith("//"):
                if parts.scheme in ("http", "https") and tag in ("script", "img", "link"):
                    problems.append(f"{page.relative_to(root)}: loads {ref} from the internet")
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(f"{page.relative_to(root)}: broken link {ref}")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else set()
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{page.relative_to(root)}: no anchor #{parts.fragment} "
                                    f"in {target.relative_to(root)}")
    return len(pages), problems


def main():
    start = time.monotonic()
    mermaid = fetch_mermaid()
    if mermaid is None:
        if os.environ.get("CI") == "true":
            raise SystemExit("docs: CI needs the diagrams, and mermaid.min.js could not be had (npm?)")
        print("docs: notice: no npm, so the diagrams are shown as their Mermaid source text", file=sys.stderr)
    mathjax = fetch_mathjax()
    if mathjax is None:
        if os.environ.get("CI") == "true":
            raise SystemExit("docs: CI needs the formulas, and MathJax could not be had (npm?)")
        print("docs: notice: no npm, so formulas are shown as their TeX source", file=sys.stderr)
    env = dict(os.environ, DOCS_MERMAID_JS=str(mermaid or ""), DOCS_MATHJAX=str(mathjax or ""))
    shutil.rmtree(OUT, ignore_errors=True)
    # the English site, then the Chinese one (docs/_zh/, staged by conf.py) into its zh/ folder
    (DOCS / "_zh").mkdir(exist_ok=True)     # Sphinx wants the folder before conf.py fills it
    for lang, source, out in (("en", DOCS, OUT), ("zh", DOCS / "_zh", OUT / "zh")):
        done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "auto",
                               "-b", "html", "-c", str(DOCS), "-d", str(DOCS / "_build" / f"doctrees-{lang}"),
                               str(source), str(out)], env=dict(env, DOCS_LANG=lang))
        if done.returncode != 0:
            raise SystemExit(f"docs: Sphinx failed on the {lang} site (exit {done.returncode}; "
                             f"warnings count as errors)")
    count, problems = check_links()
    if problems:
        raise SystemExit("docs: internal link check failed:\n  " + "\n  ".join(problems))
    (OUT / ".built-ok").write_text("docs/build.py finished: Sphinx without warnings, links checked\n")
    print(f"docs: built {count} pages into {OUT.relative_to(DOCS.parent)}/ in {time.monotonic() - start:.0f} s; "
          f"internal links and anchors checked")


if __name__ == "__main__":
    main()
