"""Plots of `ddp_helpers.bench` rows, and the latency-bandwidth (alpha-beta) model.

    from ddp_helpers import bench, bench_plots
    rows = bench.measure("all_reduce", bench.size_range(8, "16M"))
    bench_plots.plot_sweeps(rows)          # time and busbw against message size
    bench_plots.fit_alpha_beta(rows)       # (alpha in µs, beta in GB/s)

The model: one call of S bytes takes t = alpha + S / beta. alpha is the fixed
cost of a call (launch, synchronisation, network latency); beta the bandwidth
reached on large messages. Below S = alpha * beta the fixed cost dominates
(latency-bound: bigger messages are almost free); above it, the bytes do
(bandwidth-bound: time grows with size).
"""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullLocator


def human_bytes(n: float) -> str:
    """1024 -> '1 KiB', 3 * 2**20 -> '3 MiB', 8 -> '8 B'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024


def series_label(row: dict, with_collective: bool = False) -> str:
    """'NCCL cuda + CUDA graph: 2 ranks on NVIDIA H200': what ran, and on which hardware."""
    name = {"nccl": "NCCL", "gloo": "Gloo"}.get(row["backend"], row["backend"])
    graph = row.get("cuda_graph") in (True, "True")  # "True" when read by a CSV reader that keeps strings
    extras = (" + CUDA graph" if graph else "") + (f" ({row['note']})" if row.get("note") else "")
    start = f"{row['collective']}, " if with_collective else ""
    return f"{start}{name} {row['device']}{extras}: {row['world_size']} ranks on {row['hardware']}"


def series(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Rows grouped by series_label, each group sorted by message size."""
    mixed = len({r["collective"] for r in rows}) > 1
    groups = {}
    for r in rows:
        groups.setdefault(series_label(r, mixed), []).append(r)
    return {label: sorted(g, key=lambda r: r["bytes"]) for label, g in groups.items()}


# ------------------------------------------------------------- the model
def fit_alpha_beta(rows: Sequence[dict]) -> tuple[float, float]:
    """Least-squares fit of t = alpha + S / beta to the rows; returns (alpha_us, beta_GBps).

    Minimises the *relative* error, so the microsecond points count as much as the
    millisecond ones (plain least squares would fit only the largest messages).
    beta is an algbw (S per second): times the bus factor, it is the busbw plateau.
    """
    S = np.array([r["bytes"] for r in rows], dtype=float)
    t = np.array([r["time_us"] for r in rows], dtype=float)
    if len(rows) < 2 or len(set(S)) < 2:
        raise ValueError("fitting alpha and beta needs at least two different message sizes")
    (alpha_us, us_per_byte), *_ = np.linalg.lstsq(np.column_stack([1 / t, S / t]), np.ones_like(t), rcond=None)
    beta_GBps = 1e-3 / us_per_byte if us_per_byte > 0 else float("inf")  # 1 byte/µs = 1e-3 GB/s
    return float(alpha_us), float(beta_GBps)


def fit_beta(rows: Sequence[dict], min_bytes: int = 16 * 2**20) -> tuple[float, float]:
    """beta fitted on the large messages only (S >= min_bytes), by ordinary least squares of
    t = alpha + S / beta: (alpha_us, beta_GBps). beta is a fitted parameter, the model's algbw
    for an infinitely large message: the model's algbw at size S is beta / (1 + alpha * beta / S),
    below beta, so a fitted beta lies a little above the best measured algbw when the model fits."""
    big = [r for r in rows if r["bytes"] >= min_bytes]
    if len({r["bytes"] for r in big}) < 2:
        raise ValueError(f"fitting beta on messages of at least {human_bytes(min_bytes)} needs two such sizes")
    S = np.array([r["bytes"] for r in big], dtype=float)
    t = np.array([r["time_us"] for r in big], dtype=float)
    (alpha_us, us_per_byte), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(S), S]), t, rcond=None)
    return float(alpha_us), float(1e-3 / us_per_byte) if us_per_byte > 0 else float("inf")


def fit_model(rows: Sequence[dict], min_bytes: int = 16 * 2**20) -> tuple[float, float]:
    """The (alpha_us, beta_GBps) that notebook 04 prints and draws: alpha from `fit_alpha_beta` on every
    size (the fixed cost of a call, which the small messages show), beta from `fit_beta` on the
    messages of at least min_bytes (the bandwidth, which only large messages show). Pass the pair to
    `plot_time(..., fit=(alpha, beta))` so that the legend says what was printed."""
    return fit_alpha_beta(rows)[0], fit_beta(rows, min_bytes)[1]


def model_time_us(nbytes: float | np.ndarray, alpha_us: float, beta_GBps: float) -> np.ndarray:
    """t = alpha + S / beta, in µs."""
    return alpha_us + np.asarray(nbytes, dtype=float) / (beta_GBps * 1e3)


def crossover_bytes(alpha_us: float, beta_GBps: float) -> float:
    """S = alpha * beta, where the fixed cost and the transfer take equally long
    (the call reaches half of beta): the border between the two regimes."""
    return alpha_us * beta_GBps * 1e3


# ------------------------------------------------------------------ plots
# Sizes in points for a figure about 7.5 inches wide, which JupyterLab shows at full size: a wider
# figure is scaled down to the notebook's width, and its text with it.
LEGEND_FONT, LABEL_FONT, TITLE_FONT = 8.5, 9, 12


def fit_label(alpha_us: float, beta_GBps: float) -> str:
    """'α = 157 µs, β = 1.92 GB/s': how the legend writes a fit (print it the same way)."""
    def number(x):
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"
    return f"\u03b1 = {number(alpha_us)} \u00b5s, \u03b2 = {number(beta_GBps)} GB/s"


def _size_ticks(ax):
    """Ticks at powers of 1024 (and 32x between) inside the axis' limits, labelled in B/KiB/MiB/GiB."""
    low, high = ax.get_xlim()
    ax.xaxis.set_major_locator(FixedLocator([2.0 ** k for k in range(0, 41, 5) if low <= 2.0 ** k <= high]))


def _size_axis(ax, sizes):
    """Log x axis with ticks at powers of 1024 (and 32x between), labelled in B/KiB/MiB/GiB."""
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(sizes) / 2, max(sizes) * 2)
    _size_ticks(ax)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_bytes(x)))
    ax.set_xlabel("message size S (bytes, as nccl-tests counts them)")
    ax.grid(True, which="major", alpha=0.3)


def mark_regimes(ax: Axes, alpha_us: float, beta_GBps: float, color: str | tuple, level: int = 0) -> None:
    """A dotted line at S = alpha*beta, with 'latency-bound' to its left and 'bandwidth-bound' to its right
    (`keep_labels_inside` widens the axis where a label would be cut off at its edge)."""
    x = crossover_bytes(alpha_us, beta_GBps)
    if not np.isfinite(x) or x <= 0:
        return
    ax.axvline(x, color=color, linestyle=":", linewidth=1)
    y, transform = 0.97 - 0.07 * level, ax.get_xaxis_transform()
    for text, align in (("latency-bound \u2190 ", "right"), (" \u2192 bandwidth-bound", "left")):
        ax.text(x, y, text, ha=align, va="top", color=color, fontsize=LABEL_FONT, transform=transform, gid="regime")


def keep_labels_inside(fig: Figure, tries: int = 5) -> None:
    """Widen each size axis until its regime labels fit inside it: a border near an edge would cut them."""
    for ax in fig.axes:
        labels = [t for t in ax.texts if t.get_gid() == "regime"]
        for _ in range(tries if labels else 0):
            box = ax.get_window_extent()
            boxes = [t.get_window_extent() for t in labels]
            left, right = max(box.x0 - b.x0 for b in boxes), max(b.x1 - box.x1 for b in boxes)
            if left <= 0 and right <= 0:
                break
            low, high = np.log2(ax.get_xlim())
            per_pixel = (high - low) / box.width
            margin = 6   # pixels
            low -= (left + margin) * per_pixel if left > 0 else 0
            high += (right + margin) * per_pixel if right > 0 else 0
            ax.set_xlim(2 ** low, 2 ** high)
        _size_ticks(ax)


class _PlainLog(LogFormatter):
    """Log-axis labels as plain numbers (200, 0.001, not 2 x 10^2, 10^-3); like matplotlib's own, it
    labels some minor ticks only where the axis spans few decades."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:g}"


def _legend_below(ax):
    """Legend under the axes, so it never hides a curve or the regime labels."""
    ax.legend(fontsize=LEGEND_FONT, loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False)


def plot_time(rows: Sequence[dict], ax: Axes | None = None, fit: bool | tuple[float, float] = True) -> Axes:
    """Time per call against message size (log-log), one line per series. fit=True: each series'
    `fit_alpha_beta`, dashed, with its regime border; fit=(alpha_us, beta_GBps): that model instead
    (e.g. from `fit_model`, so that the legend shows the numbers printed beside it); fit=False: none."""
    def fitted(S, alpha, beta, group):
        return model_time_us(S, alpha, beta), f"fit: {fit_label(alpha, beta)}"
    return _plot_against_size(rows, ax, fit, "time_us", "time per call (\u00b5s)", fitted)


def plot_busbw(rows: Sequence[dict], ax: Axes | None = None, fit: bool | tuple[float, float] = True) -> Axes:
    """Bus bandwidth against message size (log-log), one line per series; with the
    bandwidth the alpha-beta model predicts (dashed; `fit` as in plot_time) and the regime border."""
    def fitted(S, alpha, beta, group):
        factor = group[-1]["busbw_GBps"] / group[-1]["algbw_GBps"]   # the collective's bus factor
        return S / (model_time_us(S, alpha, beta) * 1e3) * factor, None
    return _plot_against_size(rows, ax, fit, "busbw_GBps", "bus bandwidth (GB/s, 1e9 B/s)", fitted)


def _plot_against_size(rows, ax, fit, key, ylabel, fitted):
    """One measured line per series, and with `fit` the curve fitted(S, alpha, beta, group)
    returns (values, legend label) for it, dashed, with the series' regime border."""
    ax = ax or plt.subplots(figsize=(7.5, 5))[1]
    for level, (label, group) in enumerate(series(rows).items()):
        S = np.array([r["bytes"] for r in group], dtype=float)
        line, = ax.plot(S, [r[key] for r in group], "o-", markersize=3, label=label)
        if fit is not False and fit is not None and len(group) >= 2:
            alpha, beta = fit_alpha_beta(group) if fit is True else fit
            values, fit_label_text = fitted(S, alpha, beta, group)
            ax.plot(S, values, "--", color=line.get_color(), linewidth=1, label=fit_label_text)
            mark_regimes(ax, alpha, beta, line.get_color(), level)
    ax.set_yscale("log")
    if any(t.get_gid() == "regime" for t in ax.texts):   # headroom: the labels sit above the curves
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * (high / low) ** (0.1 * len(series(rows))))
    ax.yaxis.set_major_formatter(_PlainLog())
    ax.yaxis.set_minor_formatter(_PlainLog(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_ylabel(ylabel)
    _size_axis(ax, [r["bytes"] for r in rows])
    _legend_below(ax)
    return ax


def plot_figure(message: str, rows: Sequence[dict], what: str = "time", fit: bool | tuple[float, float] = False,
                caption: str | None = None, width: float = 7.5, height: float = 5.0) -> Figure:
    """One figure with one message, its title: time ("time") or bus bandwidth ("busbw") against message
    size, drawn by plot_time or plot_busbw with `fit`. caption: one small line at the bottom, e.g. where
    and when stored results were measured. 7.5 inches wide: JupyterLab shows it at full size."""
    fig, ax = plt.subplots(figsize=(width, height))
    (plot_time if what == "time" else plot_busbw)(rows, ax, fit)
    ax.set_title(message, fontsize=TITLE_FONT)
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=LEGEND_FONT, color="0.3", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
    keep_labels_inside(fig)
    return fig


def stored_bench_caption(meta: dict) -> str:
    """'stored: 2× NVIDIA H200 (NV18), torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-30': where and when
    a stored benchmark table (`reference.load("bench_...")`'s metadata) was measured."""
    link = (meta.get("interconnect") or "").split(" ")[0]
    nccl = f", NCCL {meta['nccl']}" if meta.get("nccl") else ""
    return (f"stored: {meta['hardware']}" + (f" ({link})" if link else "")
            + f", torch {meta['torch']}{nccl}, {meta['date'][:10]}")


def plot_sweeps(rows: Sequence[dict], title: str | None = None, fit: bool | tuple[float, float] = True) -> Figure:
    """Time and busbw side by side; the title names the collective(s) and the hardware."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6.5))
    plot_time(rows, left, fit)
    plot_busbw(rows, right, fit)
    collectives = ", ".join(sorted({r["collective"] for r in rows}))
    hardware = "; ".join(sorted({r["hardware"] for r in rows}))
    fig.suptitle(title or f"{collectives}, measured on {hardware}")
    fig.tight_layout()
    keep_labels_inside(fig)
    return fig


def plot_panels(panels: Sequence[tuple[str, Sequence[dict], str, bool | tuple[float, float]]], title: str | None = None,
                width: float = 5.2, height: float = 4.6) -> Figure:
    """Panels side by side: panels is a list of (message, rows, what, fit) with what "time" or "busbw";
    the message is the panel's title. In a notebook prefer one `plot_figure` per message: side by side,
    the panels are scaled down to the notebook's width."""
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), height), squeeze=False)
    for ax, (message, rows, what, fit) in zip(axes[0], panels):
        (plot_time if what == "time" else plot_busbw)(rows, ax, fit)
        ax.set_title(message, fontsize=11)
        ax.set_xlabel("message size S")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    keep_labels_inside(fig)
    return fig
