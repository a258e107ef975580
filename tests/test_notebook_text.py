"""What every notebook's text keeps: each "Next:" points at the next notebook with a link."""
import glob
import os
import re

import nbformat

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
