"""Pictures for notebook 13 (experts and all-to-all): the tokens of each rank coloured by expert, before
and after the dispatch; and the rows and time of each rank when the router is unbalanced.

Plotting only: the layer, the all-to-alls and the timing are the notebook's own cells. matplotlib is
imported inside each function, so ranks that import this module never load it. Each function returns
its figure and shows nothing itself (as `plots`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_EXPERTS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
_DROPPED = "#E5E5E5"


def expert_colour(e: int) -> str:
    """The colour of expert e (light grey for -1, a dropped choice)."""
    return _DROPPED if e < 0 else _EXPERTS[e % len(_EXPERTS)]


def _row(ax, y, cells, boundaries=(), label=""):
    """cells: [(expert, text)]; a vertical line before each index in boundaries."""
    for i, (e, text) in enumerate(cells):
        ax.add_patch(_square(i, y, expert_colour(e)))
        ax.text(i + 0.5, y + 0.45, text, ha="center", va="center", fontsize=6.5,
                color="black" if e < 0 else "white")
    for b in boundaries:
        ax.plot([b, b], [y - 0.1, y + 1.0], color="black", linewidth=1.6)
    ax.text(-0.4, y + 0.45, label, ha="right", va="center", fontsize=8)


def _square(x, y, colour):
    from matplotlib.patches import Rectangle
    return Rectangle((x + 0.04, y), 0.92, 0.9, facecolor=colour, edgecolor="white")


def dispatch(xs: Sequence[torch.Tensor], experts: Sequence[torch.Tensor], received: Sequence[torch.Tensor],
             n_experts: int, title: str = "") -> Figure:
    """xs[r]: rank r's tokens (T, d); experts[r]: their choices (T, k), -1 where dropped; received[r]: the
    rows rank r received, in the order they arrived. Each received row is found among the ranks' tokens.

    Three rows of squares per rank: its choices as routed (in token order), the kept ones sorted by
    expert (a bar between the rows for each destination rank: the input splits), and what it received (a
    bar between sources: the output splits). A square's text is its token ("s:t": token t of rank s)."""
    where = {tuple(row.tolist()): (s, t) for s, x in enumerate(xs) for t, row in enumerate(x)}
    before = [[(t, int(e)) for t in range(len(expert)) for e in expert[t]] for expert in experts]
    after = []
    for r, rows in enumerate(received):
        m = n_experts // len(xs)
        arrived, seen = [], set()
        for row in rows:
            s, t = where[tuple(row.tolist())]
            mine = [int(e) for e in experts[s][t] if r * m <= e < r * m + m and (s, t, int(e)) not in seen]
            seen.add((s, t, mine[0]))
            arrived.append((s, t, mine[0]))
        after.append(arrived)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    n = len(before)
    m = n_experts // n
    width = max(max(len(b) for b in before), max(len(a) for a in after), 1)
    fig, ax = plt.subplots(figsize=(min(1.6 + 0.26 * width, 10.5), 0.9 + 1.35 * n))
    y = 0
    for r in range(n):
        kept = sorted(((e, t) for t, e in before[r] if e >= 0), key=lambda c: c[0])
        splits = [sum(1 for e, _ in kept if e < (q + 1) * m) for q in range(n - 1)]
        arrived = [sum(1 for s, _, _ in after[r] if s <= q) for q in range(n - 1)]
        _row(ax, y, [(e, str(t)) for t, e in before[r]], label=f"rank {r}: routed")
        _row(ax, y + 1.1, [(e, str(t)) for e, t in kept], splits, label="sorted by expert")
        _row(ax, y + 2.2, [(e, f"{s}:{t}") for s, t, e in after[r]], arrived,
             label=f"received (experts {r * m}–{r * m + m - 1})")
        y += 3.6
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(y - 0.3, -0.4)
    ax.axis("off")
    handles = [Patch(color=expert_colour(e), label=f"expert {e}") for e in range(n_experts)]
    handles.append(Patch(color=_DROPPED, label="dropped (over capacity)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 5),
              fontsize=7.5, frameon=False)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def straggler(runs: dict[str, Sequence[tuple[int, float, float]]], load: float | None = None,
              what: str = "") -> Figure:
    """runs: {label: per rank (rows its experts computed, their CPU ms, the layer's wall-clock ms)}.
    Left: rows per rank; right: the CPU time of each rank's experts (the wall clock is not drawn: on a
    shared machine it measures the machine's load as much as the layer). The title says where it was
    measured: this machine's CPU and cores, `load` (the load average then) and `what` was run."""
    import matplotlib.pyplot as plt

    from .bench.timing import hardware_name
    n = sum(len(v) for v in runs.values())
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 1.35 + 0.42 * n + 0.3 * len(runs)), sharey=True)
    measured = f"measured on {hardware_name(torch.device('cpu'))}"
    measured += f", load average {load:.1f}" if load is not None else ""
    fig.suptitle(f"{measured}: {what}" if what else measured, fontsize=9, x=0.01, ha="left")
    ticks, labels, y = [], [], 0.0
    for name, per_rank in runs.items():
        for r, (rows, cpu, _) in enumerate(per_rank):
            left.barh(y, rows, color=_EXPERTS[r % len(_EXPERTS)], height=0.7)
            right.barh(y, cpu, color=_EXPERTS[r % len(_EXPERTS)], height=0.7)
            ticks.append(y)
            labels.append(f"{name}: rank {r}")
            y += 1
        y += 0.6
    left.set_yticks(ticks)
    left.set_yticklabels(labels, fontsize=8)
    left.invert_yaxis()
    for ax, xlabel in ((left, "rows its experts computed"), (right, "its experts' CPU time (ms)")):
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig
