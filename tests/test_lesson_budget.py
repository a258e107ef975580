"""A notebook is a lesson: its core (from the title to the end of "## Summary") fits the time it states.

The budget, per stated minute T of learner time (reading, running, the exercise):
- markdown words in the core  <= 1600 + (T - 60) * 70 / 3   (60 min: 1,600; 90 min: 2,300; 30 min: 900)
- cells in the core           <= 32 + (T - 60) / 3          (60 min: 32;    90 min: 42;    30 min: 22)
How these were chosen: NOTEBOOK_STYLE.md's two anchor points (a learner reads about 150 words a minute
of technical prose, runs and looks at each cell, and needs its exercise time), joined by a straight
line (the instructor's guide, notebooks/instructors.md, shows each notebook's figures).

What follows the summary sits under one heading, "## Going further" (### subsections inside it, a
"### Sources" list among them): the instructor's guide tells a workshop to skip it. The core names at
most four objectives, and its prose cites no C++ file or line number (those belong in Going further).
"""
import glob
import os
import re
import sys

import nbformat
import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
from stamp_times import stated_minutes  # noqa: E402  (the one reader of a notebook's "**Time**" line)

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "[0-9A][0-9]_*.ipynb")))
MAX_MINUTES = 90
MAX_OBJECTIVES = 4


def word_budget(minutes: int) -> int:
    return int(1600 + (minutes - 60) * 70 / 3)


def cell_budget(minutes: int) -> int:
    return int(32 + (minutes - 60) / 3)


def summary_index(nb) -> int:
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("## Summary"):
            return i
    raise AssertionError("no '## Summary' cell: the summary ends the core")


def core(nb):
    return nb.cells[:summary_index(nb) + 1]


def words(cells) -> int:
    return sum(len(c.source.split()) for c in cells if c.cell_type == "markdown")


def objectives(nb) -> list:
    head = nb.cells[0].source
    found = re.search(r"\*\*After this notebook you can\*\*\s*\n((?:\s*[-*] .*\n?(?:  +\S.*\n?)*)+)", head)
    assert found, "the first cell lists its objectives under **After this notebook you can**"
    return [line for line in found.group(1).splitlines() if re.match(r"\s*[-*] ", line)]


# A C++/CUDA source file, or a "file:line" / "line N" reference, in prose.
CPP_REF = re.compile(r"[\w/.-]+\.(?:cpp|cc|cxx|cu|cuh|hpp|h)\b(?::\d+)?|\bline[s]? \d+|\.py:\d+")


def prose(markdown: str) -> str:
    """Markdown without its fenced code and link targets: what a learner reads as sentences."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return re.sub(r"\]\([^)]*\)", "]", text)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_the_core_fits_the_stated_time(path):
    nb = nbformat.read(path, as_version=4)
    minutes = stated_minutes(nb)
    assert minutes <= MAX_MINUTES, f"{minutes} minutes: a workshop slot is {MAX_MINUTES}"
    cells = core(nb)
    assert words(cells) <= word_budget(minutes), \
        f"core: {words(cells)} words of markdown, budget {word_budget(minutes)} for {minutes} minutes"
    assert len(cells) <= cell_budget(minutes), \
        f"core: {len(cells)} cells, budget {cell_budget(minutes)} for {minutes} minutes"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_at_most_four_objectives(path):
    found = objectives(nbformat.read(path, as_version=4))
    assert 1 <= len(found) <= MAX_OBJECTIVES, f"{len(found)} objectives: " + " | ".join(found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_what_follows_the_summary_is_going_further(path):
    nb = nbformat.read(path, as_version=4)
    rest = nb.cells[summary_index(nb) + 1:]
    if not rest:
        return
    first = rest[0]
    assert first.cell_type == "markdown" and first.source.lstrip().startswith("## Going further"), \
        "the first cell after the summary is '## Going further'"
    for cell in rest[1:]:
        if cell.cell_type == "markdown":
            second = [line for line in cell.source.splitlines() if re.match(r"#{1,2} ", line)]
            assert not second, f"after 'Going further', only ### subsections: {second}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_no_cpp_sources_in_the_core_prose(path):
    nb = nbformat.read(path, as_version=4)
    found = [(i, m.group(0)) for i, c in enumerate(core(nb)) if c.cell_type == "markdown"
             for m in CPP_REF.finditer(prose(c.source))]
    assert not found, f"C++ sources or line numbers in the core (move them to Going further): {found}"


def test_the_budget_line_runs_through_the_style_guide_anchor_points():
    assert (word_budget(60), cell_budget(60)) == (1600, 32)
    assert (word_budget(90), cell_budget(90)) == (2300, 42)
