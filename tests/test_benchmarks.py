"""benchmarks/ddp_cifar_gpu.py, ddp_overhead_gpu.py and perf_lab_1gpu.py: their --quick CPU check runs end
to end and writes sensible JSON; bad --fast-set values stop the script at once with a clear error."""
import csv
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import MINI, REPO, needs_mini, seconds


def benchmark(script, *args, timeout=180):
    """Run benchmarks/<script> with this Python; returns the finished process (text output)."""
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


QUICK = ("ddp_cifar_gpu.py", "ddp_overhead_gpu.py", "perf_lab_1gpu.py")
# The three --quick checks in one Python process (one torch import, one fork server for their ranks):
# each script runs as `python benchmarks/<script> --quick --out <folder>` would run it, and its exit
# status and error are written beside its JSON.
RUN_EACH = """
import json, os, runpy, sys, traceback
for script, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = [script, "--quick", "--out", out]
    status, error = 0, ""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        status, error = 1, traceback.format_exc()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "exit.json"), "w") as f:
        json.dump({"status": status, "error": error}, f)
"""


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """The folder each --quick script wrote to, after one process ran them all."""
    root = tmp_path_factory.mktemp("quick")
    outs = {script: root / script.replace(".py", "") for script in QUICK}
    done = subprocess.run([sys.executable, "-c", RUN_EACH,
                           *[str(a) for script in QUICK for a in (os.path.join("benchmarks", script), outs[script])]],
                          cwd=REPO, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return outs, done.stderr


def quick_report(script, quick_runs):
    """`script --quick` (run by quick_runs): check it succeeded, return the JSON it wrote (named after the script)."""
    outs, stderr = quick_runs
    ended = json.loads((outs[script] / "exit.json").read_text())
    assert ended["status"] == 0, ended["error"][-3000:] or stderr[-3000:]
    report = json.loads((outs[script] / script.replace(".py", ".json")).read_text())
    assert report["quick_check_only"] is True
    return report


def images_in(folder):
    return sum(len(files) for _, _, files in os.walk(folder))


@needs_mini
def test_ddp_cifar_gpu_quick_writes_its_report(quick_runs):
    report = quick_report("ddp_cifar_gpu.py", quick_runs)
    assert report["data"]["train_images"] == images_in(os.path.join(MINI, "train"))

    rows, summary = report["rows"], report["summary"]
    resnet = {r["gpus"]: r for r in rows if r["experiment"] == "resnet18_throughput"}
    fast = [r for r in rows if r["experiment"] == "fastnet_time_to_accuracy"]
    assert sorted(resnet) == [1, 2] and all(r["images_per_s"] > 0 for r in resnet.values())
    assert len(fast) == 4 and all(0 <= r["test_accuracy"] <= 1 and r["seconds"] > 0 for r in fast)  # 2 seeds x 2 counts
    assert summary["resnet18_scaling_efficiency"] == pytest.approx(
        resnet[2]["images_per_s"] / (2 * resnet[1]["images_per_s"]))
    for gpus in (1, 2):
        accuracies = [r["test_accuracy"] for r in fast if r["gpus"] == gpus]
        assert summary[f"fastnet_accuracy_mean_{gpus}gpu"] == pytest.approx(sum(accuracies) / len(accuracies))
    assert all(len(c) > 0 and "loss" in c[0] for c in report["curves"].values())
    # The settings recorded are the ones that ran (the quick check's small ones, not the full recipe)
    fast_settings = report["settings"]["fastnet"]
    assert fast_settings["width"] == 8 and fast_settings["cuda_graph"] is False
    assert fast_settings["batch_size"] * 2 == fast[0]["batch_per_gpu"] * fast[0]["gpus"]
    assert report["settings"]["resnet18"]["batch_size"] == resnet[1]["batch_per_gpu"]
    with open(quick_runs[0]["ddp_cifar_gpu.py"] / "ddp_cifar_gpu.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(rows)


@needs_mini
def test_ddp_overhead_gpu_quick_writes_every_case(quick_runs):
    report = quick_report("ddp_overhead_gpu.py", quick_runs)
    summary = report["summary"]
    assert len(summary) == 6 and "1 GPU" in summary
    # the NCCL cases are recorded with the environment their ranks saw (the script checks it)
    assert summary["2 GPUs, DDP, NCCL_MAX_CTAS=8"]["env"] == {"NCCL_MAX_CTAS": "8"}
    assert summary["2 GPUs, DDP"]["env"] == {}
    one = summary["1 GPU"]["images_per_s"]
    for case in summary.values():
        assert len(case["runs"]) == report["settings"]["repeats"] and all(r > 0 for r in case["runs"])
        assert case["images_per_s"] == pytest.approx(sum(case["runs"]) / len(case["runs"]))
        assert case["of_2x_one_gpu"] == pytest.approx(case["images_per_s"] / (2 * one))


@needs_mini
def test_perf_lab_1gpu_quick_records_every_setting_and_each_failure(quick_runs):
    report = quick_report("perf_lab_1gpu.py", quick_runs)
    assert report["command"].startswith("benchmarks/perf_lab_1gpu.py --quick") and report["machine"]["torch"]
    assert report["data"]["train_images"] == images_in(os.path.join(MINI, "train"))
    modes = report["step_modes"]
    assert sorted(modes) == ["fastnet", "resnet18"]
    for model, by_mode in modes.items():
        assert sorted(by_mode) == ["cuda_graph", "eager"]  # --quick leaves torch.compile out (minutes on a CPU)
        eager = by_mode["eager"]
        assert eager["error"] is None and len(eager["runs"]) == 1 and eager["images_per_s"] > 0
        assert eager["step_ms"] == pytest.approx(eager["batch_size"] / eager["images_per_s"] * 1e3)
        assert eager["batch_size"] == report["settings"]["models"][model]["batch_size"]
        # CUDA graphs need a GPU: the failure is recorded with its message, once, and the run goes on
        graph = by_mode["cuda_graph"]
        assert graph["images_per_s"] is None and graph["runs"] == [] and "GPU" in graph["error"]
    for experiment in ("data_pipeline", "loader_alone"):
        loaders = report[experiment]
        assert sorted(loaders) == ["DataLoader", "DeviceLoader"]
        assert all(entry["error"] is None and entry["images_per_s"] > 0 for entry in loaders.values())
    alone = report["loader_alone"]["DeviceLoader"]
    assert alone["batches_per_s"] == pytest.approx(alone["images_per_s"] / alone["batch_size"])
    # every run is a row: 2 models x 2 modes + 2 loaders x 2 experiments
    assert len(report["rows"]) == 8 and sum(1 for row in report["rows"] if row["error"]) == 2
    # the recorded settings are the ones that ran, without the recipes' step mode (the modes set it)
    resnet = report["settings"]["models"]["resnet18"]
    assert resnet["device"] == "cpu" and resnet["max_steps"] == report["settings"]["steps"]
    assert "cuda_graph" not in resnet


BAD_SETTINGS = [("epochs=zero", "epochs takes int values"), ("whiten=ture", "whiten is true or false"),
                ("nosuch=1", "unknown setting 'nosuch'")]
# Each bad setting as `python benchmarks/ddp_cifar_gpu.py --quick --out <folder> --fast-set <setting>` would
# run it, in one Python process (one torch import): its exit status, what it printed, how long it took.
RUN_BAD = """
import contextlib, io, json, runpy, sys, time
script, out = sys.argv[1:3]
results = []
for setting in sys.argv[3:]:
    sys.argv = [script, "--quick", "--out", out, "--fast-set", setting]
    stdout, stderr, status, start = io.StringIO(), io.StringIO(), 0, time.perf_counter()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            status = exc.code
    results.append({"status": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                    "seconds": time.perf_counter() - start})
print(json.dumps(results))
"""


def test_a_bad_fast_setting_stops_before_anything_runs(tmp_path):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUN_BAD, os.path.join("benchmarks", "ddp_cifar_gpu.py"),
                           str(tmp_path / "out"), *[setting for setting, _ in BAD_SETTINGS]],
                          cwd=REPO, capture_output=True, text=True, timeout=seconds(60))
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.perf_counter() - start < seconds(20)  # importing torch, nothing more
    for (setting, message), ran in zip(BAD_SETTINGS, json.loads(done.stdout), strict=True):
        assert ran["status"] == 2 and ran["stdout"] == "", (setting, ran)  # the first print comes after the checks
        errors = [line for line in ran["stderr"].splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in ran["stderr"], (setting, ran)
        assert ran["seconds"] < seconds(5), (setting, ran)   # the checks only: torch came with the first
    assert not (tmp_path / "out").exists()
