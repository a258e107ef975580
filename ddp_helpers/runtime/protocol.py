"""What the kernel and a warm pool's rank say to each other: one request, then one reply, per rank.

The kernel (`pool.Pool`) sends a request with `cells.dumps_with_sources` (cloudpickle: a function or
a variable may come from a notebook cell) together with the source of the cells its code comes from;
the rank (`serve.serve`) answers with a `Reply` through the same multiprocessing connection (pickle).
Both are plain dataclasses, so that each side names the fields instead of counting positions.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .error_record import ErrorRecord


@dataclasses.dataclass
class Exec:
    """Run a cell in the rank's namespace; the value of its last expression comes back."""
    source: str
    sent: dict[str, Any]           # the notebook variables the cell uses (cells.globals_to_send)
    filename: str                  # the cell's file name, for tracebacks
    only: list[int] | None = None  # `%%ddp --ranks`: the ranks it runs on, which may not meet the others
    seed: int | None = None        # reseed the rank's random state first (random_state.reseed)


@dataclasses.dataclass
class Call:
    """Call `fn(*args, **kwargs)` in the rank; its result comes back."""
    fn: Callable
    args: tuple = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int | None = None        # reseed the rank's random state first (random_state.reseed)


@dataclasses.dataclass
class Push:
    """Set variables in the rank's namespace."""
    values: dict[str, Any]


@dataclasses.dataclass
class Pull:
    """The rank's value of one variable."""
    name: str


@dataclasses.dataclass
class Debug:
    """pdb in the traceback of the last cell or call that raised in this rank (`%ddp debug`)."""


@dataclasses.dataclass
class Stop:
    """Leave the process group and end (`%ddp stop`)."""


Request = Exec | Call | Push | Pull | Debug | Stop


@dataclasses.dataclass
class Reply:
    """A rank's answer to a request (or, first, to its start: whether it sees its collectives).

    value:        the result, pickled (`cells.dumps`), when the request succeeded;
    error:        the `ErrorRecord` of what it raised, when it failed;
    group_alive:  False once a cell destroyed the process group (the kernel then replaces the ranks);
    has_children: whether the rank has child processes now, so that the kernel looks for what the
                  ranks started only then (`Supervisor.note_started_processes`).
    """
    value: bytes = b""
    error: ErrorRecord | None = None
    group_alive: bool = True
    has_children: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None
