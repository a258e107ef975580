"""Code from PyTorch's tutorials, run as written in a notebook.

PyTorch's tutorials start their ranks with `mp.spawn(demo, args=(world_size,), nprocs=world_size)`
or `mp.Process(target=..., args=(rank, size, fn))`, and each rank calls
`init_process_group` itself after setting `MASTER_ADDR` and `MASTER_PORT` to a fixed port.
Pasted into a notebook, that fails: with the spawn start method a child cannot find a
function defined in the notebook (each child raises "Can't get attribute" for it); the ranks'
output is not gathered per rank; and two runs on one machine collide on the fixed port.

`%load_ext ddp_helpers` (or `enable()`) changes that, in this kernel only:

- `torch.multiprocessing.spawn` runs the function on ranks started as `launch` starts them: the
  function travels by value, each rank's output is printed in the cell as `[rank N] ...`, a rank's
  error raises `WorkerError` in the cell (with the rank's traceback), and the Interrupt button
  stops every rank. It returns None, as mp.spawn does.
- `torch.multiprocessing.Process`, for a tutorial's rank only: a Process whose target (or a function
  in its args, or a function of the notebook they call) calls `init_process_group` or
  `init_device_mesh`, or names MASTER_ADDR/MASTER_PORT, is one rank of a group started when the
  cell first joins one of them (or when the cell ends): rank i runs the i-th such process started.
  A Pipe, Queue, Lock or shared Value cannot reach such a rank: it is refused at `start()`. Every
  other Process (a DataLoader's workers, a helper with a Queue) is multiprocessing's own, started
  at `start()`: pid, is_alive, join(timeout), terminate and sentinel work as without the shim.
- `torch.multiprocessing.set_start_method` does nothing: those ranks start from ddp_helpers' fork
  server whatever the method, and the kernel keeps its own (a re-run of the tutorial's cell
  raised "context has already been set").

In every rank that ddp_helpers starts (`launch`, `spawn`, `%%ddp`, the warm pool), unless
DDP_HELPERS_TUTORIAL_CODE=0 (`runtime.tutorial_ranks`):

- `init_process_group` where a group exists already (a `%%ddp` cell, `launch(init=True)`, the
  pool) does nothing if it asks for the same backend, rank and world size, and says so in one
  line; the matching `destroy_process_group()` does nothing too. Anything else is a clear error.
- `MASTER_ADDR`/`MASTER_PORT` set by the rank's code, or a `tcp://` init_method, are put back to
  the launch's own rendezvous (a port the OS picked, on 127.0.0.1), with two lines that say so and
  that under torchrun those lines must go: no run collides with another, and none waits for a
  store that nobody serves. Each group formed there meets under a store prefix of its own, so a
  group formed again after destroy_process_group() finds its own peers.
- a `world_size` or `rank` that does not fit the ranks started is an error at once, not a
  rendezvous that waits forever.

`disable()` undoes all of it: in the kernel at once, and in ranks started afterwards.
"""
from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing

from .runtime.tutorial_ranks import SWITCH, enabled  # noqa: F401 (the ranks' side: runtime.tutorial_ranks)

SPAWN_TIMEOUT_S = 3600                 # mp.spawn has no timeout; the Interrupt button stops the ranks
_spawn_module: Any = sys.modules["torch.multiprocessing.spawn"]
_ORIGINAL = {"spawn": torch.multiprocessing.spawn, "Process": torch.multiprocessing.Process,
             "set_start_method": torch.multiprocessing.set_start_method}


# ------------------------------------------------------------------ the kernel's side
def enable() -> None:
    """Run tutorial code as written in this kernel (see the module docstring)."""
    os.environ.pop(SWITCH, None)
    torch.multiprocessing.spawn = _spawn_module.spawn = spawn_from_cell
    torch.multiprocessing.Process = Process
    torch.multiprocessing.set_start_method = set_start_method
    _watch_cells()


def disable() -> None:
    """Put torch.multiprocessing back as torch ships it, and leave the ranks' init_process_group alone."""
    os.environ[SWITCH] = "0"
    torch.multiprocessing.spawn = _spawn_module.spawn = _ORIGINAL["spawn"]
    torch.multiprocessing.Process = _ORIGINAL["Process"]
    torch.multiprocessing.set_start_method = _ORIGINAL["set_start_method"]


def spawn_from_cell(fn: Callable, args: Sequence = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
                    start_method: str = "spawn") -> None:
    """`torch.multiprocessing.spawn`, for a function that may be defined in the notebook."""
    from .launcher import spawn
    if not join:
        raise ValueError("mp.spawn(..., join=False) is not supported from a notebook: use join=True "
                         "(or ddp_helpers.tutorials.disable() for torch's own mp.spawn)")
    unreachable = _cannot_reach_a_rank((fn, args))
    if unreachable:
        raise TypeError(f"mp.spawn runs {getattr(fn, '__qualname__', fn)!s} on ddp_helpers' ranks (started from a "
                        f"fork server, in a network of their own), which {unreachable} cannot reach. "
                        "Send data to a rank in args (it is copied) and back with a collective or the "
                        "function's output, or use torch's own mp.spawn: ddp_helpers.tutorials.disable().")
    spawn(fn, args=args, nprocs=nprocs, init=False, timeout=SPAWN_TIMEOUT_S)
    return None


def set_start_method(method: str | None, force: bool = False) -> None:
    """Does nothing: `mp.Process` and `mp.spawn` start their ranks from ddp_helpers' fork server
    whatever the start method (and the kernel's own DataLoaders keep theirs). torch's would raise
    "context has already been set" when the tutorial's cell runs again."""
    return None


_REAL_PROCESS = multiprocessing.Process   # multiprocessing's own class (torch.multiprocessing re-exports it)


class _ProcessType(type):
    def __instancecheck__(cls, obj: object) -> bool:
        # every process of multiprocessing's own class is an `mp.Process`, as it is without the shim
        return type.__instancecheck__(cls, obj) or (cls is Process and isinstance(obj, _REAL_PROCESS))


class Process(multiprocessing.Process, metaclass=_ProcessType):
    """What `mp.Process` is after `enable()`: multiprocessing's own Process, except for a tutorial's rank.

    At `start()` it looks at what the process will run. If that forms a process group (the target, a
    function given in its args, or a function of the same module they call, calls
    `init_process_group` or `init_device_mesh`, or names MASTER_ADDR/MASTER_PORT), it is a rank:
    rank i runs the i-th such Process started in the cell (its `run()`), with RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT set as torchrun sets them, all started together at the first join()
    (or when the cell ends). Anything else (a DataLoader's workers, a helper process with a Queue or
    a Pipe) starts at once as multiprocessing's own Process, and is one from then on.
    """

    _group_state: str | None = None   # None: an ordinary process; "started" (waiting for its group) or "done": a rank
    _group_exitcode: int | None = None
    _error: BaseException | None = None
    # multiprocessing's own attributes, set by its __init__ (its type stubs leave them out)
    _popen: Any
    _target: Any
    _args: tuple
    _kwargs: dict[str, Any]

    def start(self) -> None:
        if self._group_state is not None or self._popen is not None:
            raise AssertionError("cannot start a process twice")
        forms_group = type(self).run is not _REAL_PROCESS.run or self._target is not None
        if not (forms_group and _forms_a_group(self)):
            if type(self) is Process:
                self.__class__ = _REAL_PROCESS   # type: ignore[assignment]  # torch's own from here on, in this process and the child
            return _REAL_PROCESS.start(self)
        unreachable = _cannot_reach_a_rank((self._target, self._args, self._kwargs))
        if unreachable:
            for process in _waiting:   # the cell's group cannot run without this rank
                process._group_state, process._group_exitcode = "done", None
            _waiting.clear()
            raise TypeError(
                f"{self._describe()} forms a process group, so it runs as one of ddp_helpers' ranks "
                f"(started from a fork server, in a network of their own), which {unreachable} cannot "
                "reach. Send data to a rank in args (it is copied) and back with a collective or the "
                "function's output, or start torch's own Process with ddp_helpers.tutorials.disable().")
        self._group_state = "started"
        _waiting.append(self)
        return None

    def join(self, timeout: float | None = None) -> None:
        """For a rank: run the group this process belongs to (if it has not run yet) and wait for it,
        whatever the timeout. If a rank failed, the first join() raises its WorkerError."""
        if self._group_state is None:
            return _REAL_PROCESS.join(self, timeout)
        _run_waiting()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return None

    def is_alive(self) -> bool:
        if self._group_state is None:
            return _REAL_PROCESS.is_alive(self)
        return self._group_state == "started"

    @property
    def exitcode(self) -> int | None:
        if self._group_state is None:
            return super().exitcode
        return self._group_exitcode

    def terminate(self) -> None:
        if self._group_state is None:
            return _REAL_PROCESS.terminate(self)
        if self in _waiting:
            _waiting.remove(self)
            self._group_state, self._group_exitcode = "done", -15
        return None

    def kill(self) -> None:
        if self._group_state is None:
            return _REAL_PROCESS.kill(self)
        return self.terminate()

    def close(self) -> None:
        if self._group_state is None:
            return _REAL_PROCESS.close(self)
        return None

    def _describe(self) -> str:
        name = getattr(self._target, "__qualname__", None) or type(self).__name__ + ".run"
        return f"mp.Process(target={name}, ...)"

    def __repr__(self) -> str:
        if self._group_state is None:
            return _REAL_PROCESS.__repr__(self)
        return f"<Process name={self.name!r} rank {self._group_state} exitcode={self._group_exitcode}>"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._group_state is not None:   # a rank, on its way to ddp_helpers' worker: no authkey
            state.pop("_error", None)
            state["_config"] = {k: v for k, v in state.get("_config", {}).items() if k != "authkey"}
            state["_popen"] = None
        return state


# What makes a process a tutorial's rank: the names it calls, or the environment variables it names.
GROUP_NAMES = frozenset({"init_process_group", "init_device_mesh"})
GROUP_STRINGS = frozenset({"MASTER_ADDR", "MASTER_PORT"})
_LIBRARIES = ("torch.", "multiprocessing.", "concurrent.")   # their functions are never a tutorial's rank


def _forms_a_group(process: Process) -> bool:
    """Will this process form a process group? Looks at the code of its target (or its own run()),
    of the functions in its args, and of the functions of the same module that they call."""
    if process._target is None:
        roots = [type(process).run]
    else:
        roots = [process._target, *process._args, *process._kwargs.values()]
    seen: set[int] = set()
    return any(_calls_group(root, seen, depth=4) for root in roots)


def _calls_group(fn: Any, seen: set[int], depth: int) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)   # a bound method
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen or depth < 0:
        return False
    if (getattr(fn, "__module__", None) or "").startswith(_LIBRARIES):
        return False
    seen.add(id(code))
    names = set()
    stack = [code]
    while stack:   # the function and the functions, lambdas and comprehensions defined inside it
        c = stack.pop()
        names.update(c.co_names)
        for const in c.co_consts:
            if isinstance(const, type(code)):
                stack.append(const)
            elif isinstance(const, str) and const in GROUP_STRINGS:
                return True
    if names & GROUP_NAMES:
        return True
    module_globals = getattr(fn, "__globals__", {})
    return any(_calls_group(module_globals[name], seen, depth - 1)
               for name in names if inspect.isfunction(module_globals.get(name))
               and module_globals[name].__globals__ is module_globals)


def _cannot_reach_a_rank(value: object) -> str | None:
    """'a Pipe end', 'a Queue', ... for what `value` would send to a rank (in it, or in the closures and
    globals of its functions, as cloudpickle sends them) that only works between a parent and its
    own child: None if nothing. (cloudpickle would send a Pipe end as its bare file descriptor.)"""
    import cloudpickle

    class Found(Exception):
        pass

    class Finder(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            words = _parent_child_only(obj)
            if words:
                raise Found(words)
            return super().reducer_override(obj)

    class Discard:
        def write(self, data: bytes) -> int:
            return len(data)

    try:
        Finder(Discard()).dump(value)
    except Found as found:
        return found.args[0]
    except Exception:
        return None   # launch's own check names what cannot be pickled
    return None


def _parent_child_only(obj: object) -> str | None:
    import multiprocessing.connection
    import multiprocessing.managers
    import multiprocessing.queues
    import multiprocessing.sharedctypes
    import multiprocessing.synchronize
    kinds = ((multiprocessing.connection.Connection, "a Pipe end"),
             ((multiprocessing.queues.Queue, multiprocessing.queues.SimpleQueue), "a Queue"),
             ((multiprocessing.synchronize.SemLock, multiprocessing.synchronize.Condition,
               multiprocessing.synchronize.Event, multiprocessing.synchronize.Barrier),
              "a Lock, Event or other multiprocessing primitive"),
             (multiprocessing.sharedctypes.SynchronizedBase, "a shared Value or Array"),
             (multiprocessing.managers.BaseProxy, "a Manager's object"))
    for kind, words in kinds:
        if isinstance(obj, kind):
            return words
    return None


_waiting: list[Process] = []   # Process objects started and not yet run


def _run_waiting() -> None:
    """Start the processes started so far as one group of ranks, wait for them, note the outcome."""
    from .launcher import WorkerError, launch
    group = list(_waiting)
    _waiting.clear()
    if not group:
        return
    try:
        launch(_run_process, world_size=len(group), args=(group,), init=False, timeout=SPAWN_TIMEOUT_S)
    except WorkerError as exc:
        failures = getattr(exc, "failures", {}) or {}
        for rank, process in enumerate(group):
            process._group_state = "done"
            process._group_exitcode = 1 if rank in failures or rank == exc.rank else 0
        group[0]._error = exc   # the first join() raises it
        return
    except BaseException:
        for process in group:
            process._group_state, process._group_exitcode = "done", 1
        raise
    for process in group:
        process._group_state, process._group_exitcode = "done", 0


def _run_process(group: list[Process]) -> None:
    """What each rank runs: its own process's run()."""
    group[int(os.environ["RANK"])].run()


def _watch_cells() -> None:
    """Processes started in a cell that never joins them run when the cell ends."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or _after_cell in shell.events.callbacks.get("post_run_cell", []):
        return
    shell.events.register("post_run_cell", _after_cell)


def _after_cell(result: object = None) -> None:
    if _waiting:
        group = list(_waiting)
        _run_waiting()
        for process in group:
            error, process._error = process._error, None
            if error is not None:
                print(f"{error}", file=sys.stderr)
