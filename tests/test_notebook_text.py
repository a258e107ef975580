"""What every notebook's text keeps: each "Next:" points at the next notebook with a link."""
import glob
import os
import re

import nbformat
import pytest
from conftest import REPO


def test_every_next_is_a_link_to_a_notebook_that_exists():
    found = 0
    for path in sorted(glob.glob(os.path.join(REPO, "notebooks", "[0-9][0-9]_*.ipynb"))):
        for cell in nbformat.read(path, as_version=4).cells:
            for line in cell.source.splitlines() if cell.cell_type == "markdown" else []:
                if line.startswith("Next:"):
                    found += 1
                    link = re.match(r"Next: \[[^\]]+\]\(([^)]+\.ipynb)\)", line)
                    assert link, f"{os.path.basename(path)}: not a link: {line}"
                    assert os.path.exists(os.path.join(REPO, "notebooks", link.group(1))), line
    assert found >= 10


NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "[0-9][0-9]_*.ipynb")))
WIDTH = 100   # what JupyterLab shows at 1400 px without wrapping a line mid-word or scrolling sideways


def _text_outputs(cell):
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            yield out.text
        elif out.output_type in ("execute_result", "display_data") and "text/plain" in out.data \
                and not ({"image/png", "text/html", "application/vnd.jupyter.widget-view+json"} & set(out.data)):
            yield out.data["text/plain"]
        elif out.output_type == "error":
            yield "\n".join(out.traceback)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_code_and_printed_lines_fit_the_notebook_width(path):
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    too_long = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        texts = [("code", cell.source)] + [("output", t) for t in _text_outputs(cell)]
        for kind, text in texts:
            for line in ansi.sub("", text).splitlines():
                if len(line) > WIDTH:
                    too_long.append(f"cell {i} {kind} ({len(line)}): {line[:60]}...")
    assert not too_long, "\n".join(too_long)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_each_notebook_fits_a_workshop_slot(path):
    nb = nbformat.read(path, as_version=4)
    # The core's own budget is tests/test_lesson_budget.py's; "Going further" after it is bounded too,
    # so the whole notebook still reads as one lesson with its appendix, not two notebooks in one.
    assert len(nb.cells) <= 60, f"{len(nb.cells)} cells: a lesson and its Going further hold at most 60"
    head = nb.cells[0].source + "\n" + (nb.cells[1].source if len(nb.cells) > 1 else "")
    minutes = re.search(r"\*\*Time\*\*:?\*?\*? about (\d+) minutes", head)
    assert minutes, "the first cell states **Time**: about N minutes"
    assert int(minutes.group(1)) <= 90


ZH_NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "zh", "[0-9][0-9]_*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS + ZH_NOTEBOOKS,
                         ids=lambda p: os.path.relpath(p, os.path.join(REPO, "notebooks")))
def test_a_cell_whose_committed_output_is_an_error_is_marked_as_expected(path):
    """nbval and JupyterLab's Run All go on past such a cell only when it says the error is meant: the
    cell tag raises-exception (the way for a %%ddp cell, whose first line must be the magic), or an
    NBVAL_RAISES_EXCEPTION comment."""
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if any(out.output_type == "error" for out in cell.get("outputs", [])):
            assert ("raises-exception" in cell.metadata.get("tags", [])
                    or "NBVAL_RAISES_EXCEPTION" in cell.source), f"cell {index}: an error output, not marked"
