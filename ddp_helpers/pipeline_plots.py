"""Pictures for notebook 10 (pipeline and context parallelism): per-rank timelines of a
pipeline's forward and backward passes, and the blocks of a ring attention.

Plotting only: the pipelines, the replay of a schedule's order of actions and ring attention
are the notebook's own cells. matplotlib is imported inside each function, so ranks that import
this module never load it. Each function returns its figure and shows nothing itself (as `plots`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_F, _B = "#4C72B0", "#DD8452"          # forward blue, backward orange (darker for a second chunk)
_F2, _B2 = "#8FB0E0", "#F2B98F"


def _colour(kind, stage, p):
    second = p is not None and stage >= p    # interleaved: a rank's second model chunk
    if kind == "F":
        return _F2 if second else _F
    return _B2 if second else _B


def _draw(ax, per_rank, unit, origin, p):
    for rank, actions in enumerate(per_rank):
        for kind, stage, mb, start, end in actions:
            ax.barh(rank, (end - start) * unit, left=(start - origin) * unit, height=0.7,
                    color=_colour(kind, stage, p), edgecolor="white", linewidth=0.8)
            width = (end - start) * unit
            ax.text((start - origin) * unit + width / 2, rank, str(mb), ha="center", va="center",
                    fontsize=7, color="white" if kind == "F" else "black")
    ax.set_yticks(range(len(per_rank)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(per_rank))], fontsize=8)
    ax.set_ylim(len(per_rank) - 0.4, -0.6)


def timelines(runs: dict[str, list[list[tuple]]], unit: str = "ms", title: str | None = None,
              interleaved_p: int | None = None) -> Figure:
    """runs: {label: per_rank}, per_rank[r] = [(kind 'F'|'B', stage, micro-batch, start, end)].

    unit="ms": start/end are seconds from time.perf_counter (one clock for every process of the
    machine), drawn in milliseconds from the earliest start of each run. unit="slots": start/end
    are slots of a replayed schedule. White space on a row is time the rank was idle.
    interleaved_p: draw a rank's second model chunk (stage >= p) in a lighter colour."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    n = len(runs)
    rows = sum(len(per_rank) for per_rank in runs.values())
    height = 1.2 + 0.42 * rows + 0.35 * n
    fig, axes = plt.subplots(n, 1, figsize=(9.5, height), squeeze=False)
    for ax, (label, per_rank) in zip(axes[:, 0], runs.items()):
        origin = min(a[3] for actions in per_rank for a in actions)
        _draw(ax, per_rank, 1000.0 if unit == "ms" else 1.0, origin, interleaved_p)
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_xlabel("milliseconds since the first forward" if unit == "ms" else "slots", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    handles = [Patch(color=_F, label="forward (micro-batch number)"), Patch(color=_B, label="backward")]
    if interleaved_p:
        handles += [Patch(color=_F2, label="forward, 2nd chunk"),
                    Patch(color=_B2, label="backward, 2nd chunk")]
    # the legend in its own strip under the plots, so it never covers a title
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=len(handles), frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.3 / height, 1, 1))
    return fig


def ring_blocks(world_size: int = 4, causal: bool = True) -> Figure:
    """Which key/value block each rank uses at each step of ring attention: rank r holds query
    block r and, at step s, the key/value block of rank (r - s) mod n. Causal: blocks after the
    query block are skipped (grey), the diagonal block is masked inside (half-filled)."""
    import matplotlib.pyplot as plt
    n = world_size
    fig, axes = plt.subplots(1, n, figsize=(2.3 * n, 2.4), sharey=True)
    colours = plt.get_cmap("tab10")
    for step, ax in enumerate(axes):
        for r in range(n):
            j = (r - step) % n
            if causal and j > r:
                ax.add_patch(plt.Rectangle((j, r), 1, 1, facecolor="#DDDDDD", edgecolor="white"))
                ax.text(j + 0.5, r + 0.5, "skip", ha="center", va="center", fontsize=7)
            elif causal and j == r:
                ax.add_patch(plt.Polygon([(j, r), (j, r + 1), (j + 1, r + 1)], color=colours(j)))
                ax.add_patch(plt.Rectangle((j, r), 1, 1, fill=False, edgecolor="black"))
            else:
                ax.add_patch(plt.Rectangle((j, r), 1, 1, color=colours(j)))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xticks([j + 0.5 for j in range(n)])
        ax.set_xticklabels([f"K{j}" for j in range(n)], fontsize=7)
        ax.set_yticks([r + 0.5 for r in range(n)])
        ax.set_yticklabels([f"rank {r}: Q{r}" for r in range(n)], fontsize=7)
        ax.set_title(f"step {step}" + (": own block" if step == 0 else f": from rank r-{step}"), fontsize=8)
    fig.suptitle("Ring attention: the key/value block each rank (row) combines at each step, coloured by "
                 "the rank it came from", fontsize=9)
    fig.tight_layout()
    return fig
