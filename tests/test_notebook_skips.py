"""The plugin tests/pytest_notebooks.py skips notebook cells tagged `needs-cifar10` where CIFAR-10 cannot be had,
with the reason, and runs them where it can."""
import os
import subprocess
import sys

import nbformat
from conftest import REPO


def run_notebook_tests(tmp_path, data_folder):
    nb = nbformat.v4.new_notebook()
    needs_data = nbformat.v4.new_code_cell("raise RuntimeError('the data cell ran')")
    needs_data.metadata["tags"] = ["needs-cifar10"]
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), needs_data, nbformat.v4.new_code_cell("assert x == 1")]
    nbformat.write(nb, str(tmp_path / "lesson.ipynb"))
    env = dict(os.environ, DDP_HELPERS_CIFAR10=str(data_folder), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), REPO,
                                                          os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-p", "pytest_notebooks", "--nbval", "--nbval-current-env", "-rs", "-q",
                           "lesson.ipynb"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_tagged_cell_is_skipped_with_the_reason_where_there_is_no_data(tmp_path):
    result = run_notebook_tests(tmp_path, tmp_path / "no-such-copy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed, 1 skipped" in result.stdout, result.stdout
    assert "has no train/ folder" in result.stdout, result.stdout   # the data code's own reason


def test_tagged_cell_runs_where_there_is_data(tmp_path):
    for split in ("train", "test"):
        os.makedirs(tmp_path / "copy" / split)
    result = run_notebook_tests(tmp_path, tmp_path / "copy")
    assert result.returncode != 0
    assert "the data cell ran" in result.stdout, result.stdout
