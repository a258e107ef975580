"""What travels from the notebook to the ranks, and how their values come back.

- `dumps`: cloudpickle, keeping code's file names, so a rank's traceback shows notebook lines;
  `dumps_with_sources` also returns the source of each notebook cell the pickled code comes
  from (only those: not the whole notebook's).
- `globals_to_send`: which notebook variables a `%%ddp` cell needs (sent along with it).
- `PerRank`: one value per rank, shown as `[rank N] value` lines; `PerRank.of` makes one from
  what the ranks sent, and a value with a richer view (an image, HTML, a figure: `rank_io.Shown`)
  is displayed as such, after a `[rank N]` line.

- `to_cpu`: a rank's value with its tensors moved to the CPU, so that reading it never initialises
  CUDA in the notebook kernel.

The rank's side (executing a cell) is `cell_exec.exec_cell`.
"""
from __future__ import annotations

import builtins
import io
import linecache
import os
import pickle
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import cloudpickle
import torch

from .rank_io import Shown

# Names the notebook kernel defines for itself; never sent to the workers.
_KERNEL_NAMES = {"In", "Out", "get_ipython", "exit", "quit"}
# Names every rank's namespace starts with; the notebook's own never replace them.
_RANK_NAMES = {"torch", "dist", "rank", "world_size"}


class PerRank(list):
    """One value per rank, shown as `[rank N] value` lines. `ranks`: the rank of each value (all of
    them in order, unless the cell ran on some ranks only: `%%ddp --ranks`)."""

    def __init__(self, values: Iterable[Any] = (), ranks: Iterable[int] | None = None) -> None:
        super().__init__(values)
        self.ranks = list(range(len(self))) if ranks is None else list(ranks)

    @classmethod
    def of(cls, values: Sequence[Any], ranks: Iterable[int] | None = None) -> PerRank | None:
        """What a %%ddp cell returns for the ranks' last values: None when every one is None."""
        if all(v is None for v in values):
            return None
        bundles = {i: (v.data, v.metadata) for i, v in enumerate(values) if isinstance(v, Shown)}
        values = [v.value if isinstance(v, Shown) else v for v in values]
        if not bundles:
            return cls(values, ranks)
        rich = _RichPerRank(values, ranks)
        rich.bundles = bundles
        return rich

    def __repr__(self) -> str:
        return "\n".join(f"[rank {r}] {_indent(repr(v))}" for r, v in zip(self._labels(), self))

    def _labels(self) -> Sequence[int]:
        ranks = self.__dict__.get("ranks")   # a PerRank pickled before it had ranks, or appended to
        return ranks if ranks is not None and len(ranks) == len(self) else range(len(self))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


class _RichPerRank(PerRank):
    """PerRank whose values include some with a rich view: each is displayed after `[rank N]`."""
    bundles: dict[int, tuple[dict, dict]] = {}   # position -> (data, metadata)

    def _ipython_display_(self) -> None:
        from IPython.display import display
        for i, (rank, value) in enumerate(zip(self._labels(), self)):
            if i in self.bundles:
                print(f"[rank {rank}]", flush=True)
                data, metadata = self.bundles[i]
                display(data, metadata=metadata, raw=True)
            else:
                print(f"[rank {rank}] {_indent(repr(value))}", flush=True)


def _indent(text: str) -> str:
    return text.replace("\n", "\n" + " " * 9)


def names_used(source: str) -> set[str]:
    """Every global name the cell's code (and code nested in it) may read."""
    try:
        code = compile(source, "<cell>", "exec")
    except SyntaxError:
        return set()
    names: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def globals_to_send(source: str, user_ns: dict[str, Any],
                    warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The notebook variables the cell uses that can travel (cloudpickle) to the workers."""
    sent = {}
    for name in sorted(names_used(source)):
        skip = name in _KERNEL_NAMES | _RANK_NAMES or name.startswith("_") or hasattr(builtins, name)
        if skip or name not in user_ns:
            continue
        value = user_ns[name]
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            (warn or _warn)(f"%%ddp: not sending {name!r} to the workers (cannot be pickled: {type(exc).__name__})")
            continue
        sent[name] = value
    return sent


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, except that code keeps its file name (cloudpickle 3 writes
    "<dynamic-code>"), so a worker's traceback can show the notebook line it points at.
    `code_files`: the file names of the code it pickled by value."""

    def __init__(self, file: io.BytesIO, **options: Any) -> None:
        super().__init__(file, **options)
        self.code_files: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            self.code_files.add(obj.co_filename)
            reduce_code = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
            if reduce_code is not None:
                constructor, fields = reduce_code(obj)
                return constructor, tuple(obj.co_filename if f == "<dynamic-code>" else f for f in fields)
        return super().reducer_override(obj)


def dumps(obj: object) -> bytes:
    return dumps_with_sources(obj)[0]


def dumps_with_sources(obj: object) -> tuple[bytes, dict[str, tuple]]:
    """(pickled obj, {file name: linecache entry} of the notebook cells its code was written in).
    A cell's code has a file name that exists only in linecache."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump(obj)
    sources = {name: linecache.cache[name] for name in pickler.code_files
               if name in linecache.cache and len(linecache.cache[name]) == 4 and not os.path.exists(name)}
    return buffer.getvalue(), sources


def to_cpu(value: Any) -> Any:
    """Move tensors in (nested) lists, tuples and dicts to the CPU, so that
    reading results never initialises CUDA in the notebook kernel."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value
