"""Pictures for notebook 09 (DTensor placements; bytes saved for backward under TP and SP).

Each function is self-contained: it takes what the ranks returned, draws it with pyplot and returns
the figure, showing nothing itself (as `plots`: `fig = parallel_plots.show_placements(...)` as a
cell's last line, or `plt.show()` after it when the cell prints more).
"""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure


def _rank_colour(rank):
    return plt.get_cmap("tab10")(rank % 10)


def digit_ranks(value: float, world_size: int) -> list[int]:
    """The ranks whose digit is non-zero in `value`, where rank r's data are multiples of 10**r
    (1..9 times 10**r): one rank for data that moved, several for a sum of the ranks' terms."""
    digits = f"{int(round(abs(float(value)))):0{world_size}d}"[::-1]
    return [r for r in range(world_size) if r < len(digits) and digits[r] != "0"]


def _draw_local(ax, local, world_size, pixels=12):
    """One rank's local tensor as a grid of cells; each cell coloured by the rank(s) its value came
    from: one colour when it came from one rank, a stripe per rank when it is a sum of their terms.
    (One image per tensor, drawn with imshow: fast even for many cells.)"""
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    grid = torch.as_tensor(local).detach().float()
    grid = grid.reshape(1, -1) if grid.dim() < 2 else grid.reshape(-1, grid.shape[-1])
    rows, cols = grid.shape
    if grid.numel() == 0:
        ax.text(0.5, 0.5, "—", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    image = torch.ones(rows * pixels, cols * pixels, 3)
    for i in range(rows):
        for j in range(cols):
            value = float(grid[i, j])
            sources = digit_ranks(value, world_size) or [0]
            for k, source in enumerate(sources):
                a = j * pixels + 1 + k * (pixels - 2) // len(sources)
                b = j * pixels + 1 + (k + 1) * (pixels - 2) // len(sources)
                image[i * pixels + 1:(i + 1) * pixels - 1, a:b] = torch.tensor(_rank_colour(source)[:3])
            shade = _rank_colour(sources[0]) if len(sources) == 1 else (0.5, 0.5, 0.5)
            ink = "black" if 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2] > 0.55 else "white"
            ax.text((j + 0.5) * pixels - 0.5, (i + 0.5) * pixels - 0.5, f"{value:g}", ha="center",
                    va="center", fontsize=7 if abs(value) >= 1000 else 8, color=ink)
    ax.imshow(image.numpy(), extent=(-0.5, cols * pixels - 0.5, rows * pixels - 0.5, -0.5),
              interpolation="nearest")


def show_placements(per_rank: Sequence[Sequence[torch.Tensor]], stages: Sequence[str], title: str,
                    notes: Sequence[str] | None = None) -> Figure:
    """Each rank's local tensor (rows: ranks) at each stage (columns) of a chain of redistributions.

    per_rank[r][s] is rank r's local tensor at stage s, data made so that rank r's numbers are
    multiples of 10**r (`digit_ranks`): a cell is coloured by the rank its value came from, and a sum
    over ranks (a Partial reduced) is drawn as one stripe per rank whose term is in it.
    stages: the column titles (the placements); notes[s]: what the step into stage s cost
    (for example the collectives CommDebugMode counted), written under the title.
    """
    world_size = len(per_rank)
    shapes = [[tuple(torch.as_tensor(v).reshape(-1, torch.as_tensor(v).shape[-1]).shape)
               for v in ranks] for ranks in per_rank]
    widths = [max(shape[s][1] for shape in shapes) for s in range(len(stages))]
    heights = [max(shape[s][0] for s in range(len(stages))) for shape in shapes]
    fig, axes = plt.subplots(world_size, len(stages), squeeze=False,
                             gridspec_kw={"width_ratios": widths, "height_ratios": heights},
                             figsize=(1.2 + 0.55 * sum(widths) + 0.5 * len(stages),
                                      1.3 + 0.5 * sum(heights)))
    for rank in range(world_size):
        for s in range(len(stages)):
            ax = axes[rank][s]
            _draw_local(ax, per_rank[rank][s], world_size, pixels=12)
            ax.set_xlim(-0.5, widths[s] * 12 - 0.5)
            ax.set_ylim(heights[rank] * 12 - 0.5, -0.5)
            if s == 0:
                ax.set_ylabel(f"rank {rank}", rotation=0, ha="right", va="center", labelpad=12)
            if rank == 0:
                note = (notes or [""] * len(stages))[s]
                ax.set_title(stages[s] + (f"\n{note}" if note else ""), fontsize=9)
    fig.suptitle(title)
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_rank_colour(r)) for r in range(world_size)],
               labels=[f"from rank {r}" for r in range(world_size)], loc="lower center",
               ncol=world_size, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def activation_bars(rows: dict[str, dict[str, float]], title: str) -> Figure:
    """Bytes saved for backward per rank, stacked by where they were saved.

    rows: {label: {part: bytes}}, e.g. {"one process": {...}, "TP, 2 ranks": {...}}; one bar per label.
    """
    labels = list(rows)
    parts = list(dict.fromkeys(part for row in rows.values() for part in row))
    fig, ax = plt.subplots(figsize=(7.5, 0.6 + 0.45 * len(labels)))
    left = [0.0] * len(labels)
    palette = plt.get_cmap("Set2")
    for k, part in enumerate(parts):
        values = [rows[label].get(part, 0) / 1024 for label in labels]
        ax.barh(labels, values, left=left, color=palette(k), label=part)
        left = [a + b for a, b in zip(left, values)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:,.0f} KiB", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("KiB saved for backward, per rank")
    ax.set_xlim(0, max(left) * 1.25)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    fig.tight_layout()
    return fig


__all__ = ["digit_ranks", "show_placements", "activation_bars"]
