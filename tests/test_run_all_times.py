"""The measured Run All times (notebooks/run_all_times.json) and what learners read agree: each notebook's
header, the instructor's guide and the README's map (scripts/stamp_times.py writes all three)."""
import glob
import os
import sys

import nbformat
import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import stamp_times  # noqa: E402

TABLE = stamp_times.load()
COURSE = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "notebooks", "[0-9A][0-9]_*.ipynb")))


def test_every_notebook_of_the_course_was_measured_on_one_machine():
    assert sorted(TABLE["notebooks"]) == COURSE
    machine = TABLE["machine"]
    assert machine["cores"] >= 1 and machine["torch"] and machine["date"] and machine["short"] and machine["long"]
    for name, entry in TABLE["notebooks"].items():
        assert 0 < entry["run_all_s"] <= 90, f"{name}: Run All {entry['run_all_s']} s"


@pytest.mark.parametrize("name", COURSE)
def test_the_header_states_the_measured_run_all_time(name):
    head = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4).cells[0].source
    line = stamp_times.run_all_line(TABLE["notebooks"][name]["run_all_s"], TABLE)
    stated = [x for x in head.splitlines() if x.startswith("**Run All**:")]
    assert stated == [line], f"{name}: header says {stated}, the table says {line!r} (scripts/stamp_times.py)"


def test_the_instructors_guide_shows_the_table():
    guide = open(os.path.join(REPO, "notebooks", "instructors.md"), encoding="utf-8").read()
    assert stamp_times.guide_table(TABLE) in guide, \
        "instructors.md disagrees with the table: run scripts/stamp_times.py"


def test_the_readme_map_shows_each_notebooks_times():
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert stamp_times.stamp_readme(readme, TABLE) == readme, "README's map disagrees: run scripts/stamp_times.py"
    for name, _, minutes, seconds in stamp_times.rows(TABLE):
        assert f"(notebooks/{name}) |" in readme and f"| {stamp_times.readme_time(minutes, seconds)} |" in readme


@pytest.mark.parametrize("seconds, shown", [(3, 5), (12, 10), (13, 15), (58, 60), (61, 60), (66, 70), (85, 90)])
def test_times_are_rounded_as_a_reader_takes_them(seconds, shown):
    assert stamp_times.about(seconds) == shown
