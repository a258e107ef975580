"""Plumbing for notebook 08 (sharding): count the bytes a rank holds, record what
FSDP2 does in a step, in order (its hooks and the collectives they issue, with
dtypes and bytes: `FsdpTrace`), note the group each collective ran in (`GroupTrace`, for
HSDP's 2-D mesh), and draw the ZeRO stages and the memory table
(the plot functions return the figure).

The "Try it" exercise's checker lives with the others (`exercises.check_shard_and_reassemble`,
in `exercises.sharding`); its solutions are in `ddp_helpers/solutions.py`.

The lesson's code (the ZeRO-1 step, `fully_shard`, and in Going further the
distributed checkpoint) is in the notebook's cells, not here.

Bytes are counted as PyTorch holds them: the whole storage behind each tensor
(so padding that a shard is a view into counts), each storage once, and for a
DTensor the local shard's storage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .compat import renamed
from .exercises.spies import DispatchSpy, c10d_collective

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["storage_bytes", "rank_memory", "CATEGORIES", "format_table", "plot_memory_table", "plot_zero_stages",
           "FsdpTrace", "GroupTrace", "format_gather_order", "all_gather_single"]

# ---------------------------------------------------------------- memory accounting


def _local(t):
    """The plain tensor behind `t`: a DTensor's local shard, else t itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shard).

    A view counts its whole storage (padding included), and two views of one
    storage count it once. `seen` (a set of storage addresses) carries that
    across calls, so a storage already counted in one category is not counted
    again in the next.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else ("empty", id(t))
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def rank_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra_grads=()) -> dict[str, int]:
    """What this rank holds, in bytes: {"parameters", "gradients", "optimizer state", "buffers"}.

    Parameters are the model's and the optimizer's (a view into a storage already
    counted adds nothing); gradients are their `.grad` plus `extra_grads`; the
    optimizer state is every tensor in `optimizer.state` (Adam: exp_avg,
    exp_avg_sq and a one-element `step` per parameter tensor).
    """
    seen = set()
    params = list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": storage_bytes(params, seen),
        "gradients": storage_bytes([p.grad for p in params] + list(extra_grads), seen),
        "optimizer state": storage_bytes(state, seen),
        "buffers": storage_bytes(model.buffers(), seen),
    }


CATEGORIES = ("parameters", "gradients", "optimizer state", "buffers")


def _rank_groups(held):
    """[(label, bytes)] for consecutive ranks that hold the same bytes: "rank 3", "ranks 0-2"."""
    groups = []
    for rank, h in enumerate(held):
        if groups and groups[-1][2] == h:
            groups[-1][1] = rank
        else:
            groups.append([rank, rank, h])
    return [(f"rank {a}" if a == b else f"ranks {a}-{b}", h) for a, b, h in groups]


def format_table(rows: list[dict]) -> str:
    """rows: [{"scheme", "N", "theory": {category: bytes}, "held": [per rank {category: bytes}]}]
    -> a text table, theory then the measured bytes per category; consecutive ranks that hold the
    same bytes share one line ("ranks 0-2")."""
    lines = [f"{'scheme':<8}{'N':>2}  {'':<9}" + "".join(f"{c:>16}" for c in CATEGORIES) + f"{'total':>8}"]
    for row in rows:
        theory = row["theory"]
        lines.append(f"{row['scheme']:<8}{row['N']:>2}  {'theory':<9}"
                     + "".join(f"{theory.get(c, 0):>16,}" for c in CATEGORIES)
                     + f"{sum(theory.values()):>8,}")
        for label, held in _rank_groups(row["held"]):
            lines.append(f"{'':<10}  {label:<9}" + "".join(f"{held[c]:>16,}" for c in CATEGORIES)
                         + f"{sum(held.values()):>8,}")
    return "\n".join(lines)


_COLOURS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer state": "#55A868", "buffers": "#8172B3"}


def plot_memory_table(rows: list[dict],
                      title: str = "Bytes per rank: computed (hatched) and what rank 0 holds (solid)") -> Figure:
    """Stacked bars per scheme and N: the computed bytes beside what rank 0 measured."""
    import matplotlib.pyplot as plt  # here, not at the top: ranks import this module and never plot
    from matplotlib.patches import Patch
    fig, ax = plt.subplots(figsize=(10, 4.2))
    centres, labels = [], []
    for i, row in enumerate(rows):
        left = 3 * i                                      # two bars, then a gap
        for offset, values, hatch in ((0, row["theory"], "//"), (1, row["held"][0], "")):
            bottom = 0
            for c in CATEGORIES:
                v = values.get(c, 0)
                ax.bar(left + offset, v, width=0.9, bottom=bottom, color=_COLOURS[c], hatch=hatch,
                       edgecolor="white")
                bottom += v
        centres.append(left + 0.5)
        labels.append(f"{row['scheme']}\nN = {row['N']}")
    ax.set_xticks(centres)
    ax.set_xticklabels(labels, fontsize=11)
    ax.tick_params(axis="y", labelsize=11)
    ax.set_ylabel("bytes", fontsize=11)
    ax.set_title(title, fontsize=12)
    handles = [Patch(color=_COLOURS[c], label=c) for c in CATEGORIES]
    handles += [Patch(facecolor="white", edgecolor="grey", hatch="//", label="computed"),
                Patch(facecolor="grey", label="rank 0 holds")]
    ax.legend(handles=handles, fontsize=10, loc="upper right", ncol=2)
    ax.set_ylim(0, 1.35 * max(sum(r["held"][0].values()) for r in rows))
    fig.tight_layout()
    return fig


def plot_zero_stages(world_size: int = 4) -> Figure:
    """The ZeRO paper's picture: what each of `world_size` ranks keeps of the parameters,
    gradients and optimizer state under DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP)."""
    import matplotlib.pyplot as plt
    stages = [("DDP", ()), ("ZeRO-1", ("optimizer state",)), ("ZeRO-2", ("optimizer state", "gradients")),
              ("ZeRO-3 = FSDP", ("optimizer state", "gradients", "parameters"))]
    sizes = {"parameters": 1, "gradients": 1, "optimizer state": 2}   # Adam: 2 floats per parameter
    fig, axes = plt.subplots(1, len(stages), figsize=(11, 2.9), sharey=True)
    for ax, (name, sharded) in zip(axes, stages):
        total = 0.0
        for rank in range(world_size):
            left = 0
            for c, size in sizes.items():
                ax.add_patch(plt.Rectangle((left, rank), size, 0.8, facecolor="white", edgecolor=_COLOURS[c]))
                if c in sharded:
                    part = size / world_size
                    ax.add_patch(plt.Rectangle((left + rank * part, rank), part, 0.8, color=_COLOURS[c]))
                    total += part
                else:
                    ax.add_patch(plt.Rectangle((left, rank), size, 0.8, color=_COLOURS[c]))
                    total += size
                left += size
        ax.set_xlim(0, 4)
        ax.set_ylim(world_size, -0.2)
        ax.set_xticks([0.5, 1.5, 3])
        ax.set_xticklabels(["params", "grads", "Adam"], fontsize=10)
        ax.set_title(f"{name}\n{4 * total / world_size:.1f} bytes/param per rank", fontsize=10)
    axes[0].set_yticks([r + 0.4 for r in range(world_size)])
    axes[0].set_yticklabels([f"rank {r}" for r in range(world_size)], fontsize=10)
    fig.suptitle(f"Filled: what each of {world_size} ranks keeps (float32 + Adam: 4 + 4 + 8 bytes per parameter)",
                 fontsize=11)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- what FSDP2 does, in order

def _c10d_name(func, args):
    """('all_gather' | 'reduce_scatter' | 'all_reduce' | 'broadcast' | ..., the tensors this rank hands
    in) for a c10d op, else None."""
    found = c10d_collective(func, args)
    if not found:
        return None
    name, tensors = found
    return next((base for base in ("all_gather", "reduce_scatter", "all_reduce", "broadcast") if base in name),
                name), tensors


class FsdpTrace(DispatchSpy):
    """Records, in order and without a clock, what FSDP2 does in a forward and backward pass.

    FSDP2 labels its work with `torch.profiler.record_function` ("FSDP::pre_forward (layers.0)",
    "FSDP::all_gather (layers.1)", ...: the names a profiler trace shows); a dispatch mode sees those
    labels even with no profiler running, and every c10d collective below torch.distributed's
    Python functions. Use it as a context manager around the pass, inside a rank:

        events: [("pre_forward", module), ("all_gather", module, dtype, bytes sent), ...]
        by_hook(): [(hook, module, [modules whose all-gather that hook issued])]
        collectives(): {(collective, dtype): bytes this rank sent}
    """

    def __init__(self):
        super().__init__()
        self.events = []
        self._owner = "?"

    def see(self, func, args):
        if func._schema.name.startswith("profiler::_record_function_enter"):
            label = str(args[0]) if args else ""
            if label.startswith("FSDP::"):
                what, _, module = label[len("FSDP::"):].partition(" (")
                module = module.split(")")[0]
                if what in ("pre_forward", "pre_backward"):
                    self.events.append((what, module))
                elif what in ("all_gather", "post_backward_reduce"):
                    self._owner = module
            return
        found = _c10d_name(func, args)
        if found:
            collective, sent = found
            self.events.append((collective, self._owner, sent[0].dtype if sent else None,
                                sum(t.numel() * t.element_size() for t in sent)))

    def by_hook(self):
        """[(hook, module, [modules all-gathered while that hook ran])], in the order the hooks ran."""
        hooks = []
        for event in self.events:
            if event[0] in ("pre_forward", "pre_backward"):
                hooks.append((event[0], event[1], []))
            elif event[0] == "all_gather" and hooks:
                hooks[-1][2].append(event[1])
        return hooks

    def collectives(self):
        """{(collective, dtype name): bytes this rank sent}, over the whole recording."""
        total = {}
        for event in self.events:
            if len(event) == 4:
                key = (event[0], str(event[2]).replace("torch.", ""))
                total[key] = total.get(key, 0) + event[3]
        return total


class GroupTrace(DispatchSpy):
    """Notes each c10d collective this rank runs, with the ranks of the group it ran in. Use it as a
    context manager inside a rank:

        calls: [(collective, ranks of its group, bytes this rank put in), ...] in order
        totals({ranks: name}): ({"all_gather over shard": count, ...}, {same keys: bytes put in})
    """

    def __init__(self):
        super().__init__()
        self.calls = []

    def see(self, func, args):
        found = _c10d_name(func, args)
        if not found:
            return
        unbox = getattr(dist.ProcessGroup, "unbox", None)   # the operator gets its group as a ScriptObject
        names = [a.name for a in func._schema.arguments]
        if unbox is None or "process_group" not in names:
            raise RuntimeError(f"GroupTrace cannot tell the group of {func._schema.name} in torch "
                               f"{torch.__version__} (no ProcessGroup.unbox or no process_group argument)")
        ranks = tuple(dist.get_process_group_ranks(unbox(args[names.index("process_group")])))
        collective, sent = found
        self.calls.append((collective, ranks, sum(t.numel() * t.element_size() for t in sent)))

    def totals(self, group_names: dict) -> tuple[dict, dict]:
        """({"<collective> over <name>": count}, {same: bytes put in}), a group named by its ranks."""
        counts, sent = {}, {}
        for collective, ranks, nbytes in self.calls:
            key = f"{collective} over {group_names[ranks]}"
            counts[key] = counts.get(key, 0) + 1
            sent[key] = sent.get(key, 0) + nbytes
        return counts, sent


def format_gather_order(orders: dict[str, list]) -> str:
    """{setting: FsdpTrace.by_hook()} -> lines: per pass, each hook and what it all-gathered."""
    lines = []
    for hook, title in (("pre_forward", "forward"), ("pre_backward", "backward")):
        lines.append(f"{title}: each block's hook -> the all-gathers it issued")
        for setting, hooks in orders.items():
            steps = [f"{module}: {', '.join(gathered) or '-'}" for h, module, gathered in hooks if h == hook]
            lines.append(f"  {setting:<10}" + " | ".join(steps))
    return "\n".join(lines)


# ---------------------------------------------------------------- the "Try it" exercise

def all_gather_single(output, input):
    """dist.all_gather_single (torch 2.14's name) or dist.all_gather_into_tensor (older torch)."""
    return renamed("all_gather_single")(output, input)
