"""The code passes ruff (its settings: [tool.ruff] in pyproject.toml), so the test command lints too."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def test_ruff_finds_nothing():
    beside_python = os.path.join(os.path.dirname(sys.executable), "ruff")
    ruff = beside_python if os.access(beside_python, os.X_OK) else shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -r requirements.txt)")
    done = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
