"""ddp_helpers.bench and bench_plots: nccl-tests' formulas by hand, a slow fake, real Gloo sweeps, the CLI."""
import importlib.util
import math
import os
import re
import subprocess
import sys
import time

import matplotlib
import pytest
import torch
import torch.distributed as dist
from conftest import REPO, needs_2_gpus, needs_gpu
from like_torchrun import run_module_like_torchrun

from ddp_helpers import WorkerError, bench, launch, machine, reference, torchrun
from ddp_helpers import bench_plots as plots

matplotlib.use("Agg")
MiB = 2**20


# ---- worker functions (module level: cloudpickle sends them by reference) ----
def slow_fake_sweep(sizes):
    """The real sweep, with each collective replaced by a sleep: rank r sleeps (r + 1) * 10 ms."""
    def fake_prepare(collective, count, dtype, device):
        out = torch.zeros(count, dtype=dtype)
        return (lambda: time.sleep((dist.get_rank() + 1) * 0.010)), out, lambda: out
    bench.timing.prepare = fake_prepare
    return bench.sweep("all_reduce", sizes, iters=5, warmup=1)


def sweep_every_collective(sizes, dtype, device="cpu", cuda_graph=False, collectives=bench.COLLECTIVES):
    return {c: bench.sweep(c, sizes, dtype=dtype, device=device, iters=2, warmup=1, cuda_graph=cuda_graph)
            for c in collectives}


def sweep_with_broken_collective(how):
    """A collective that does nothing, or that writes one wrong element per rank: #wrong must see it."""
    real = bench.prepare

    def broken(collective, count, dtype, device):
        call, out, expected = real(collective, count, dtype, device)
        if how == "skip":
            return (lambda: None), out, expected
        return (lambda: (call(), out.view(-1)[0].add_(1))), out, expected
    bench.timing.prepare = broken
    return bench.sweep("all_reduce", [4096], iters=1, warmup=0)


# ------------------------------------------------ formulas, computed by hand
# n = 4 ranks, 1 MiB of float32 requested, 100 µs per call: algbw = 1048576 B / 100e-6 s = 10.48576 GB/s.
HAND = {  # collective: (count column, S, busbw)
    "all_reduce": (262144, MiB, 10.48576 * 2 * 3 / 4),       # factor 2(n-1)/n = 1.5
    "all_gather": (65536, MiB, 10.48576 * 3 / 4),            # count is each rank's chunk: 262144 / 4
    "reduce_scatter": (65536, MiB, 10.48576 * 3 / 4),
    "all_to_all": (65536, MiB, 10.48576 * 3 / 4),
    "broadcast": (262144, MiB, 10.48576),
    "reduce": (262144, MiB, 10.48576),
    "sendrecv": (262144, MiB, 10.48576),
}


@pytest.mark.parametrize("collective", bench.COLLECTIVES)
def test_formulas_match_hand_computed_values(collective):
    count, S, busbw = HAND[collective]
    assert bench.plan(collective, MiB, 4, world_size=4) == (count, S)
    assert bench.algbw_GBps(S, 100.0) == pytest.approx(10.48576, rel=1e-12)
    assert bench.busbw_GBps(collective, S, 100.0, 4) == pytest.approx(busbw, rel=1e-12)


def test_factors_and_rounding_for_other_world_sizes():
    assert bench.bus_factor("all_reduce", 8) == 1.75 and bench.bus_factor("all_reduce", 1) == 0
    assert bench.bus_factor("all_gather", 2) == 0.5 and bench.bus_factor("sendrecv", 8) == 1
    assert bench.plan("all_gather", 1000, 4, 3) == (83, 996)       # 250 elements -> 83 per rank
    assert bench.plan("all_reduce", 10, 4, 3) == (2, 8)            # whole elements only, as nccl-tests
    assert bench.plan("all_reduce", 8, 2, 2) == (4, 8)             # half


def test_sizes_parse_like_nccl_tests():
    assert [bench.parse_size(s) for s in ("8", "64K", "1M", "1G", "2GiB")] == [8, 65536, MiB, 2**30, 2**31]
    assert bench.size_range(8, "1K") == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert bench.size_range(8, 1000, factor=4) == [8, 32, 128, 512]
    with pytest.raises(ValueError, match="cannot read size"):
        bench.parse_size("1X")


@pytest.mark.parametrize("call, message", [
    (lambda: bench.plan("all_gatherr", 8, 4, 2), "unknown collective 'all_gatherr': choose one of all_reduce"),
    (lambda: bench.plan("all_reduce", 2, 4, 2), "message size 2 B is smaller than one element \\(4 B\\)"),
    (lambda: bench.plan("all_to_all", 8, 4, 4), "all_to_all over 4 ranks needs at least 4 elements \\(16 B\\)"),
    (lambda: bench.check_setup("gloo", "cuda", True), "cuda_graph=True needs backend='nccl'"),
    (lambda: bench.check_setup("nccl", "cpu", False), "NCCL only moves CUDA tensors"),
    (lambda: bench.measure("sendrecv", [8], device="cuda"), "Gloo cannot send/recv CUDA tensors"),
    (lambda: bench.resolve_dtype("float8"), "unsupported dtype 'float8'"),
    (lambda: bench.measure("all_reduce", [8], backend="gloo", cuda_graph=True), "cuda_graph=True needs"),
    (lambda: bench.measure("all_reduce", [8], iters=0), "iters must be an int >= 1"),
])
def test_bad_input_gives_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_table_has_the_all_reduce_perf_layout():
    row = {"bytes": 8, "count": 2, "dtype": "float", "redop": "sum", "root": -1,
           "time_us": 19.26, "algbw_GBps": 8 / 19.26e-6 / 1e9, "busbw_GBps": 8 / 19.26e-6 / 1e9, "wrong": 0}
    # a line of nccl-tests' output, out-of-place group
    assert bench.format_row(row) == ("           8             2     float     sum      -1"
                                     "    19.26    0.00    0.00       0")
    assert bench.format_row(dict(row, bytes=2**30, count=2**28, time_us=3430.1234, algbw_GBps=313.04,
                                 busbw_GBps=313.04)) == \
        "  1073741824     268435456     float     sum      -1  3430.12  313.04  313.04       0"
    assert bench.table._fixed(12345678.0, 7) == "1.2e+07"


def test_csv_round_trip(tmp_path):
    rows = [{"collective": "all_reduce", "bytes": 8, "time_us": 19.5, "cuda_graph": False, "note": ""},
            {"collective": "all_reduce", "bytes": 16, "time_us": 20.0, "cuda_graph": True, "note": "x=1"}]
    reference.write_rows(rows, tmp_path / "sub" / "rows.csv")
    assert reference.read_rows(tmp_path / "sub" / "rows.csv") == rows


def test_compare_gives_ratio_per_common_size():
    ours = [{"bytes": 8, "algbw_GBps": 2.0}, {"bytes": 16, "algbw_GBps": 3.0}]
    gloo = [{"bytes": 16, "algbw_GBps": 1.5}, {"bytes": 32, "algbw_GBps": 1.0}]
    assert bench.compare(ours, gloo) == [{"bytes": 16, "ours": 3.0, "baseline": 1.5, "ratio": 2.0}]


def test_available_setups_on_this_machine():
    setups = bench.available_setups(2)
    assert ("gloo", "cpu") in setups
    assert (("nccl", "cuda") in setups) == (machine.gpu_count() >= 2 and dist.is_nccl_available())
    assert (("gloo", "cuda") in setups) == (machine.gpu_count() >= 1)


# ---------------------------------------------------- through real processes
def test_slow_fake_collective_gives_known_time_and_busbw():
    rows = launch(slow_fake_sweep, 2, "gloo", args=([4096, MiB],), quiet=True)[0]
    assert [r["bytes"] for r in rows] == [4096, MiB]
    for r in rows:
        # rank 0 sleeps 10 ms, rank 1 sleeps 20 ms: the mean over ranks is 15 ms. A sleep overshoots, by
        # a few ms on a busy machine; the slowest rank's 20 ms (or the fastest's 10) would be another rule.
        assert 15_000 <= r["time_us"] < 19_000, r
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3, rel=1e-9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2, rel=1e-9)
        assert r["busbw_GBps"] == pytest.approx(r["bytes"] / 15_000e-6 / 1e9, rel=0.3)
        assert r["wrong"] == 0


def test_every_collective_is_correct_on_three_gloo_ranks():
    # three ranks: with two, "send to the next rank" and "to the previous one" are the same rank
    by_collective = launch(sweep_every_collective, 3, "gloo", args=([64, 65536], torch.float32), quiet=True)[0]
    for collective, rows in by_collective.items():
        for requested, r in zip([64, 65536], rows):
            assert (r["count"], r["bytes"]) == bench.plan(collective, requested, 4, 3)
            assert r["wrong"] == 0, (collective, r)
            assert r["time_us"] > 0 and math.isfinite(r["busbw_GBps"])
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bench.bus_factor(collective, 3))
            assert (r["world_size"], r["backend"], r["device"], r["dtype"]) == (3, "gloo", "cpu", "float")


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_measure_other_dtypes_exactly(dtype):
    rows = bench.measure("all_reduce", [64, 4096], world_size=2, dtype=dtype, iters=2, warmup=1)
    assert [(r["dtype"], r["wrong"]) for r in rows] == [(dtype, 0), (dtype, 0)]


def test_wrong_results_are_counted():
    skipped = launch(sweep_with_broken_collective, 2, "gloo", args=("skip",), quiet=True)[0][0]
    assert skipped["wrong"] > 1024  # 1024 elements per rank, of which 6 in 7 differ from the sum
    corrupted = launch(sweep_with_broken_collective, 2, "gloo", args=("corrupt",), quiet=True)[0][0]
    assert corrupted["wrong"] == 2  # one element on each of the two ranks


def test_measure_starts_graph_ranks_with_graph_env(monkeypatch):
    seen = []
    monkeypatch.setattr("ddp_helpers.launcher.launch", lambda *a, env=None, **k: seen.append(env) or [[]])
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    bench.measure("all_reduce", [8], backend="nccl", device="cuda", cuda_graph=True, env={"NCCL_DEBUG": "INFO"})
    bench.measure("all_reduce", [8], backend="nccl", device="cuda", cuda_graph=False)
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "1")  # the user's own setting wins
    bench.measure("all_reduce", [8], backend="nccl", device="cuda", cuda_graph=True)
    assert seen == [{"NCCL_GRAPH_MIXING_SUPPORT": "0", "NCCL_DEBUG": "INFO"}, {}, {}]


def test_sweep_refuses_cuda_graph_with_gloo_inside_a_rank():
    with pytest.raises(WorkerError, match="cuda_graph=True needs backend='nccl'"):
        launch(bench.sweep, 2, "gloo", args=("all_reduce", [8]), kwargs={"cuda_graph": True}, quiet=True)


@needs_2_gpus
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_every_collective_is_correct_with_nccl(cuda_graph):
    by_collective = launch(sweep_every_collective, 2, "nccl", args=([64, MiB], torch.bfloat16, "cuda", cuda_graph),
                           quiet=True, timeout=120)[0]
    for collective, rows in by_collective.items():
        assert [r["wrong"] for r in rows] == [0, 0], collective
        assert all(0 < r["time_us"] < 10_000 and r["cuda_graph"] == cuda_graph for r in rows), rows


@needs_gpu
def test_gloo_on_cuda_tensors():
    collectives = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
    by_collective = launch(sweep_every_collective, 2, "gloo", args=([64, MiB], torch.float32, "cuda", False,
                                                                     collectives), quiet=True, timeout=120)[0]
    for collective, rows in by_collective.items():
        assert [(r["wrong"], r["device"]) for r in rows] == [(0, "cuda"), (0, "cuda")], collective
        assert rows[0]["hardware"] == machine.gpu_names()[0]


# ---------------------------------------------------------------- the CLI
def run_like_torchrun(args, nproc=2, timeout=60):
    return run_module_like_torchrun("ddp_helpers.bench", args, nproc, timeout)


def check_table(stdout, sizes):
    """stdout holds the all_reduce_perf header and one row per size (lines may start with '[rank 0] ')."""
    lines = [re.sub(r"^\[rank \d+\] ", "", line) for line in stdout.splitlines()]
    assert ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"] in \
        [line.split() for line in lines], stdout
    assert all(len(line) <= 100 for line in lines), stdout   # a notebook would wrap longer lines mid-word
    rows = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    assert [int(r[0]) for r in rows] == sizes, stdout
    assert all(r[3:5] == ["sum", "-1"] and r[8] == "0" for r in rows), stdout



def test_header_lines_fit_a_notebook():
    info = {"collective": "reduce_scatter", "world_size": 2, "backend": "gloo", "device": "cpu",
            "hardware": "Intel(R) Xeon(R) Processor (32 cores)", "iters": 50, "warmup": 5,
            "cuda_graph": False, "in_place": False}
    lines = bench.header(info).splitlines()
    assert lines[1] == "# on Intel(R) Xeon(R) Processor (32 cores)"
    assert all(len(line) <= 100 for line in lines), lines   # a notebook would wrap longer lines mid-word

def test_cli_under_torchrun_environment(tmp_path):
    csv_path = tmp_path / "rows.csv"
    (rc0, out0, err0), (rc1, out1, err1) = run_like_torchrun(
        ["-c", "all_reduce", "-b", "8", "-e", "4K", "-f", "4", "-n", "2", "-w", "1", "--csv", str(csv_path)])
    assert rc0 == 0 and rc1 == 0, err0 + err1
    check_table(out0, [8, 32, 128, 512, 2048])
    assert out1 == ""  # only rank 0 prints
    assert [r["bytes"] for r in reference.read_rows(csv_path)] == [8, 32, 128, 512, 2048]


@needs_2_gpus
def test_cli_with_nccl_and_cuda_graph_under_torchrun_environment():
    (rc0, out0, err0), (rc1, _, err1) = run_like_torchrun(
        ["-b", "8", "-e", "1M", "-f", "32", "-G", "--device", "cuda", "--backend", "nccl"], timeout=120)
    assert rc0 == 0 and rc1 == 0, err0 + err1
    check_table(out0, [8, 256, 8192, 262144])
    assert "CUDA graph on" in out0 and "NCCL" in out0


@pytest.mark.skipif(not torchrun.private_network_available(),
                    reason="real torchrun's store listens on every interface: run only in a private network namespace")
def test_cli_under_real_torchrun():
    done = torchrun.run_nodes(["-m", "ddp_helpers.bench", "-b", "8", "-e", "1K", "-f", "8", "-n", "2", "-w", "1"],
                              nnodes=1, nproc_per_node=2, standalone=True, timeout=120)
    assert done.ok, done.logs[0]
    table = [line for line in done.logs[0].splitlines() if re.match(r"\s*(#|\d)", line)]  # not torchrun's banner
    check_table("\n".join(table), [8, 64, 512])


def test_cli_without_torchrun_starts_its_own_ranks(capsys):
    rows = bench.main(["-c", "sendrecv", "-b", "16", "-e", "64", "-n", "2", "-w", "1"])
    assert [r["bytes"] for r in rows] == [16, 32, 64] and all(r["wrong"] == 0 for r in rows)
    check_table(capsys.readouterr().out, [16, 32, 64])


def test_cli_bad_input_is_one_clear_line():
    done = subprocess.run([sys.executable, "-m", "ddp_helpers.bench", "-b", "2", "-e", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: message size 2 B is smaller than one element (4 B)"
    with pytest.raises(SystemExit):
        bench.parse_args(["-c", "allreduce"])  # argparse names the valid choices


# ------------------------------------------------------------------ plots
def synthetic_rows(alpha_us, beta_GBps, backend="gloo", hardware="test CPU"):
    rows = []
    for S in bench.size_range(8, "64M"):
        t = alpha_us + S / (beta_GBps * 1e3)
        rows.append({"collective": "all_reduce", "backend": backend, "device": "cpu", "hardware": hardware,
                     "world_size": 2, "cuda_graph": False, "bytes": S, "time_us": t,
                     "algbw_GBps": bench.algbw_GBps(S, t), "busbw_GBps": bench.busbw_GBps("all_reduce", S, t, 2)})
    return rows


def test_alpha_beta_fit_recovers_the_model():
    alpha, beta = plots.fit_alpha_beta(synthetic_rows(150.0, 2.2))
    assert alpha == pytest.approx(150.0, rel=1e-6) and beta == pytest.approx(2.2, rel=1e-6)
    assert plots.crossover_bytes(150.0, 2.2) == pytest.approx(330_000)   # 150 µs * 2.2 GB/s
    assert plots.model_time_us(2.2e9, 0.0, 2.2) == pytest.approx(1e6)     # 2.2 GB at 2.2 GB/s: one second
    with pytest.raises(ValueError, match="two different message sizes"):
        plots.fit_alpha_beta(synthetic_rows(1.0, 1.0)[:1])


def test_beta_fitted_on_large_messages_and_its_gap_to_the_best_measured():
    rows = synthetic_rows(150.0, 2.2)
    alpha, beta = plots.fit_beta(rows, min_bytes=MiB)
    assert alpha == pytest.approx(150.0, rel=1e-3) and beta == pytest.approx(2.2, rel=1e-6)
    # the model's algbw stays below beta at every size: a fitted beta lies above the best measured algbw
    assert max(r["algbw_GBps"] for r in rows) < beta
    stored, _ = reference.load("bench_all_reduce")
    nccl = [r for r in stored if r["backend"] == "nccl" and not r["cuda_graph"] and not r.get("note")]
    best = max(r["algbw_GBps"] for r in nccl)
    _, beta = plots.fit_beta(nccl)
    assert best < beta < 1.02 * best   # notebook 04: 329.3 GB/s fitted on >= 16 MiB, 326.7 measured
    with pytest.raises(ValueError, match="needs two such sizes"):
        plots.fit_beta(rows, min_bytes=64 * MiB)


def test_panels_have_one_message_each():
    fig = plots.plot_panels([("first message", synthetic_rows(150.0, 2.2), "time", True),
                             ("second message", synthetic_rows(19.0, 300.0), "busbw", False)])
    assert [ax.get_title() for ax in fig.axes] == ["first message", "second message"]
    assert fig.axes[1].get_ylabel().startswith("bus bandwidth")
    matplotlib.pyplot.close(fig)


def test_fit_model_is_what_the_legend_shows():
    rows = synthetic_rows(150.0, 2.2)
    rows[-1] = dict(rows[-1], time_us=rows[-1]["time_us"] * 1.3)   # a slow large message: the two fits differ
    alpha, beta = plots.fit_model(rows, min_bytes=MiB)
    assert alpha == plots.fit_alpha_beta(rows)[0] and beta == plots.fit_beta(rows, MiB)[1]
    assert plots.fit_alpha_beta(rows)[1] != pytest.approx(beta, rel=0.05)
    ax = plots.plot_time(rows, fit=(alpha, beta))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[1] == f"fit: {plots.fit_label(alpha, beta)}"
    assert plots.fit_label(157.26, 1.9244) == "\u03b1 = 157 \u00b5s, \u03b2 = 1.92 GB/s"
    assert plots.fit_label(1234.5, 329.3) == "\u03b1 = 1,234 \u00b5s, \u03b2 = 329 GB/s"
    matplotlib.pyplot.close(ax.figure)


def test_one_figure_per_message_keeps_its_labels_inside_and_names_stored_hardware():
    # alpha = 5000 µs, beta = 2 GB/s: the border S = alpha*beta = 10 MB is near the right end of 8 B..64 MiB
    fig = plots.plot_figure("one message", synthetic_rows(5000.0, 2.0), "time", fit=True, caption="stored: here")
    (ax,) = fig.axes
    assert ax.get_title() == "one message" and fig.get_size_inches()[0] == pytest.approx(7.5)
    box = ax.get_window_extent()
    labels = [t for t in ax.texts if t.get_gid() == "regime"]
    assert len(labels) == 2
    for label in labels:
        inside = label.get_window_extent()
        assert box.x0 <= inside.x0 and inside.x1 <= box.x1, label.get_text()
    assert "stored: here" in [t.get_text() for t in fig.texts]
    matplotlib.pyplot.close(fig)
    _, meta = reference.load("bench_all_reduce")
    assert plots.stored_bench_caption(meta) == \
        "stored: 2× NVIDIA H200 (NV18), torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-30"


def sweep_noting_sizes(sizes):
    """The real sweep, noting the element count of each set of buffers it prepares, in order."""
    real, counts = bench.prepare, []

    def noting(collective, count, dtype, device):
        counts.append(count)
        return real(collective, count, dtype, device)
    bench.timing.prepare = noting
    bench.sweep("all_reduce", sizes, iters=1, warmup=1)
    return counts


def test_sweep_warms_up_at_the_largest_then_the_smallest_size_first():
    # as nccl-tests' TimeTest: so the first size timed does not pay the process's one-time costs
    counts = launch(sweep_noting_sizes, 2, "gloo", args=([8, 1024, 4096],), quiet=True)[0]
    assert counts[:2] == [1024, 2]
    assert counts[2:] == [2, 2, 256, 256, 1024, 1024]   # then each size: timed, then checked (#wrong)


def sweep_with_own_timer(sizes):
    def constant(call, iters, warmup, device):  # a timer of one's own: here every call "takes" 1 ms
        call()
        return 1e-3
    return bench.sweep("all_reduce", sizes, iters=2, warmup=1, timer=constant)


def test_sweep_uses_the_timer_it_is_given():
    rows = launch(sweep_with_own_timer, 2, "gloo", args=([4096],), quiet=True)[0]
    assert rows[0]["time_us"] == pytest.approx(1000.0) and rows[0]["wrong"] == 0
    with pytest.raises(ValueError, match="timer must be a function"):
        bench.measure("all_reduce", [8], timer="fast")


def test_plots_draw_one_line_per_series_on_log_axes():
    rows = synthetic_rows(150.0, 2.2) + synthetic_rows(19.0, 300.0, backend="nccl", hardware="NVIDIA H200")
    fig = plots.plot_sweeps(rows)
    time_ax, bw_ax = fig.axes
    assert time_ax.get_xscale() == "log" and time_ax.get_yscale() == "log" and bw_ax.get_yscale() == "log"
    labels = [line.get_label() for line in time_ax.get_lines() if not line.get_label().startswith("_")]
    assert labels[0] == "Gloo cpu: 2 ranks on test CPU" and labels[2] == "NCCL cpu: 2 ranks on NVIDIA H200"
    assert labels[1].startswith("fit: \u03b1 = 150 \u00b5s, \u03b2 = 2.2 GB/s")
    title = " ".join(t.get_text() for t in fig.texts)  # the suptitle
    assert "all_reduce, measured on NVIDIA H200; test CPU" in title
    texts = [t.get_text() for t in time_ax.texts]
    assert texts.count("latency-bound \u2190 ") == 2 and texts.count(" \u2192 bandwidth-bound") == 2
    matplotlib.pyplot.close(fig)
    assert plots.human_bytes(8) == "8 B" and plots.human_bytes(3 * MiB) == "3 MiB"
    as_text = dict(rows[0], cuda_graph="False")  # as a reader that keeps strings gives it
    assert plots.series_label(as_text) == plots.series_label(rows[0])
    assert plots.series_label(dict(rows[0], cuda_graph="True", note="NCCL_P2P_DISABLE=1")) == \
        "Gloo cpu + CUDA graph (NCCL_P2P_DISABLE=1): 2 ranks on test CPU"


# ------------------------------------------------- the GPU reference script
def load_gpu_reference():
    spec = importlib.util.spec_from_file_location("gpu_reference", os.path.join(REPO, "benchmarks", "gpu_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NCCL_TESTS_OUTPUT = """\
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    19.00    0.00    0.00       0    20.00    0.00    0.00       0
  1073741824     268435456     float     sum      -1   3500.0  306.78  306.78       0   3400.0  315.81  315.81       0
# Avg bus bandwidth    : 150.1
"""


def test_gpu_reference_parses_nccl_tests_and_compares():
    ref = load_gpu_reference()
    theirs = ref.parse_nccl_tests(NCCL_TESTS_OUTPUT)
    assert [(t["bytes"], t["time_us_out_of_place"], t["time_us_in_place"]) for t in theirs] == \
        [(8, 19.0, 20.0), (2**30, 3500.0, 3400.0)]
    ours = [{"collective": "all_reduce", "backend": "nccl", "note": "", "cuda_graph": graph, "bytes": 8, "time_us": t}
            for graph, t in ((False, 38.0), (True, 20.0))]
    ours += [{"collective": "all_reduce", "backend": "nccl", "note": "", "cuda_graph": False, "bytes": 2**30,
              "time_us": 3578.9}]
    graph_rows = [dict(theirs[0], time_us_out_of_place=10.0, time_us_in_place=9.5)]
    table = ref.comparison(ours, {"plain": theirs, "graph": graph_rows})
    # best of ours over the best of theirs: 9.5 / 20 at 8 B (their graph), 3400 / 3578.9 at 1 GiB
    assert [(r["bytes"], round(r["ratio"], 3)) for r in table] == [(8, 0.475), (2**30, 0.95)]
    assert (table[0]["our_plain_time_us"], table[0]["their_graph_time_us"], table[1]["our_graph_time_us"]) == \
        (38.0, 9.5, None)
    topo = ("\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
            "GPU0\t X \tNV18\t0-31\t0\t\tN/A\nGPU1\tNV18\t X \t0-31\t0\t\tN/A\n")  # as seen on 2 H200s
    assert ref.interconnect(topo) == "NV18"


@pytest.mark.parametrize("gpus, expected", [(0, ("cpu", "gloo")), (1, ("cpu", "gloo")), (2, ("cuda", "nccl"))])
def test_cli_never_puts_two_nccl_ranks_on_one_gpu(monkeypatch, capsys, gpus, expected):
    # Seen on a 1-GPU machine: the CLI picked NCCL for 2 ranks because there was a GPU, and hung.
    monkeypatch.setattr(machine, "gpu_count", lambda: gpus)
    # the GPUs launch would lease: faked too, so a machine's own nvidia-smi does not answer instead
    monkeypatch.setenv("DDP_HELPERS_FAKE_GPUS", ",".join(f"GPU-fake{i}" for i in range(gpus)))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    args = bench.parse_args(["--nproc", "2"])
    assert (args.device, args.backend) == expected
    assert f"2 rank(s), {gpus} GPU(s)" in args.chosen   # main() says it, in one line
    if gpus < 2:
        with pytest.raises(SystemExit):
            bench.parse_args(["--nproc", "2", "--backend", "nccl"])
        assert "needs one GPU per rank: 2 ranks here" in capsys.readouterr().err


# ------------------------------------------------- sizes beyond memory, no ranks
def test_sizes_beyond_memory_are_refused_before_any_rank_starts(monkeypatch, capsys):
    # -b 1T -e 1T gave a raw allocator error from a rank; a size near the memory summoned the OOM killer
    import ddp_helpers.launcher

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(ddp_helpers.launcher, "launch", no_launch)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"^1 TiB messages need about .* of memory on 2 ranks; this machine has "
                                         r".* GiB available: choose a smaller largest size$"):
        bench.measure("all_reduce", [8, 2**40], device="cpu")
    with pytest.raises(ValueError, match="messages need about"):
        bench.main(["-b", "1T", "-e", "1T"])
    assert capsys.readouterr().out == ""
    done = subprocess.run([sys.executable, "-m", "ddp_helpers.bench", "-b", "8", "-e", "64G", "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("error: 64 GiB messages need about"), done.stderr


def test_no_ranks_is_refused_before_anything_is_said(capsys):
    # --nproc 0 first printed "chose device cuda and backend nccl (0 rank(s))"
    for argv in (["--nproc", "0"], ["--nproc", "-1"]):
        with pytest.raises(SystemExit) as done:
            bench.main(argv)
        assert done.value.code == 2
        printed = capsys.readouterr()
        assert printed.out == "" and "chose" not in printed.err
        assert f"--nproc must be at least 1, got {argv[1]}" in printed.err


def test_gpu_sizes_are_checked_against_each_gpus_free_memory():
    GiB = 2**30   # rank r uses GPU r % count; each holds (2 + 24 / 4) x 16 GiB = 128 GiB of float32 work
    with pytest.raises(ValueError, match=r"^16 GiB messages need about 256 GiB of memory on 2 ranks; "
                                         r"GPU 0 has 10 GiB available"):
        bench.check_memory(16 * GiB, "float", 2, "cuda", gpu_free=[10 * GiB])
    with pytest.raises(ValueError, match="need about 128 GiB .* on 3 ranks; GPU 1 has 100 GiB available"):
        bench.check_memory(16 * GiB, "float", 3, "cuda", gpu_free=[300 * GiB, 100 * GiB])
    bench.check_memory(16 * GiB, "float", 3, "cuda", gpu_free=[300 * GiB, 200 * GiB])   # fits: no error
    if not machine.gpu_count():
        assert bench.gpu_free_bytes() == []
