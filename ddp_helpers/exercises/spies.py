"""The one layer of spies: what a rank's code calls, seen from inside the rank.

Every checker that looks at *how* a learner's code computed its result uses these, inside the rank:

- `replacing(module, {name: function})`: the patch-and-restore under all of them
  (`unittest.mock.patch.object` in an `ExitStack`: each name put back on exit, even where the
  learner's code replaced it meanwhile);
- `forbidding(names)`: the named collectives raise `RuleBroken` (an exercise that rebuilds one);
- `CallLog` / `noting_calls(names)`: each call of the named `dist.*` functions noted in order, the
  outermost call only (a collective built from others is noted once), as its name or as what a
  `describe` function makes of it (with `finish`, also after the real call returned);
- `recording_p2p()`: every send/recv/isend/irecv (in `torch.distributed` and in `distributed_c10d`,
  where `batch_isend_irecv` and `P2POp` find them), as the events `traffic.Traffic` reads;
- `CollectiveRecorder`: a dispatch mode that notes every c10d collective below torch.distributed's
  Python functions (however the learner reached it), with the bytes this rank hands in;
  `DispatchSpy` is its base, which `sharding.FsdpTrace` uses too.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.c10d_names import collective_name  # noqa: F401 (collective_log takes it from here)

# Every collective a learner may reach for, and the point-to-point calls (names vary across torch
# versions: the spies skip names the installed torch does not have).
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "send", "recv", "isend", "irecv")
P2P = ("send", "recv", "isend", "irecv")


class RuleBroken(RuntimeError):
    """The exercise asked to build this without the collective it called."""


def op_name(op) -> str:
    """'SUM', 'AVG', 'MAX', ... for a dist.ReduceOp."""
    return "SUM" if op == dist.ReduceOp.SUM else "AVG" if op == dist.ReduceOp.AVG else str(op).split(".")[-1]


@contextlib.contextmanager
def replacing(module: ModuleType, functions: dict[str, Callable]) -> Iterator[None]:
    """While the block runs, module.<name> is functions[name] (names the module lacks are skipped);
    afterwards each original is back, whatever the block did to it."""
    with contextlib.ExitStack() as stack:
        for name, function in functions.items():
            if hasattr(module, name):
                stack.enter_context(mock.patch.object(module, name, function))
        yield


def forbidding(names: Iterable[str]) -> contextlib.AbstractContextManager:
    """The named dist.* functions raise RuleBroken while the block runs."""
    def refuse(name):
        def call(*args, **kwargs):
            raise RuleBroken(f"this exercise is about building it yourself: use send/recv, not dist.{name}")
        return call
    return replacing(dist, {name: refuse(name) for name in names})


class CallLog:
    """Notes, in order, the calls this rank's code makes to the functions it watches.

    Only outermost calls are noted (a watched function that calls another is one note); with
    `this_thread`, only calls from the thread that made the log. describe(name, args, kwargs) makes
    a note (default: the bare name; None: not noted); finish(note, args, kwargs, result), if given,
    runs after the real call returned (e.g. to read the tensor after an all_reduce)."""

    def __init__(self, this_thread: bool = False):
        self.notes: list = []
        self._depth: list[str] = []
        self._thread = threading.get_ident() if this_thread else None

    def _noting(self) -> bool:
        return not self._depth and (self._thread is None or threading.get_ident() == self._thread)

    def wrap(self, name: str, real: Callable, describe: Callable | None = None,
             finish: Callable | None = None) -> Callable:
        def call(*args, **kwargs):
            if not self._noting():
                return real(*args, **kwargs)
            note = describe(name, args, kwargs) if describe else name
            if note is not None:
                self.notes.append(note)
            self._depth.append(name)
            try:
                result = real(*args, **kwargs)
            finally:
                self._depth.pop()
            if finish and note is not None:
                finish(note, args, kwargs, result)
            return result
        return call

    def watching(self, names: Iterable[str], module: ModuleType = dist, describe: Callable | None = None,
                 finish: Callable | None = None) -> contextlib.AbstractContextManager:
        """A context manager: module.<name> noted while the block runs, for each name it has."""
        return replacing(module, {name: self.wrap(name, getattr(module, name), describe, finish)
                                  for name in names if hasattr(module, name)})


@contextlib.contextmanager
def noting_calls(names: Iterable[str], describe: Callable | None = None) -> Iterator[list]:
    """Inside a rank: while the block runs, each dist.<name> notes its name (or describe's note) in
    call order, outermost calls only. Yields that list."""
    log = CallLog()
    with log.watching(names, describe=describe):
        yield log.notes


# ---- point-to-point traffic: the events traffic.Traffic reads -----------------------------------

class _Completion:
    """A Work handle that notes when the learner waits for a receive."""

    def __init__(self, work, on_wait):
        self._work, self._on_wait = work, on_wait

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._on_wait()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _peer(args, kwargs, key):
    """The global rank a p2p call names (dst/src positionally or by keyword, or group_dst/group_src)."""
    peer = args[0] if args else kwargs.get(key)
    if peer is None and kwargs.get(f"group_{key}") is not None:
        peer = kwargs[f"group_{key}"]
        group = kwargs.get("group")
        if group is not None and group != dist.group.WORLD:
            peer = dist.get_global_rank(group, peer)
    return peer


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def recording_p2p() -> Iterator[list]:
    """Inside a rank: while the block runs, every message this rank posts and every receive it
    completes is appended, in program order, to the yielded list as (kind, peer, index, bytes):
    kind "send" or "recv", index the message's number between this rank and that peer (the kernel
    matches the i-th send from a to b with the i-th receive at b from a)."""
    from torch.distributed import distributed_c10d as c10d
    events = []
    real = {name: getattr(c10d, name) for name in P2P}
    counts = {}

    def numbered(kind, peer):
        counts[kind, peer] = counts.get((kind, peer), -1) + 1
        return counts[kind, peer]

    def recv(tensor, *args, **kwargs):
        source = real["recv"](tensor, *args, **kwargs)
        peer = _peer(args, kwargs, "src")
        peer = source if peer is None else peer
        events.append(("recv", peer, numbered("recv", peer), _nbytes(tensor)))
        return source

    def irecv(tensor, *args, **kwargs):
        peer = _peer(args, kwargs, "src")
        index = numbered("recv", peer)   # matched in the order the receives are posted
        work = real["irecv"](tensor, *args, **kwargs)
        done = []

        def on_wait():
            if not done:
                done.append(True)
                events.append(("recv", peer, index, _nbytes(tensor)))
        return _Completion(work, on_wait) if work is not None else work

    inside = []   # torch's own send/recv may call isend/irecv: count the outermost call only

    def outermost(name, record):
        def call(tensor, *args, **kwargs):
            if inside:
                return real[name](tensor, *args, **kwargs)
            inside.append(name)
            try:
                return record(tensor, *args, **kwargs)
            finally:
                inside.pop()
        return call

    def sending(name):
        def record(tensor, *args, **kwargs):
            peer = _peer(args, kwargs, "dst")
            events.append(("send", peer, numbered("send", peer), _nbytes(tensor)))
            return real[name](tensor, *args, **kwargs)
        return record

    wrapped = {name: outermost(name, record) for name, record in
               (("send", sending("send")), ("isend", sending("isend")), ("recv", recv), ("irecv", irecv))}
    with replacing(c10d, wrapped), replacing(dist, wrapped):
        yield events


# ---- below torch.distributed's Python functions: a dispatch mode --------------------------------

def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def c10d_collective(func, args) -> tuple[str, list[torch.Tensor]] | None:
    """For a c10d operator: (the collective's name, the tensors this rank hands in), else None.
    All-gathers and reduce-scatters take (outputs, inputs); the others their tensors first."""
    schema = func._schema.name
    if not schema.startswith("c10d::"):
        return None
    op = collective_name(schema)
    given = args[1] if op.startswith(("all_gather", "reduce_scatter")) and len(args) > 1 else \
        (args[0] if args else None)
    return op, _tensors(given)


class DispatchSpy(TorchDispatchMode):
    """A dispatch mode that shows every operator this rank runs to `see(func, args)`, then runs it."""

    def see(self, func, args) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.see(func, args)
        return func(*args, **(kwargs or {}))


class CollectiveRecorder(DispatchSpy):
    """Notes every c10d collective as (name, bytes this rank hands in) in `calls`. It sees them below
    torch.distributed's Python functions: a call counts however the learner reached it (dist.<name>,
    an older alias, or a variable holding torch's function)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def see(self, func, args) -> None:
        found = c10d_collective(func, args)
        if found:
            op, tensors = found
            self.calls.append((op, sum(_nbytes(t) for t in tensors)))
