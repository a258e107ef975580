"""Run the whole test suite (unit tests, then every notebook under strict nbval) on a GPU machine,
within a time budget, and write a short report.

    python scripts/gpu_suite.py                      # budget 480 s, report in gpu-suite/
    python scripts/gpu_suite.py --budget-s 600 --out /tmp/report -- -k "not slow"

It is the README's test command (`python -m pytest`) run in this process, with these additions:
- a budget: once it is spent, no further test starts (the one running finishes, and the report
  names what was not run);
- the report, `report.md`: the machine (GPUs, torch, CUDA, NCCL), the counts, the time, the
  slowest tests, every failure in one line, and the skip reasons;
- the notebooks as this machine executed them (`notebooks/*.ipynb` in the output folder): on a GPU
  machine their live GPU cells show this machine's figures beside the stored references.
- while it runs, `progress.log`: a line as each test starts and ends, so that a run cut short still
  says what passed and what was running;
- a test still running `--grace-s` after the budget is stuck: its threads' stacks go to
  `stuck-<worker>.txt` (faulthandler), the run is interrupted, and the report names it.
It is a script, not a test: it exits 0 when everything that ran passed and the budget held.
"""
import argparse
import collections
import datetime
import os
import platform
import signal
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_lines():
    import torch
    lines = [f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"python {platform.python_version()}, torch {torch.__version__}, "
             f"CUDA {torch.version.cuda or '-'}, {os.cpu_count()} CPU cores"]
    if torch.cuda.is_available():
        names = collections.Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append("GPUs: " + ", ".join(f"{n} x {name}" for name, n in names.items()))
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        lines.append(f"NCCL {'.'.join(map(str, nccl)) if nccl else 'not available'}")
    else:
        lines.append("GPUs: none (the GPU tests skip, and the notebooks show stored references)")
    for package in ("torchvision", "nbval", "jupyter_client", "ipykernel", "ipywidgets", "matplotlib"):
        try:
            from importlib.metadata import version
            lines.append(f"{package} {version(package)}")
        except Exception:
            lines.append(f"{package}: not installed")
    return lines


NOT_RUN = "not run: the suite's time budget was spent"
DEADLINE_ENV = "GPU_SUITE_DEADLINE"     # time.time() after which no test starts (read in each worker)
GRACE_ENV = "GPU_SUITE_GRACE_S"         # a test still running this long after the deadline is stuck
OUT_ENV = "GPU_SUITE_OUT"               # the output folder, where a stuck test's stacks go
STACKS_WRITTEN_S = 5                    # after the grace: the stacks are written, the run is interrupted


# Hooks of this module, loaded with `-p gpu_suite` in this process and in each pytest-xdist worker.
def pytest_runtest_setup(item):
    deadline = float(os.environ.get(DEADLINE_ENV, "inf"))
    if time.time() > deadline:
        import pytest
        pytest.skip(NOT_RUN)
    if OUT_ENV in os.environ and deadline != float("inf"):
        _watch(item.nodeid, deadline + float(os.environ.get(GRACE_ENV, "60")))


def pytest_runtest_makereport(item, call):
    """A notebook cell's outputs travel with its report (from an xdist worker too)."""
    outputs = getattr(item, "test_outputs", None)
    if call.when == "call" and outputs is not None and hasattr(item, "cell_num"):
        import json
        item.user_properties.append(("nbval_cell", (str(item.parent.path), item.cell_num,
                                                    json.dumps(outputs, default=str))))


_watched = None   # (file, its size before this test's header, the header's size) while a test runs


def _watch(nodeid, stuck_at):
    """Should this test still run at `stuck_at`, faulthandler writes every thread's stack to this worker's file."""
    import faulthandler
    global _watched
    path = os.path.join(os.environ[OUT_ENV], f"stuck-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.txt")
    f = open(path, "ab")
    before = os.fstat(f.fileno()).st_size
    header = f"\n{nodeid}: still running {os.environ.get(GRACE_ENV, '60')} s after the budget; its threads:\n".encode()
    f.write(header)
    f.flush()
    _watched = (f, before, len(header))
    faulthandler.dump_traceback_later(max(stuck_at - time.time(), 0.1), file=f)


def pytest_runtest_logfinish(nodeid, location):
    """The test ended in time: its header goes (that of a stuck test stays, above its stacks)."""
    import faulthandler
    global _watched
    if _watched is None:
        return
    faulthandler.cancel_dump_traceback_later()
    f, before, header = _watched
    _watched = None
    if os.fstat(f.fileno()).st_size == before + header:
        f.truncate(before)
    f.close()


class Recorder:
    """Keeps each test's outcome, time and one-line reason, and each notebook cell's outputs."""

    def __init__(self, progress_path=None):
        self.reports = {}                      # nodeid -> (outcome, seconds, one line)
        self.not_run = []
        self.cells = collections.defaultdict(dict)   # notebook path -> {code cell index: outputs}
        self.running = {}                      # nodeid -> time.monotonic() when it started
        self.started = time.monotonic()
        self.progress = open(progress_path, "w", buffering=1) if progress_path else None
        self.interrupted = False               # by the timer, for tests still running past the grace

    def _log(self, what, nodeid):
        if self.progress:
            self.progress.write(f"{time.monotonic() - self.started:7.1f} s  {what:<8} {nodeid}\n")

    def pytest_runtest_logstart(self, nodeid, location):
        self.running[nodeid] = time.monotonic()
        self._log("start", nodeid)

    def pytest_runtest_logfinish(self, nodeid, location):
        self.running.pop(nodeid, None)
        self._log(self.reports.get(nodeid, ("ended",))[0], nodeid)

    def pytest_runtest_logreport(self, report):
        import json
        if report.when == "???":               # its xdist worker crashed: it ends here (no logfinish)
            self.running.pop(report.nodeid, None)
        outcome, seconds, line = self.reports.get(report.nodeid, ("passed", 0.0, ""))
        seconds += report.duration
        if report.failed:
            outcome, line = ("failed" if report.when == "call" else "error"), last_line(report)
        elif report.skipped and outcome == "passed":
            outcome = "skipped"
            line = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if NOT_RUN in line:
                self.not_run.append(report.nodeid)
                outcome = "not run"
        self.reports[report.nodeid] = (outcome, seconds, line)
        for key, value in report.user_properties:
            if key == "nbval_cell":
                path, index, outputs = value
                self.cells[path][index] = json.loads(outputs)


def last_line(report):
    text = str(report.longrepr).strip().splitlines()
    interesting = [line for line in text if line.startswith("E ") or "Error" in line]
    return (interesting or text or [""])[-1].strip()[:300]


def write_notebooks(cells, folder):
    import nbformat
    os.makedirs(folder, exist_ok=True)
    for path, outputs in cells.items():
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]   # nbval numbers the code cells
        for index, cell in enumerate(code):
            if index in outputs:
                cell.outputs = [nbformat.from_dict(output) for output in outputs[index]]
        with open(os.path.join(folder, os.path.basename(path)), "w") as f:
            nbformat.write(nb, f)


def report_lines(recorder, seconds, budget_s, machine, out=None):
    stuck_tests = recorder.running if recorder.interrupted else {}
    counts = collections.Counter(outcome for nodeid, (outcome, _, _) in recorder.reports.items()
                                 if nodeid not in stuck_tests)   # a stuck test passed its setup only
    stuck = f", {len(stuck_tests)} stuck" if stuck_tests else ""
    lines = ["# Test suite on this machine", "", *[f"- {line}" for line in machine], "",
             f"- {recorder.workers} pytest-xdist workers" if recorder.workers else "- tests run one after another", "",
             f"**{counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
             f"{counts['skipped']} skipped, {len(recorder.not_run)} not run (budget){stuck}** "
             f"in {seconds:.0f} s (budget {budget_s:.0f} s)", ""]
    if stuck_tests:
        now = time.monotonic()
        lines += ["## Stuck: still running when the run was interrupted", ""]
        lines += [f"- `{nodeid}`, for {now - began:.0f} s" for nodeid, began in stuck_tests.items()]
        lines += ["", f"Their threads' stacks: `stuck-*.txt` in {out or 'the output folder'}.", ""]
    failures = [(nodeid, line) for nodeid, (outcome, _, line) in recorder.reports.items()
                if outcome in ("failed", "error")]
    if failures:
        lines += ["## Failures", ""] + [f"- `{nodeid}`: {line}" for nodeid, line in failures] + [""]
    if recorder.not_run:
        lines += ["## Not run: the budget was spent", ""] + [f"- `{n}`" for n in recorder.not_run[:50]]
        lines += [f"- … and {len(recorder.not_run) - 50} more"] if len(recorder.not_run) > 50 else []
        lines += [""]
    slowest = sorted(recorder.reports.items(), key=lambda kv: -kv[1][1])[:12]
    lines += ["## Slowest", ""] + [f"- {s:6.1f} s `{nodeid}`" for nodeid, (_, s, _) in slowest] + [""]
    per_file = collections.defaultdict(float)
    for nodeid, (_, s, _) in recorder.reports.items():
        per_file[nodeid.split("::")[0]] += s
    lines += ["## Time per file", ""] + [f"- {s:6.1f} s `{f}`" for f, s in
                                        sorted(per_file.items(), key=lambda kv: -kv[1])] + [""]
    reasons = collections.Counter(line for outcome, _, line in recorder.reports.values() if outcome == "skipped")
    if reasons:
        lines += ["## Skipped, by reason", ""] + [f"- {n} x {reason}" for reason, n in reasons.most_common()]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="no test starts after this many seconds (default 480: 8 minutes)")
    parser.add_argument("--grace-s", type=float, default=60.0,
                        help="a test still running this long after the budget is stuck: its stacks are "
                             "written and the run is interrupted (default 60)")
    parser.add_argument("--out", default=os.path.join(REPO, "gpu-suite"),
                        help="folder for report.md, junit.xml and the executed notebooks")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers (default: 4 where pytest-xdist is installed and the "
                             "machine has 8 cores or more, else none: tests run one after another)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.grace_s <= 0:
        parser.error("--budget-s and --grace-s must be positive")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):          # an earlier run's stacks would mislead
        if name.startswith("stuck-") and name.endswith(".txt"):
            os.remove(os.path.join(args.out, name))
    import pytest

    os.chdir(REPO)
    machine = machine_lines()
    print("\n".join(machine), flush=True)
    workers = args.workers
    if workers is None:
        import importlib.util
        workers = 4 if importlib.util.find_spec("xdist") and (os.cpu_count() or 1) >= 8 else 0
    # this file is also the plugin that each xdist worker loads (`-p gpu_suite`)
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    deadline = time.time() + args.budget_s
    os.environ.update({DEADLINE_ENV: str(deadline), GRACE_ENV: str(args.grace_s), OUT_ENV: args.out})
    parallel = ["-n", str(workers), "--dist", "loadscope"] if workers else []  # a notebook stays in one worker
    print(f"{workers or 'no'} pytest-xdist workers", flush=True)
    recorder = Recorder(os.path.join(args.out, "progress.log"))
    recorder.workers = workers
    start = time.monotonic()
    # A stuck test: once the workers have written its stacks (at the deadline plus the grace), interrupt
    # the run as Ctrl-C would (pytest-xdist ends its workers), and report what was still running.
    def interrupt_if_stuck():
        if recorder.running:
            recorder.interrupted = True
            os.kill(os.getpid(), signal.SIGINT)

    interrupt = threading.Timer(deadline + args.grace_s + STACKS_WRITTEN_S - time.time(), interrupt_if_stuck)
    interrupt.daemon = True
    interrupt.start()
    try:
        code = pytest.main(["-p", "no:cacheprovider", "-p", "gpu_suite", *parallel,
                            "--junitxml", os.path.join(args.out, "junit.xml"), *args.pytest_args],
                           plugins=[recorder])
    except KeyboardInterrupt:                  # one that reached past pytest's own handling
        code = 2
    finally:
        interrupt.cancel()
    seconds = time.monotonic() - start
    write_notebooks(recorder.cells, os.path.join(args.out, "notebooks"))
    lines = report_lines(recorder, seconds, args.budget_s, machine, args.out)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(next(line for line in lines if line.startswith("**")))
    print(f"report: {os.path.join(args.out, 'report.md')}")
    over = seconds > args.budget_s or recorder.not_run or recorder.interrupted
    return 1 if (code != 0 or over) else 0


if __name__ == "__main__":
    sys.exit(main())
