"""The code passes ruff (its settings: [tool.ruff] in pyproject.toml) and mypy ([tool.mypy]: where
processes meet, every function annotated), so the test command lints and type-checks too."""
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO


def _tool(name):
    beside_python = os.path.join(os.path.dirname(sys.executable), name)
    return beside_python if os.access(beside_python, os.X_OK) else shutil.which(name)


def test_ruff_finds_nothing():
    ruff = _tool("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -r requirements.txt)")
    done = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing():
    """mypy over the modules [tool.mypy] names: the runtime, the launcher and its checks and errors, the
    pool, the magic, the tutorials' shims (an ErrorRecord, a Reply, a WorkerJob are what cross)."""
    mypy = _tool("mypy")
    if mypy is None:
        if os.environ.get("CI"):
            pytest.fail("mypy is not installed, so the types went unchecked (pip install -r requirements.txt)")
        pytest.skip("mypy is not installed (pip install -r requirements.txt)")
    done = subprocess.run([mypy], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout and "ddp_helpers/runtime" in open(
        os.path.join(REPO, "pyproject.toml")).read(), done.stdout
