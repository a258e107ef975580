"""The Chinese edition's translation catalogs: one gettext catalog (.po) per English notebook.

    .venv/bin/python scripts/zh_catalogs.py extract   # make or update notebooks/zh/po/NN_*.po
    .venv/bin/python scripts/zh_catalogs.py build     # write notebooks/zh/NN_*.ipynb from them
    .venv/bin/python scripts/zh_catalogs.py status    # how many entries are translated, stale, missing

The English notebooks are the source. Each markdown cell is one catalog entry: its context
(msgctxt) is the cell's id, its message (msgid) the cell's English text, its translation (msgstr) the
Chinese text. `extract` keeps every translation whose English text is unchanged; a changed cell keeps
its old translation marked fuzzy (with the previous English text), so a translator sees what changed;
an entry whose cell is gone is dropped. `build` copies each English notebook, code cells and their
outputs unchanged, with each markdown cell's translation in place of its text (its links to the repo's
files made to work from notebooks/zh/); it refuses a catalog with a missing or fuzzy entry, naming the cell.

The instructor's guide (notebooks/instructors.md) has a catalog too, notebooks/zh/po/instructors.po: the file
split into blocks on blank lines (a paragraph, a heading, a list, a table), each block one entry keyed by its
English text (msgid; msgctxt only tells identical blocks apart). The Run All table between the "run-all-times"
markers is no entry: `build` copies it from the English as it is, so re-measured times never make the
translation stale. `build` writes notebooks/zh/instructors.md (its links made to work from there, as above).
"""
import argparse
import difflib
import re
import sys
from pathlib import Path

import nbformat
import polib

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
ZH = NOTEBOOKS / "zh"
PO = ZH / "po"
HEADER = {
    "Project-Id-Version": "ddp-notebooks",
    "Language": "zh_CN",
    "MIME-Version": "1.0",
    "Content-Type": "text/plain; charset=UTF-8",
    "Content-Transfer-Encoding": "8bit",
}


def english_notebooks():
    return sorted(p for p in NOTEBOOKS.glob("*.ipynb") if p.name[:2].isdigit() or p.name.startswith("A"))


def catalog_path(notebook: Path) -> Path:
    return PO / (notebook.stem + ".po")


def markdown_cells(nb):
    return [c for c in nb.cells if c.cell_type == "markdown"]


def carry_over(entry, before) -> str:
    """Give `entry` the translation of `before` (an older entry, or None): "kept" when its English is
    the same and it was current, "stale" (marked fuzzy, with the previous English) when not, "new"
    when there is none."""
    if before is None or not before.msgstr:
        return "new"
    entry.msgstr = before.msgstr
    if before.msgid == entry.msgid and "fuzzy" not in before.flags:
        return "kept"
    entry.flags.append("fuzzy")
    entry.previous_msgid = before.previous_msgid or before.msgid
    return "stale"


def extract(notebook: Path) -> tuple[int, int, int]:
    """Make or update the notebook's catalog; return (kept, stale, new) entry counts."""
    nb = nbformat.read(notebook, as_version=4)
    path = catalog_path(notebook)
    old = {e.msgctxt: e for e in polib.pofile(str(path), wrapwidth=0)} if path.exists() else {}
    po = polib.POFile(wrapwidth=0)
    po.metadata = dict(HEADER)
    counts = {"kept": 0, "stale": 0, "new": 0}
    for cell in markdown_cells(nb):
        entry = polib.POEntry(msgctxt=cell.id, msgid=cell.source, msgstr="")
        counts[carry_over(entry, old.get(cell.id))] += 1
        po.append(entry)
    PO.mkdir(parents=True, exist_ok=True)
    po.save(str(path))
    return counts["kept"], counts["stale"], counts["new"]


def problems(notebook: Path) -> list[str]:
    """Why the notebook's Chinese edition cannot be built: each markdown cell without a current translation."""
    nb = nbformat.read(notebook, as_version=4)
    path = catalog_path(notebook)
    if not path.exists():
        return [f"{notebook.name}: no catalog {path.relative_to(ROOT)} (run: scripts/zh_catalogs.py extract)"]
    entries = {e.msgctxt: e for e in polib.pofile(str(path), wrapwidth=0)}
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        entry = entries.get(cell.id)
        first = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
        where = f"{notebook.name} cell {index} ({cell.id}, {first!r})"
        if entry is None or not entry.msgstr:
            found.append(f"{where}: not translated")
        elif "fuzzy" in entry.flags or entry.msgid != cell.source:
            found.append(f"{where}: the English text changed since it was translated")
    return found


NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?![\d.])")


def _renumber(old_line: str, new_line: str, translation: str) -> str | None:
    """The translated line with the numbers that changed between the English lines changed too; None where
    the English changed in more than numbers, or a changed number is not found exactly once."""
    if NUMBER.sub("#", old_line) != NUMBER.sub("#", new_line):
        return None
    pairs = list(zip(NUMBER.findall(old_line), NUMBER.findall(new_line)))
    changed = {o: n for o, n in pairs if o != n}
    kept = {o for o, n in pairs if o == n}
    found = NUMBER.findall(translation)
    if any(found.count(o) != 1 or o in kept or len({n for oo, n in pairs if oo == o}) > 1 for o in changed):
        return None
    return NUMBER.sub(lambda m: changed.get(m.group(), m.group()), translation)


def restamp(notebook: Path, cell_id: str, old_text: str, new_text: str) -> str:
    """A script rewrote a cell's English text (scripts/stamp_times.py: its "**Run All**" line): carry the change
    into the catalog, so that the entry stays current. Each changed English line whose change is only in its
    numbers changes the same numbers in the translation's line that starts alike (or, where none does, the
    line at the same place). Returns "updated"; "fuzzy" where the change needs a translator (the entry is marked
    as `extract` marks it); "untouched" where the entry was not current anyway."""
    path = catalog_path(notebook)
    if not path.exists():
        return "untouched"
    po = polib.pofile(str(path), wrapwidth=0)
    entry = next((e for e in po if e.msgctxt == cell_id), None)
    if entry is None or not entry.msgstr or "fuzzy" in entry.flags or entry.msgid != old_text:
        return "untouched"
    old_lines, new_lines, zh_lines = old_text.split("\n"), new_text.split("\n"), entry.msgstr.split("\n")
    done = len(old_lines) == len(new_lines)
    for at, (old, new) in enumerate(zip(old_lines, new_lines) if done else []):
        if old == new:
            continue
        head = old.split(":")[0] if ":" in old else None
        where = [i for i, z in enumerate(zh_lines) if head and z.startswith(head)]
        if not where and len(zh_lines) == len(old_lines):
            where = [at]
        line = _renumber(old, new, zh_lines[where[0]]) if len(where) == 1 else None
        if line is None:
            done = False
            break
        zh_lines[where[0]] = line
    entry.msgid = new_text
    if done:
        entry.msgstr = "\n".join(zh_lines)
    else:
        entry.flags.append("fuzzy")
        entry.previous_msgid = old_text
    po.save(str(path))
    return "updated" if done else "fuzzy"


LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def relink(text: str) -> str:
    """A translation's relative links, made to work from notebooks/zh/: a link to a course notebook stays
    (it opens the Chinese one beside it); a link to any other file of the repo (`../ddp_helpers/train.py`,
    `glossary.md`) gets one more `../`, unless the translator already wrote the path from notebooks/zh/."""
    def fix(match):
        target = match.group(2)
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z][a-z0-9+.-]*:", path) or path.startswith("/"):
            return match.group(0)                 # an anchor in the page, a URL, an absolute path
        if re.fullmatch(r"[0-9A][0-9]_[\w-]+\.ipynb", path) or (ZH / path).exists():
            return match.group(0)
        if (NOTEBOOKS / path).exists():
            return match.group(1) + "../" + target + match.group(3)
        return match.group(0)
    return LINK.sub(fix, text)


def translated(notebook: Path, translations: dict | None = None):
    """The English notebook with each markdown cell's text replaced by its translation (cell id -> text;
    by default the catalog's), its links made to work from notebooks/zh/."""
    nb = nbformat.read(notebook, as_version=4)
    if translations is None:
        translations = {e.msgctxt: e.msgstr for e in polib.pofile(str(catalog_path(notebook)), wrapwidth=0)}
    for cell in markdown_cells(nb):
        cell.source = relink(translations[cell.id])
    nb.metadata["language_info"] = nb.metadata.get("language_info", {})
    return nb


def build(notebook: Path) -> Path:
    """Write notebooks/zh/<name>.ipynb: the English notebook with each markdown cell translated."""
    wrong = problems(notebook)
    if wrong:
        raise SystemExit("cannot build the Chinese edition:\n  " + "\n  ".join(wrong))
    out = ZH / notebook.name
    nbformat.write(translated(notebook), str(out))
    return out


GUIDE = NOTEBOOKS / "instructors.md"
GUIDE_PO = PO / "instructors.po"
GUIDE_ZH = ZH / "instructors.md"
TIMES_BEGIN, TIMES_END = "<!-- run-all-times: begin", "<!-- run-all-times: end -->"
BLANK = re.compile(r"(\n(?:[ \t]*\n)+|\n+\Z)")


def guide_parts(text: str) -> list[tuple[str, str]]:
    """The guide as (kind, text) parts, in order: "block" (a paragraph, heading, list or table: one catalog
    entry), "gap" (the blank lines between blocks) and "times" (the run-all-times markers and all between)."""
    begin = text.find(TIMES_BEGIN)
    end = text.find(TIMES_END, begin)
    if begin < 0 or end < 0:
        raise SystemExit(f"{GUIDE.name}: no {TIMES_BEGIN} ... {TIMES_END} table")
    end += len(TIMES_END)

    def split(chunk):
        return [("gap" if i % 2 else "block", piece) for i, piece in enumerate(BLANK.split(chunk)) if piece]
    return split(text[:begin]) + [("times", text[begin:end])] + split(text[end:])


def guide_entries(text: str) -> list[tuple[str | None, str]]:
    """(msgctxt, msgid) of each block: msgctxt None, or "2", "3"... for the second, third... identical block."""
    seen: dict[str, int] = {}
    found = []
    for kind, block in guide_parts(text):
        if kind == "block":
            seen[block] = seen.get(block, 0) + 1
            found.append((None if seen[block] == 1 else str(seen[block]), block))
    return found


def _guide_catalog(path: Path):
    return {(e.msgctxt, e.msgid): e for e in polib.pofile(str(path), wrapwidth=0)} if path.exists() else {}


def extract_guide(guide: Path = None, path: Path = None) -> tuple[int, int, int]:
    """Make or update the guide's catalog; return (kept, stale, new) entry counts. A block whose English
    changed keeps the translation of the most similar old block that no longer exists, marked fuzzy."""
    guide, path = guide or GUIDE, path or GUIDE_PO
    entries = guide_entries(guide.read_text(encoding="utf-8"))
    old = _guide_catalog(path)
    gone = [e for key, e in old.items() if key not in set(entries) and e.msgstr]
    po = polib.POFile(wrapwidth=0)
    po.metadata = dict(HEADER)
    counts = {"kept": 0, "stale": 0, "new": 0}
    for ctxt, block in entries:
        entry = polib.POEntry(msgctxt=ctxt, msgid=block, msgstr="")
        before = old.get((ctxt, block))
        if before is None or not before.msgstr:
            near = difflib.get_close_matches(block, [e.msgid for e in gone], n=1, cutoff=0.5)
            before = next((e for e in gone if near and e.msgid == near[0]), None)
            if before is not None:
                gone.remove(before)
        counts[carry_over(entry, before)] += 1
        po.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(path))
    return counts["kept"], counts["stale"], counts["new"]


def guide_problems(guide: Path = None, path: Path = None) -> list[str]:
    """Why the guide's Chinese edition cannot be built: each block without a current translation, named."""
    guide, path = guide or GUIDE, path or GUIDE_PO
    if not path.exists():
        return [f"{guide.name}: no catalog {path.name} (run: scripts/zh_catalogs.py extract)"]
    catalog = _guide_catalog(path)
    entries = guide_entries(guide.read_text(encoding="utf-8"))
    others = [e.msgid for key, e in catalog.items() if key not in set(entries) and e.msgstr]
    found = []
    for index, (ctxt, block) in enumerate(entries):
        entry = catalog.get((ctxt, block))
        where = f"{guide.name} block {index} ({block.splitlines()[0][:60]!r})"
        if entry is not None and entry.msgstr and "fuzzy" not in entry.flags:
            continue
        if (entry is not None and entry.msgstr) or difflib.get_close_matches(block, others, n=1, cutoff=0.5):
            found.append(f"{where}: the English text changed since it was translated")
        else:
            found.append(f"{where}: not translated")
    return found


def translated_guide(guide: Path = None, path: Path = None) -> str:
    """The guide in Chinese: each block's translation (its links made to work from notebooks/zh/), the
    blank lines between blocks and the run-all-times table as the English has them."""
    guide, path = guide or GUIDE, path or GUIDE_PO
    catalog = _guide_catalog(path)
    seen: dict[str, int] = {}
    out = []
    for kind, text in guide_parts(guide.read_text(encoding="utf-8")):
        if kind == "block":
            seen[text] = seen.get(text, 0) + 1
            text = relink(catalog[(None if seen[text] == 1 else str(seen[text]), text)].msgstr)
        out.append(text)
    return "".join(out)


def build_guide(guide: Path = None, path: Path = None, out: Path = None) -> Path:
    """Write notebooks/zh/instructors.md from the guide and its catalog."""
    wrong = guide_problems(guide, path)
    if wrong:
        raise SystemExit("cannot build the Chinese instructor's guide:\n  " + "\n  ".join(wrong))
    out = out or GUIDE_ZH
    out.write_text(translated_guide(guide, path), encoding="utf-8")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["extract", "build", "status"])
    parser.add_argument("notebooks", nargs="*",
                        help="numbers, e.g. 00 06, or `instructors` for the guide (default: all and the guide)")
    args = parser.parse_args(argv)
    books = [p for p in english_notebooks() if not args.notebooks or p.name[:2] in args.notebooks]
    if not args.notebooks or "instructors" in args.notebooks:
        if args.command == "extract":
            kept, stale, new = extract_guide()
            print(f"{GUIDE_PO.relative_to(ROOT)}: {kept} kept, {stale} stale, {new} new")
        elif args.command == "build":
            print(build_guide().relative_to(ROOT))
        else:
            wrong = guide_problems()
            print(f"{GUIDE.name}: {'ready' if not wrong else f'{len(wrong)} to do'}")
    for book in books:
        if args.command == "extract":
            kept, stale, new = extract(book)
            print(f"{catalog_path(book).relative_to(ROOT)}: {kept} kept, {stale} stale, {new} new")
        elif args.command == "build":
            print(build(book).relative_to(ROOT))
        else:
            wrong = problems(book)
            print(f"{book.name}: {'ready' if not wrong else f'{len(wrong)} to do'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
