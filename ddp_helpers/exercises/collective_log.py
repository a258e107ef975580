"""`CollectiveLog`: inside a rank, a note of every c10d collective the rank runs, below
torch.distributed's Python functions (however it was reached): its name, group size, the bytes handed in
and, for an all-to-all, the split sizes and the bytes sent to other ranks (with `keep_rows`, also a copy of
the rows sent). Notebook 13 counts its traffic with it; its exercise checker reads the same notes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .spies import DispatchSpy, collective_name

__all__ = ["Call", "CollectiveLog"]


@dataclass
class Call:
    """One collective as this rank ran it."""
    op: str                       # "all_to_all", "all_reduce", "all_gather", ...
    group: int                    # ranks in its group
    nbytes: int                   # bytes this rank handed in
    shape: tuple = ()             # of the (first) tensor handed in
    dtype: str = ""
    in_splits: list | None = None     # all-to-all: rows to each rank of the group
    out_splits: list | None = None    # all-to-all: rows from each rank of the group
    to_others: int = 0            # all-to-all: bytes for the other ranks; all-gather: nbytes x (group - 1)


class CollectiveLog(DispatchSpy):
    """Inside a rank: `with CollectiveLog() as log:` notes each c10d collective in `log.calls`, as
    plain dicts (the fields of `Call`), so they can be returned from a rank as they are."""

    def __init__(self, keep_rows: bool = False):
        super().__init__()
        self.calls: list[dict] = []
        self.keep_rows = keep_rows     # each all_to_all_single's input, copied, as its call's "rows"

    def see(self, func, args) -> None:
        schema = func._schema.name
        if not schema.startswith("c10d::"):
            return
        op = collective_name(schema)
        names = [a.name for a in func._schema.arguments]
        unbox = getattr(dist.ProcessGroup, "unbox", None)   # the ScriptObject the operator gets -> its group
        group = unbox(args[names.index("process_group")]) if unbox and "process_group" in names else None
        size = group.size() if group is not None else dist.get_world_size()
        given = args[1] if op.startswith(("all_gather", "reduce_scatter", "alltoall")) else args[0]
        tensors = [t for t in (given if isinstance(given, (list, tuple)) else [given]) if isinstance(t, torch.Tensor)]
        first = tensors[0] if tensors else torch.empty(0)
        call = Call("all_to_all" if op.startswith("alltoall") else op, size,
                    sum(t.numel() * t.element_size() for t in tensors), tuple(first.shape), str(first.dtype))
        if schema == "c10d::alltoall_base_":
            rows = first.shape[0] if first.dim() else 0
            row_bytes = math.prod(first.shape[1:]) * first.element_size()
            call.in_splits = [int(n) for n in args[4]] or [rows // size] * size
            call.out_splits = [int(n) for n in args[3]] or [args[0].shape[0] // size] * size
            me = group.rank() if group is not None else dist.get_rank()
            call.to_others = (sum(call.in_splits) - call.in_splits[me]) * row_bytes
        elif op.startswith("all_gather"):
            call.to_others = call.nbytes * (size - 1)
        elif op == "send":
            call.to_others = call.nbytes
        self.calls.append(dataclasses.asdict(call))
        if self.keep_rows and schema == "c10d::alltoall_base_":
            self.calls[-1]["rows"] = _plain(first)

    def sent(self, op: str | None = None) -> int:
        """Bytes this rank's all-to-alls and all-gathers sent to other ranks (or those of `op` only)."""
        return sum(c["to_others"] for c in self.calls if op is None or c["op"] == op)


def _plain(value):
    """A learner's tensor as a plain, detached copy (a subclass's own methods never run in the kernel)."""
    if isinstance(value, torch.Tensor):
        return value.detach().as_subclass(torch.Tensor).clone()
    return None
