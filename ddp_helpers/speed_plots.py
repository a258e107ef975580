"""The charts of notebook 07 (the performance lab) and of 05's simulated link: buckets against the
backward pass over a simulated link, step time against the link's bandwidth, time to accuracy of
stored training runs; and the caption that says where and when a stored training benchmark was measured.

    fig = speed_plots.overlap_timeline(runs, "one backward() on 2 CPU ranks")   # then plt.show()
    print(speed_plots.stored_caption(reference.load("perf_lab_1gpu")[1]))

Each chart function draws with pyplot and returns its figure (or the Axes it drew into), as every
plotting function of ddp_helpers does; the notebook shows it. The benchmark tables of notebook 04
(nccl-tests' sizes, the alpha-beta model) are `bench_plots`.
"""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure


def stored_caption(report: dict) -> str:
    """'stored: 2x NVIDIA H200, torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-30': where and when a stored
    benchmark report (its "machine" and "date") was measured, for titles and printed lines."""
    m = report["machine"]
    gpus = m.get("gpus") or []
    hardware = f"{len(gpus)}x {gpus[0]}" if gpus else f"{m.get('cpu_cores', '?')} CPU cores, no GPU"
    nccl = f", NCCL {m['nccl']}" if m.get("nccl") else ""
    return f"stored: {hardware}, torch {m['torch']}{nccl}, {report['date'][:10]}"


def accuracy_vs_seconds(ax: Axes, points: Sequence[tuple[str, float, float, float, float]]) -> Axes:
    """Time to accuracy: one point per (label, seconds, seconds_std, accuracy, accuracy_std), with
    error bars of one standard deviation; up and to the left is better."""
    for label, seconds, seconds_std, accuracy, accuracy_std in points:
        ax.errorbar(seconds, 100 * accuracy, xerr=seconds_std, yerr=100 * accuracy_std, fmt="o", capsize=3,
                    label=f"{label}: {accuracy:.2%} in {seconds:.2f} s")
    ax.set(xlabel="seconds (training + final evaluation)", ylabel="test accuracy (%)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return ax


# The words of the overlap picture: (the blue bar, the orange bars, the black line, the x axis).
ON_A_LINK = ("backward computing", "a bucket on the link", "backward() returns",
             "ms since backward() started (ticks: a bucket's gradients are all ready)")
PROFILED = ("backward, until the last gradient", "all-reduce of a bucket (Gloo thread)", None,
            "ms since backward started (ticks: a gradient written)")


def overlap_timeline(runs: dict[str, dict], title: str | None = None, words: tuple = ON_A_LINK,
                     size: tuple[float, float] | None = None) -> Figure:
    """The buckets' all-reduces against the backward pass, the one picture of it (05's profiled
    runs too: `plots.overlap_timeline`). One row per run, the first on top (label -> {"ready_ms",
    "link_ms"}, and "step_ms" for a black line at the end of that step, or "last_ms" when step_ms is
    a median of several steps but ready_ms and link_ms are the last step's): a blue bar for
    backward's computation (until the last tick), a tick when each bucket (or gradient) is ready, an
    orange bar for each bucket on the link. `words`: the legend's and the axis's (ON_A_LINK, PROFILED).
    Returns the figure."""
    computing, on_link, returns, xlabel = words
    fig, ax = plt.subplots(figsize=size or (8, 1.5 + 0.7 * len(runs)))
    for row, run in enumerate(runs.values()):
        y = len(runs) - 1 - row
        ax.barh(y + 0.15, max(run["ready_ms"]), height=0.25, color="tab:blue",
                label=computing if row == 0 else None)
        ax.vlines(run["ready_ms"], y + 0.02, y + 0.28, colors="k", linewidth=1)
        for i, (start, end) in enumerate(run["link_ms"]):
            ax.barh(y - 0.15, max(end - start, 0.05), left=start, height=0.25, color="tab:orange",
                    edgecolor="white", label=on_link if row == 0 and i == 0 else None)
        if "step_ms" in run or "last_ms" in run:
            ax.vlines(run.get("last_ms", run.get("step_ms")), y - 0.35, y + 0.35, colors="k", linewidth=2.5,
                      label=returns if row == 0 else None)
    ax.set_yticks(range(len(runs)), list(runs)[::-1])
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title, fontsize=10)
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def overlap_sweep(sweep: dict[str, dict[float, float]], title: str,
                  model: dict[str, dict[float, float]] | None = None) -> Figure:
    """Step time against the link's bandwidth: one line per bucket setting (label -> {GB/s: ms}),
    and, dashed, what a model predicts (label -> {GB/s: ms}). Returns the figure."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for (label, by_bandwidth), color in zip(sweep.items(), ("tab:blue", "tab:orange", "tab:green")):
        xs = sorted(by_bandwidth)
        ax.plot(xs, [by_bandwidth[x] for x in xs], "o-", label=label, color=color)
    for (label, by_bandwidth), color in zip((model or {}).items(), ("tab:blue", "tab:orange", "tab:green")):
        xs = sorted(by_bandwidth)
        ax.plot(xs, [by_bandwidth[x] for x in xs], "--", label=label, color=color, alpha=0.6)
    ax.set(xscale="log", xlabel="simulated link bandwidth (GB/s)", ylabel="backward() (ms, median)")
    ax.set_xticks(xs, [f"{x:.3g}" for x in xs])
    ax.minorticks_off()
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
