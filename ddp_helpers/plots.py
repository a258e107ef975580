"""Pictures of what the ranks hold: a coloured grid per rank, before and after
a collective, and a stepper that walks a ring all-reduce chunk by chunk.

All functions take the real tensors that the workers returned, draw with pyplot and return the
figure (or the Axes they drew into), showing nothing themselves: a notebook cell shows a figure
once, at its end (`fig = plots.show_ranks(...)`; a bare call as the cell's last line would show it
twice: as the cell's value too), or where it calls `plt.show()`; a script saves it or calls `plt.show()`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import torch
from matplotlib import colors, patheffects
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from . import speed_plots

Tensors = Any   # a tensor, a list of tensors, or None: what a rank holds at one stage


def _as_rows(value):
    """A tensor (any shape), a list of tensors, or None -> a 1-D float tensor or None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return torch.cat([torch.as_tensor(v).flatten() for v in value]).float()
    return torch.as_tensor(value).flatten().float()


def _draw_row(ax, row, norm, cmap, label_fmt="{:g}", colour_of=None):
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    if row is None or row.numel() == 0:
        ax.text(0.5, 0.5, "—", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    shades = row if colour_of is None else torch.tensor([float(colour_of(v)) for v in row.tolist()])
    ax.imshow(shades.reshape(1, -1).numpy(), cmap=cmap, norm=norm, aspect="equal")
    for i, (v, c) in enumerate(zip(row.tolist(), shades.tolist())):
        shade = cmap(norm(c))
        ink = "black" if 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2] > 0.55 else "white"
        ax.text(i, 0, label_fmt.format(v), ha="center", va="center", fontsize=9, color=ink)


def source_rank(value: float) -> int:
    """The rank a value came from, in notebook 03's data: rank r starts with 10·r + i, so the tens
    digit names the rank (rank 0's scatter list, 100·j + i, has tens digit 0: it all comes from rank 0)."""
    return int(value) // 10 % 10


def show_ranks(per_rank: Sequence[Sequence[Tensors]], title: str, stages: Sequence[str] = ("before", "after"),
               cmap: str = "viridis", colour_by: str = "value") -> Figure:
    """Draw each rank's tensors, one row per rank, one column per stage.

    per_rank[r] is a tuple with one tensor (or list of tensors, or None) per stage,
    e.g. the `(before, after)` a `%%ddp` cell returned on rank r.
    colour_by="value": a colour scale of the values (for sums); "source": one colour per rank
    the value came from (`source_rank`), with a legend, to follow data as it moves.
    """
    rows = [[_as_rows(v) for v in stage_values] for stage_values in per_rank]
    known = [r for ranks in rows for r in ranks if r is not None and r.numel()]
    if colour_by == "source":
        sources = len(per_rank)
        cmap = colors.ListedColormap([plt.get_cmap("tab10")(i) for i in range(sources)])
        norm = colors.BoundaryNorm([i - 0.5 for i in range(sources + 1)], sources)
        colour_of = source_rank
    else:
        low = min(float(r.min()) for r in known)
        high = max(float(r.max()) for r in known)
        norm = colors.Normalize(vmin=low, vmax=high if high > low else low + 1)
        cmap = plt.get_cmap(cmap)
        colour_of = None
    widths = [max([r.numel() for r in column if r is not None] + [1]) for column in zip(*rows)]
    fig, axes = plt.subplots(len(rows), len(stages), squeeze=False, gridspec_kw={"width_ratios": widths},
                             figsize=(1.4 + 0.42 * sum(widths), 0.5 * len(rows) + 0.9 + 0.3 * (colour_by == "source")))
    for rank, ranks in enumerate(rows):
        for col, row in enumerate(ranks):
            ax = axes[rank][col]
            _draw_row(ax, row, norm, cmap, colour_of=colour_of)
            ax.set_xlim(-0.5, widths[col] - 0.5)
            if col == 0:
                ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center")
            if rank == 0:
                ax.set_title(stages[col])
    fig.suptitle(title)
    if colour_by == "source":
        fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=cmap(i)) for i in range(len(per_rank))],
                   labels=[f"from rank {i}" for i in range(len(per_rank))], loc="lower center",
                   ncol=len(per_rank), frameon=False, fontsize=9)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
    else:
        fig.tight_layout()
    return fig


def _contributions(inputs, op, rank, j, out_len, value, scattered):
    """The ranks whose input went into element j of rank `rank`'s result, checked against the value."""
    pos = rank * out_len + j if scattered else j
    column = [float(row[pos]) for row in inputs]
    if op in ("sum", "avg"):
        expected = sum(column) / (len(column) if op == "avg" else 1)
        if abs(expected - value) > 1e-6 * max(1.0, abs(value)):
            raise ValueError(f"rank {rank}, element {j}: {value:g} is not the {op} of the ranks' "
                             f"inputs at position {pos} ({', '.join(f'{c:g}' for c in column)})")
        return list(range(len(column)))
    if op in ("max", "min"):
        if value not in column or value != (max if op == "max" else min)(column):
            raise ValueError(f"rank {rank}, element {j}: {value:g} is not the {op} of the ranks' "
                             f"inputs at position {pos} ({', '.join(f'{c:g}' for c in column)})")
        return [column.index(value)]
    raise ValueError(f"op must be None, 'sum', 'avg', 'max' or 'min', not {op!r}")


def show_contributions(per_rank: Sequence[Sequence[Tensors]], title: str, stages: Sequence[str] = ("before", "after"),
                       ops: Sequence[str | None] = (None, "sum"), scattered: bool = False) -> Figure:
    """Draw who contributed to each element of a reduction: one row per rank, one column per stage.

    per_rank[r] is a tuple with one tensor (or None) per stage, the first being rank r's input.
    ops[k] says how stage k was made from the inputs: None (an input: the colour of its rank),
    "sum" or "avg" (stacked bands, one per rank whose element went into it: every rank), "max" or
    "min" (the colour of the rank whose element won). Each value is checked against the inputs
    before it is drawn (a ValueError names the element that does not add up).
    scattered=True: rank r's result element j comes from input position r * len(result) + j, as
    in reduce_scatter; otherwise from position j.
    """
    if len(ops) != len(stages):
        raise ValueError(f"one op per stage: {len(stages)} stages, {len(ops)} ops")
    world = len(per_rank)
    rows = [[_as_rows(v) for v in stage_values] for stage_values in per_rank]
    inputs = [ranks[0] for ranks in rows]
    palette = [plt.get_cmap("tab10")(i % 10) for i in range(world)]
    widths = [max([r.numel() for r in column if r is not None] + [1]) for column in zip(*rows)]
    fig, axes = plt.subplots(world, len(stages), squeeze=False, gridspec_kw={"width_ratios": widths},
                             figsize=(1.4 + 0.42 * sum(widths), 0.5 * world + 1.2))
    for rank, ranks in enumerate(rows):
        for col, row in enumerate(ranks):
            ax = axes[rank][col]
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_visible(False)
            ax.set_xlim(-0.5, widths[col] - 0.5)
            ax.set_ylim(-0.5, 0.5)
            ax.set_aspect("equal")
            if col == 0:
                ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center")
            if rank == 0:
                ax.set_title(stages[col])
            if row is None or row.numel() == 0:
                ax.text(0.5, 0.5, "—", ha="center", va="center", transform=ax.transAxes, color="grey")
                continue
            for j, value in enumerate(row.tolist()):
                who = [rank] if ops[col] is None else \
                    _contributions(inputs, ops[col], rank, j, row.numel(), value, scattered)
                band = 1.0 / len(who)
                for k, src in enumerate(who):
                    ax.add_patch(plt.Rectangle((j - 0.5, 0.5 - (k + 1) * band), 1, band,
                                               facecolor=palette[src], edgecolor="white", linewidth=0.5))
                ax.text(j, 0, f"{value:g}", ha="center", va="center", fontsize=9,
                        path_effects=[patheffects.withStroke(linewidth=2.5, foreground="white")])
    fig.suptitle(title)
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=palette[i]) for i in range(world)],
               labels=[f"from rank {i}" for i in range(world)], loc="lower center",
               ncol=world, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _contributors(value, world_size):
    """Ring pictures use 10**r as rank r's data, so the digits of a sum say who is in it."""
    digits = f"{int(round(value)):0{world_size}d}"[::-1]
    return sum(d != "0" for d in digits[:world_size])


def draw_ring_step(snapshots: Sequence[Sequence[Sequence[torch.Tensor]]], step: int, ax: Axes | None = None) -> Axes:
    """One step of `collectives.ring_all_reduce_steps`, all ranks: rows are ranks,
    columns are chunks, colour = how many ranks' data a chunk already holds."""
    world_size = len(snapshots)
    steps = len(snapshots[0]) - 1
    ax = ax or plt.gca()
    cmap = plt.get_cmap("Blues", world_size + 1)
    grid = [[_contributors(float(chunk.flatten()[0]), world_size) for chunk in snapshots[r][step]]
            for r in range(world_size)]
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=world_size, aspect="auto")
    for r in range(world_size):
        for c, chunk in enumerate(snapshots[r][step]):
            label = f"{int(chunk.flatten()[0]):0{world_size}d}"
            ax.text(c, r, label, ha="center", va="center", fontsize=10,
                    color="white" if grid[r][c] > world_size / 2 else "black")
    ax.set_xticks(range(world_size), [f"chunk {c}" for c in range(world_size)])
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    phase = ("start" if step == 0 else
             f"reduce-scatter step {step}/{world_size - 1}" if step < world_size else
             f"all-gather step {step - world_size + 1}/{world_size - 1}")
    ax.set_title(f"step {step}/{steps}: {phase}")
    return ax


def ring_stepper(snapshots: Sequence[Sequence[Sequence[torch.Tensor]]]) -> Any:
    """An ipywidgets slider that walks through the ring all-reduce step by step (a widget, not a figure:
    each frame is drawn and shown by the slider's callback, the one plt.show() of this module)."""
    import ipywidgets as widgets

    steps = len(snapshots[0]) - 1

    def show(step):
        fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(snapshots), 0.6 + 0.6 * len(snapshots)))
        draw_ring_step(snapshots, step, ax)
        plt.show()

    slider = widgets.IntSlider(value=0, min=0, max=steps, description="step", continuous_update=True)
    return widgets.interactive(show, step=slider)


def ring_all_steps(snapshots: Sequence[Sequence[Sequence[torch.Tensor]]]) -> Figure:
    """Every step of the ring (the stepper's frames, for a printed page), in two rows that fit a
    notebook's width: the start and the reduce-scatter steps above, the all-gather steps below."""
    n = len(snapshots)
    fig, axes = plt.subplots(2, n, figsize=(2.25 * n, 2 * (0.75 + 0.42 * n)), squeeze=False)
    frames = [list(range(0, n)), [None] + list(range(n, 2 * n - 1))]
    for row, steps in enumerate(frames):
        for col, step in enumerate(steps):
            ax = axes[row][col]
            if step is None:
                ax.axis("off")
                ax.text(0.5, 0.5, "after reduce-scatter,\neach rank owns the\nfull sum of one chunk\n"
                        "(dark); now share them",
                        ha="center", va="center", fontsize=9, transform=ax.transAxes)
                continue
            draw_ring_step(snapshots, step, ax)
            ax.set_title(ax.get_title().split(": ")[1], fontsize=10)
            ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=8)
            if col > (row == 1):
                ax.set_yticks([])
            for text in ax.texts:
                text.set_fontsize(8)
    fig.tight_layout()
    return fig


def latency_plot(rows: Sequence[tuple[int, float]], label: str, ax: Axes | None = None) -> Axes:
    """Round-trip time against message size, log-log; rows are (bytes, microseconds). The legend
    goes below the axes, where it covers no point of any curve."""
    ax = ax or plt.gca()
    sizes, times = zip(*rows)
    ax.loglog(sizes, times, marker="o", label=label)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("round trip (µs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=9, frameon=False)
    return ax


def overlap_timeline(timelines: Sequence[dict]) -> Figure:
    """DDP's all-reduces against the backward pass, one row per run, the first on top: the dicts
    `data_parallel.backward_timeline` returns, each with a "label" (e.g. the bucket size). Drawn as
    every overlap picture is (`speed_plots.overlap_timeline`): blue from the start of backward to the
    last gradient written; black ticks: each gradient written; orange: each all-reduce, while Gloo's
    thread runs it."""
    rows = {f"{tl.get('label', '')}\n{len(tl['all_reduces_ms'])} all-reduce(s)":
            {"ready_ms": tl.get("gradients_ms") or [tl["backward_ms"]], "link_ms": tl["all_reduces_ms"]}
            for tl in timelines}
    return speed_plots.overlap_timeline(rows, words=speed_plots.PROFILED, size=(9, 0.9 + 0.9 * len(timelines)))


def image_grid(images: torch.Tensor, labels: torch.Tensor, class_names: Sequence[str], columns: int = 10) -> Figure:
    """A grid of uint8 (N, 3, H, W) images with their class names."""
    rows = -(-len(images) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(1.1 * columns, 1.25 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label in zip(axes.flat, images, labels):
        ax.imshow(image.permute(1, 2, 0).numpy())
        ax.set_title(class_names[int(label)], fontsize=8)
    fig.tight_layout()
    return fig
