"""The instructor's guide adds up: each track's rows sum to its slot, a day's rows to its hours, and a
notebook taught whole gets at least the time the notebook states."""
import glob
import os
import re
import sys

import nbformat
import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import stamp_times  # noqa: E402

GUIDE = open(os.path.join(REPO, "notebooks", "instructors.md"), encoding="utf-8").read()
COURSE = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "notebooks", "[0-9][0-9]_*.ipynb")))


def stated_minutes(name):
    return stamp_times.stated_minutes(nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4))


def section(title):
    start = GUIDE.index(title)
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start:end if end > 0 else len(GUIDE)]


def tables(text):
    """Each markdown table of text: a list of rows, each a list of cells (the header and rule left out)."""
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            found.append([r for r in rows[2:]])
            rows = []
    return found


def minutes(rows):
    total = 0
    for row in rows:
        m = re.fullmatch(r"(\d+) min", row[0])
        assert m, f"a row's first cell is its minutes: {row}"
        total += int(m.group(1))
    return total


def clock(text):
    h1, m1, h2, m2 = map(int, re.search(r"(\d\d):(\d\d)–(\d\d):(\d\d)", text).groups())
    return (h2 * 60 + m2) - (h1 * 60 + m1)


@pytest.mark.parametrize("title, slot", [("## The taster: 90 minutes", 90),
                                         ("## The advanced taster: 90 minutes", 90),
                                         ("## The half day: 3 hours", 180)])
def test_each_short_track_fills_its_slot_exactly(title, slot):
    (rows,) = tables(section(title))
    assert minutes(rows) == slot


def test_each_day_of_the_two_day_course_ends_when_it_says():
    course = section("## The two-day course")
    day1, day2 = course.split("**Day 2")
    (rows1,) = tables(day1)
    assert minutes(rows1) == clock(day1)
    base, track_a, track_b = tables(day2)
    spans = re.findall(r"(\d\d:\d\d)–(\d\d:\d\d) with track ([AB])", day2)
    assert len(spans) == 2
    for (start, end, track), rows in zip(spans, (track_a, track_b)):
        assert minutes(base) + minutes(rows) == clock(f"{start}–{end}"), track


def test_a_notebook_taught_whole_gets_its_stated_time_and_every_notebook_is_taught():
    course = section("## The two-day course")
    taught = set()
    for rows in tables(course):
        for row in rows:
            link = re.search(r"\]\(([0-9][0-9]_[^)]+\.ipynb)\)", row[1])
            if link and row[2].startswith("the core"):
                taught.add(link.group(1))
                assert minutes([row]) >= stated_minutes(link.group(1)), row
    assert taught == set(COURSE)


def test_every_notebook_has_its_hardware_and_skip_row():
    (rows,) = tables(section("## What each notebook needs"))
    linked = {re.search(r"\(([^)]+\.ipynb)\)", row[0]).group(1) for row in rows}
    assert linked == set(COURSE)


def test_common_mistakes_cover_notebooks_07_to_12():
    later = section("## What learners most often get wrong").split("In 07–12:")[1]
    for number in ("07", "08", "09", "10", "11", "12"):
        assert re.search(rf"\({number}\b|\({number}'s", later), f"no common mistake from {number}"
