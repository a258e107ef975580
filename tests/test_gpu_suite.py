"""scripts/gpu_suite.py, the whole suite on a GPU machine within a budget: a test that hangs must not
take the run (and its report) with it."""
import os
import subprocess
import sys
import time

import nbformat
import psutil
from conftest import REPO, seconds

CASES = '''
import os
import time


def test_quick():
    pass


def test_forever():
    with open(os.environ["STUCK_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
'''


def test_a_stuck_test_is_named_with_its_stacks_and_the_run_ends(tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "test_cases.py").write_text(CASES)
    (cases / "pytest.ini").write_text("[pytest]\n")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")]),
                   str(cases / "tiny.ipynb"))   # its executed outputs go to out/notebooks/
    out, pid_file = tmp_path / "out", tmp_path / "stuck.pid"
    budget, grace = seconds(5), 2   # time for two xdist workers to start on a busy machine
    start = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_suite.py"), "--budget-s", str(budget),
                           "--grace-s", str(grace), "--workers", "2", "--out", str(out),
                           "--", "-c", str(cases / "pytest.ini"), "--nbval-lax", "--nbval-current-env", str(cases)],
                          env={**os.environ, "STUCK_PID_FILE": str(pid_file)}, capture_output=True, text=True,
                          timeout=budget + grace + seconds(30))
    took = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    assert took < budget + grace + seconds(20), took
    report = (out / "report.md").read_text()
    assert " 0 failed, " in report and ", 1 stuck**" in report, report
    assert "- `test_cases.py::test_forever`, for " in report
    executed = nbformat.read(str(out / "notebooks" / "tiny.ipynb"), as_version=4)
    assert executed.cells[0].outputs[0]["text"] == "42\n", executed.cells[0]
    stacks = "".join(p.read_text() for p in out.glob("stuck-*.txt"))
    assert f"test_cases.py::test_forever: still running {float(grace)} s after the budget" in stacks, stacks
    assert "in test_forever" in stacks and "test_quick" not in stacks
    progress = (out / "progress.log").read_text().split("\n")
    assert any(line.endswith("   test_cases.py::test_quick") for line in progress), progress
    assert any(line.endswith("start    test_cases.py::test_forever") for line in progress), progress
    worker = int(pid_file.read_text())                       # the worker that ran it is gone too
    deadline = time.monotonic() + seconds(10)
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(worker)


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
