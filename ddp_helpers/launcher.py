"""Run a function on N worker processes that form a torch.distributed process group.

    from ddp_helpers import launch
    results = launch(fn, world_size=4, backend="gloo")   # results[r] is what rank r returned
    results = spawn(demo, args=(4,), nprocs=4)          # demo(rank, 4), as torch.multiprocessing.spawn

How it works, and why:
- Workers are started by `torch.multiprocessing.start_processes` with the
  *forkserver* start method (see `runtime.supervisor`, shared with the warm pool): cheap
  copies of a fresh process that imported torch once, never forks of the kernel.
- `fn` may be defined in the notebook: it travels by value, with cloudpickle, with
  the source of the cells it was written in (for tracebacks).
- The launcher starts the rendezvous store (a `TCPStore` on 127.0.0.1, on a port
  the OS picks) beside the ranks, as torchrun's agent hosts one, and gives each
  worker the environment torchrun would give it. No fixed port, so re-runs never
  clash. On Linux the ranks and the store share a network of their own, which
  nobody else on the machine can reach (`runtime.private_net`).
- Each rank's stdout and stderr come back through a pipe and are printed
  line by line as `[rank N] ...`; a full log per rank stays in the run folder.
- Errors, crashes, hangs and the Interrupt button all end every worker (and what
  it started) and raise in the calling cell (`WorkerError`, `WorkerTimeout`,
  `KeyboardInterrupt`).
"""
from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import gpu_leases

# The input checks and the errors live in modules of their own (the pool and %%ddp use them without
# the launcher); their names stay importable from here, as they always were.
from .launch_checks import (  # noqa: F401
    BACKENDS,
    MAX_SEED,
    MAX_TIMEOUT_S,
    MAX_WORLD_SIZE,
    NO_GPU_ZERO,
    TORCHRUN_VARIABLES,
    check_env,
    check_gpu_wait,
    check_seed,
    check_timeout,
    check_world_size,
    pickle_job,
    resolve_backend,
)
from .launch_errors import WorkerError, WorkerTimeout, error_from_record, insert_hint, timeout_error  # noqa: F401
from .runtime import private_net
from .runtime.error_record import ErrorRecord
from .runtime.rank_setup import WorkerJob
from .runtime.run_dirs import rank_file
from .runtime.stacks import stacks_of
from .runtime.supervisor import Supervisor, describe_exit, interrupted
from .runtime.worker import run_worker

LEFT_EARLY_GRACE_S = 10     # init=False: how long the others may wait for a rank that left without joining
INTERRUPTED = "interrupted; the ranks were stopped (nothing is left running)."


def launch(fn: Callable, world_size: int = 2, backend: str = "gloo", args: Sequence = (),
           kwargs: dict | None = None, timeout: float = 120, init: bool = True,
           env: dict[str, str] | None = None, quiet: bool = False, seed: int | None = None,
           gpu_wait: float | None = None) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` new processes; return a list of results by rank.

    backend: "gloo" (CPU, always there), "nccl" (one CUDA GPU per rank), or
             "auto" (NCCL when there are enough GPUs, else Gloo).
    gpu_wait: NCCL ranks run on GPUs leased for this launch, that no other launch or warm pool on
             this machine holds (`gpu_leases`). Too few free: GpusBusy at once, naming who
             holds them; or, given seconds here, wait that long for them first. ("auto": Gloo.)
             None: $DDP_HELPERS_GPU_WAIT seconds, else 0 (a test suite on one GPU may set it).
    timeout: seconds until every worker is stopped and `WorkerTimeout` is raised.
    init:    call `init_process_group` before `fn` and `destroy_process_group`
             after it; with False, `fn` does it itself (e.g. to try `tcp://`).
    env:     extra environment variables for the workers (e.g. {"NCCL_DEBUG": "INFO"}); not
             the ones the launcher sets, as torchrun does (RANK, WORLD_SIZE, MASTER_PORT, ...).
    quiet:   do not print worker output in the cell (it still goes to the log).
    seed:    None (default): each rank's torch, NumPy and `random` start from fresh entropy, as in
             a process torchrun starts: different on every rank and in every launch. A whole
             number (0 to 2**63 - 1): rank r is seeded with seed + r, so the ranks still differ
             from each other, and a re-run draws the same numbers again.
    """
    world_size = check_world_size(world_size)
    asked, backend = backend, resolve_backend(backend, world_size, env)
    timeout = check_timeout(timeout)
    seed = check_seed(seed)
    gpu_wait = check_gpu_wait(gpu_wait)
    payload, cell_sources = pickle_job(fn, args, kwargs)
    extra_env = check_env(env)
    backend, lease = gpu_leases.for_ranks(backend, asked, world_size, gpu_wait, extra_env, "a launch")
    try:
        with lease, Supervisor(world_size, quiet, {**extra_env, **lease.env}) as ranks:
            job = WorkerJob(payload=payload, world_size=world_size, backend=backend, init=init,
                            pg_timeout_s=timeout, run_dir=ranks.run_dir, env=ranks.env,
                            launcher_pid=os.getpid(), cell_sources=cell_sources, seed=seed)
            ranks.start(run_worker, (job,))
            return _outcome(ranks, timeout, quiet, _hint_for(fn, world_size))
    except KeyboardInterrupt:
        raise interrupted(INTERRUPTED) from None


def spawn(fn: Callable, args: Sequence = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn", *, backend: str = "gloo", timeout: float = 120, init: bool = True,
          env: dict[str, str] | None = None, quiet: bool = False, seed: int | None = None,
          gpu_wait: float | None = None) -> list:
    """Run `fn(rank, *args)` on `nprocs` ranks, as `torch.multiprocessing.spawn` does; return
    a list of results by rank (what `launch` returns; mp.spawn itself returns None).

    For the tutorials' `def demo(rank, world_size)`, launched as `mp.spawn(demo, args=(world_size,),
    nprocs=world_size)`: the same line with `ddp_helpers.spawn` calls `demo` the same way, and
    `demo` may be defined in a notebook cell. It is `launch` underneath: the ranks are started,
    watched and stopped the same way, and errors raise `WorkerError` in the cell. The process group
    is formed before `demo` runs, as with `launch`; a function that forms its own needs `init=False`.

    fn:      called as `fn(rank, *args)`; rank is 0 .. nprocs-1.
    args:    the arguments after the rank (a tuple), as in mp.spawn.
    nprocs:  number of ranks (the world size).
    join:    True only: spawn waits for the ranks (join=False, which returns a ProcessContext,
             is not supported).
    daemon:  accepted for mp.spawn's signature; the ranks end with the launch anyway.
    start_method: accepted for mp.spawn's signature; ranks always start from the launcher's
             fork server, so functions defined in the notebook work.
    init:    as in `launch`: True forms the process group before `fn` (unlike mp.spawn); with
             False `fn` calls `init_process_group` itself (RANK, WORLD_SIZE, MASTER_ADDR and
             MASTER_PORT are set for it, so `init_process_group("gloo")` finds them).
    backend: as in `launch`; so are `timeout`, `env`, `quiet`, `gpu_wait` and `seed` (None: fresh random
             state in each rank; an int: rank r seeded with seed + r).
    """
    if join is not True:
        raise ValueError(f"spawn(join={join!r}) is not supported: it always waits for the ranks "
                         "and returns their results (join=False would return a ProcessContext)")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    check_world_size(nprocs, "nprocs")
    try:
        return launch(_call_with_rank, world_size=nprocs, backend=backend, args=(fn, *args),
                      timeout=timeout, init=init, env=env, quiet=quiet, seed=seed, gpu_wait=gpu_wait)
    except WorkerError as exc:
        hint = _hint_for(fn, nprocs, spawned=True)(exc.exc_type, exc.exc_message)
        if hint:
            exc.args = (insert_hint(str(exc), hint),)
        raise


def _call_with_rank(fn: Callable, *args: Any) -> Any:
    """What `spawn` runs in each rank: mp.spawn's call, the rank first."""
    return fn(int(os.environ["RANK"]), *args)


def _hint_for(fn: Callable, world_size: int, spawned: bool = False) -> Callable[[str | None, str | None], str]:
    """A function of (exception type, message) that returns the line saying how to pass `fn`'s
    positional arguments, when `fn` itself (not something it called) was called without them."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    short = getattr(fn, "__name__", name)

    def hint(exc_type: str | None, message: str | None) -> str:
        message = message or ""
        if name is None or exc_type != "TypeError" or not message.startswith(
                f"{name}() missing ") or "required positional argument" not in message:
            return ""
        if spawned:
            return f"spawn calls {short}(rank, *args): give the arguments after rank in args=(...)"
        for who in (short, "fn"):   # the function's own name, unless the line gets too long
            line = (f"pass them as mp.spawn does: ddp_helpers.spawn({who}, args=({world_size},), "
                    f"nprocs={world_size}), or launch(..., args=...)")
            if len(line) <= 100:
                return line
        return line
    return hint


NO_WAY_OUT = ("Network is unreachable", "Temporary failure in name resolution", "Name or service not known",
              "No address associated", "nodename nor servname")


def _no_way_out(exc_type: str | None, message: str | None) -> str:
    """The line for a rank that tried to reach the internet from its private network."""
    if any(words in (message or "") for words in NO_WAY_OUT) or exc_type in ("gaierror", "URLError"):
        return f"ranks have no network but their own: download in the notebook, or set {private_net.SWITCH}=0"
    return ""


# ------------------------------------------------------------- what happened
def _outcome(ranks: Supervisor, timeout: float, quiet: bool,
             hint: Callable[[str | None, str | None], str] | None = None) -> list:
    """Wait for the ranks; return their results, or raise what went wrong."""
    run_dir, n = ranks.run_dir, ranks.world_size

    def finished(rank: int) -> bool:
        return os.path.exists(rank_file(run_dir, rank, "result"))

    seen_early: list[float] = []

    def left_early() -> list[int] | None:
        """init=False: a rank that returned without joining the process group, while the others
        began a rendezvous (keys in the store), makes them wait for it until their own timeout.
        After LEFT_EARLY_GRACE_S (their init may have a short timeout of its own) it is named."""
        early = [r for r, p in enumerate(ranks.processes)
                 if p.exitcode == 0 and os.path.exists(rank_file(run_dir, r, "nogroup"))]
        if not early or len(early) == n or all(p.exitcode is not None for p in ranks.processes):
            return None
        if not seen_early:
            seen_early.append(time.monotonic())
        if time.monotonic() - seen_early[0] > LEFT_EARLY_GRACE_S and ranks.store.num_keys() > 0:
            return early
        return None

    outcome, named = ranks.wait_for_exits(time.monotonic() + timeout, finished=finished, check=left_early)
    detail = named or []   # the ranks that failed, or had not finished
    if outcome == "timeout":
        stacks = stacks_of(ranks, detail)
        ranks.stop()
        done = [r for r in range(n) if r not in detail]
        raise timeout_error(timeout, detail, stacks, run_dir, finished=done,
                            where="in the logs" if quiet else "printed above",
                            rendezvous=_waiting_in_rendezvous(run_dir, detail))
    if outcome == "failed":
        gone = ranks.gone()   # ended, their status not in yet: noted before stop() ends every rank
        ranks.stop()   # the others; what they printed last comes first
        detail = sorted(set(detail) | {r for r in gone
                                        if ranks.processes[r].exitcode != 0 or not finished(r)})
        private = getattr(ranks, "private_network", False)
        raise _failure_error(run_dir, ranks.processes, detail,
                             lambda t, m: (hint(t, m) if hint else "") or (private and _no_way_out(t, m)) or "")
    return [_read_result(run_dir, r) for r in range(n)]


def _failure_error(run_dir: str, processes: Sequence[Any], failed: list[int],
                   hint: Callable[[str | None, str | None], str] | None = None) -> WorkerError:
    """The error naming the rank that failed first. When one rank dies or raises in a collective,
    its peers raise "Connection closed by peer" a moment later. So ranks that crashed or left
    early (no Python exception) come first, then ranks that raised an error of their own, then
    ranks whose error says that a peer went away; the lowest rank within each."""
    records = {r: _read_error(run_dir, r) for r in range(len(processes))}
    first = min(failed, key=lambda r: (records[r] is not None, _lost_a_peer(records[r]), r))
    failures = {r: _describe_exit(run_dir, r, p.exitcode, records[r]) for r, p in enumerate(processes)
                if r != first and p.exitcode not in (0, None)}
    failures[first] = _describe_exit(run_dir, first, processes[first].exitcode, records[first])
    others = sorted(r for r in failures if r != first)
    note = f"other ranks then stopped: {others}" if others else ""
    record = records[first]
    if record is not None:
        error = error_from_record(first, record, run_dir, note, failures)
        line = hint(error.exc_type, error.exc_message) if hint else ""
        if line:
            error.args = (insert_hint(str(error), line),)
        return error
    tail = f"\n({note})" if note else ""
    return WorkerError(f"rank {first} {failures[first]}. Full logs: {run_dir}{tail}",
                       rank=first, log_dir=run_dir, failures=failures)


PEER_WENT_AWAY = ("closed by peer", "reset by peer", "Broken pipe")   # Gloo's words for it


def _lost_a_peer(record: ErrorRecord | None) -> bool:
    return record is not None and any(words in record.message for words in PEER_WENT_AWAY)


def _describe_exit(run_dir: str, rank: int, exitcode: int | None, record: ErrorRecord | None) -> str:
    if record is not None:
        return f"raised {record.type}: {record.message}"
    if exitcode == 0 and os.path.exists(rank_file(run_dir, rank, "nogroup")):
        return ("returned without joining the process group, while the other ranks waited for it in "
                f"init_process_group for {LEFT_EARLY_GRACE_S} s (with init=False every rank must call it)")
    if exitcode == 0:
        return "exited with code 0 before returning a value (sys.exit or os._exit inside the function?)"
    if exitcode is None:
        return "ended; its exit status did not arrive"
    return describe_exit(exitcode)


def _waiting_in_rendezvous(run_dir: str, ranks: list[int]) -> dict[int, str]:
    """{rank: the address it waits on} for ranks that are inside init_process_group."""
    found: dict[int, str] = {}
    for r in ranks:
        try:
            with open(rank_file(run_dir, r, "rendezvous")) as f:
                found[r] = f.read().strip() or "?"
        except OSError:
            pass
    return found


def _read_error(run_dir: str, rank: int) -> ErrorRecord | None:
    """The `ErrorRecord` a rank left (`rank_setup.report_error`), None if it left none."""
    try:
        with open(rank_file(run_dir, rank, "error"), "rb") as f:
            return ErrorRecord.from_dict(pickle.load(f))
    except FileNotFoundError:
        return None


def _read_result(run_dir: str, rank: int) -> Any:
    with open(rank_file(run_dir, rank, "result"), "rb") as f:
        return pickle.load(f)
