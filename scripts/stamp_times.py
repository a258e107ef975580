"""Write the measured Run All times (notebooks/run_all_times.json) where learners and instructors read them.

    .venv/bin/python scripts/browser_run_all.py --write-times   # measure: JupyterLab in Chromium, every notebook
    .venv/bin/python scripts/stamp_times.py                     # then write the figures into:

- each notebook's first cell: a line "**Run All**: about N s on <machine>", under its "**Time**" line
  (the learner's time: reading, running, the exercise, which the notebook's author states);
- the instructor's guide (notebooks/instructors.md): the table between its "run-all-times" markers;
- the README's map of the notebooks: the "time" column, "learner minutes · Run All".

tests/test_run_all_times.py fails when any of them disagrees with the table, so a new measurement
or a new stated time is written everywhere at once by this script.

The Chinese edition's catalog entry for that first cell follows (scripts/zh_catalogs.py restamp): its English
text becomes the new one and its translation gets the new number, so the entry stays current, and the
Chinese notebook is built again. A change it cannot carry over leaves the entry fuzzy, for a translator.
"""
import json
import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zh_catalogs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
TABLE = NOTEBOOKS / "run_all_times.json"
GUIDE = NOTEBOOKS / "instructors.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- run-all-times: begin (scripts/stamp_times.py writes this table) -->", "<!-- run-all-times: end -->"


def load():
    return json.loads(TABLE.read_text(encoding="utf-8"))


def about(seconds: float) -> int:
    """A measured time as a reader takes it in: to 5 s below a minute, to 10 s above, never 0."""
    step = 5 if seconds < 60 else 10
    return max(step, int(seconds / step + 0.5) * step)   # half up (Python's round() halves to even)


def run_all_line(seconds: float, table: dict) -> str:
    return f"**Run All**: about {about(seconds)} s on {table['machine']['short']}, kernel restart included."


def stated_minutes(nb) -> int:
    head = "\n".join(c.source for c in nb.cells[:2])
    found = re.search(r"\*\*Time\*\*:?\*?\*? about (\d+) minutes", head)
    if not found:
        raise ValueError("the first cell states no '**Time**: about N minutes'")
    return int(found.group(1))


def title(nb) -> str:
    return nb.cells[0].source.splitlines()[0].lstrip("# ").strip()


def rows(table):
    """(file, title, learner minutes, Run All seconds) for every measured notebook, in course order."""
    out = []
    for name, entry in sorted(table["notebooks"].items()):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        out.append((name, title(nb), stated_minutes(nb), entry["run_all_s"]))
    return out


def stamp_notebook(path: Path, line: str) -> bool:
    nb = nbformat.read(path, as_version=4)
    lines = nb.cells[0].source.splitlines()
    kept = [x for x in lines if not x.startswith("**Run All**:")]
    at = next((i for i, x in enumerate(kept) if "**Time**" in x), None)
    if at is None:
        raise SystemExit(f"{path.name}: no **Time** line in the first cell")
    while at + 1 < len(kept) and kept[at + 1].strip() and not kept[at + 1].startswith(("**", "#", "-")):
        at += 1                                   # the Time sentence may run over several lines
    new = "\n".join(kept[:at + 1] + [line] + kept[at + 1:])
    if new == nb.cells[0].source:
        return False
    old, nb.cells[0].source = nb.cells[0].source, new
    nbformat.write(nb, path)
    stamp_translation(path, nb.cells[0].id, old, new)
    return True


def stamp_translation(path: Path, cell_id: str, old: str, new: str) -> None:
    """The Chinese edition follows the English first cell: its catalog entry, then its notebook."""
    outcome = zh_catalogs.restamp(path, cell_id, old, new)
    if outcome == "fuzzy":
        print(f"{zh_catalogs.catalog_path(path).name}: the first cell's translation needs a translator (fuzzy)")
    elif outcome == "updated" and (zh_catalogs.ZH / path.name).exists() and not zh_catalogs.problems(path):
        zh_catalogs.build(path)


def guide_table(table) -> str:
    machine = table["machine"]
    lines = [BEGIN, "",
             f"Learner time: reading, running and the exercise, as each notebook states it. Run All: Restart "
             f"Kernel and Run All Cells in JupyterLab, measured on {machine['long']} "
             f"({machine['date']}, `scripts/browser_run_all.py`).", "",
             "| notebook | learner time | Run All |", "| --- | --- | --- |"]
    for name, name_title, minutes, seconds in rows(table):
        lines.append(f"| [{name_title}]({name}) | {minutes} min | {about(seconds)} s |")
    return "\n".join(lines + ["", END])


def readme_time(minutes: int, seconds: float) -> str:
    return f"{minutes} min · {about(seconds)} s"


def stamp_readme(text: str, table) -> str:
    by_file = {name: (minutes, seconds) for name, _, minutes, seconds in rows(table)}
    out = []
    for line in text.splitlines():
        link = re.match(r"\| \[[^\]]+\]\(notebooks/([^)]+\.ipynb)\) \|", line)
        if link and link.group(1) in by_file:
            cells = line.split(" | ")
            cells[-2] = readme_time(*by_file[link.group(1)])
            line = " | ".join(cells)
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def main():
    table = load()
    changed = []
    for name, entry in table["notebooks"].items():
        if stamp_notebook(NOTEBOOKS / name, run_all_line(entry["run_all_s"], table)):
            changed.append(name)
    guide = GUIDE.read_text(encoding="utf-8")
    if BEGIN not in guide:
        raise SystemExit(f"{GUIDE.name}: no {BEGIN}")
    start, end = guide.index(BEGIN), guide.index(END) + len(END)
    new_guide = guide[:start] + guide_table(table) + guide[end:]
    if new_guide != guide:
        GUIDE.write_text(new_guide, encoding="utf-8")
        changed.append(GUIDE.name)
        if zh_catalogs.GUIDE_ZH.exists() and not zh_catalogs.guide_problems():
            zh_catalogs.build_guide()                 # the Chinese guide copies the new table as it is
    readme = README.read_text(encoding="utf-8")
    new_readme = stamp_readme(readme, table)
    if new_readme != readme:
        README.write_text(new_readme, encoding="utf-8")
        changed.append(README.name)
    print("stamped: " + (", ".join(changed) or "nothing changed"))


if __name__ == "__main__":
    sys.exit(main())
