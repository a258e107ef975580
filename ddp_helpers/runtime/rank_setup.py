"""A rank's start and end, for `launch`'s ranks (`worker`) and a warm pool's (`serve`) alike.

`setup_worker_process(local_rank, job)`, in order:

1. sends this process's stdout and stderr (file descriptors 1 and 2, so C++
   output from Gloo/NCCL too) into a pipe that the kernel reads line by line;
2. sets the environment torchrun would set (RANK, WORLD_SIZE, MASTER_PORT, ...), and gives
   the process a random state of its own (`random_state.reseed`), as a fresh process has;
3. starts a watchdog that ends this rank if the launching process dies.

Then `init_process_group` forms the group (when asked); an error is left for the kernel as an
`ErrorRecord` (`report_error`); and `end_worker` is what every rank does last: flush its output and
end any process it started and left running (the rank adopts the orphans of its family, so a daemon
that double-forked and left its session is among them). A function that returns while threads it
started still run (not daemon threads: Python waits for those before the process may exit) is an
error that names them (`ThreadsLeftRunning`), THREADS_GRACE_S later, rather than a rank that never ends.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import linecache
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..files import atomic_write
from . import rank_io, rank_pdb
from .error_record import describe_exception
from .processes import adopt_orphans, alive, end_children
from .random_state import reseed
from .rank_env import omp_threads
from .run_dirs import rank_file
from .tutorial_ranks import install_in_rank

THREADS_GRACE_S = 2.0   # how long a rank waits for the threads its function left running


@dataclasses.dataclass
class WorkerJob:
    """Everything a rank needs; built by the launcher (or the pool), pickled to each rank."""
    payload: bytes                 # cloudpickle of (fn, args, kwargs); b"" for a pool's ranks
    world_size: int
    backend: str
    init: bool                     # call init/destroy_process_group around fn
    pg_timeout_s: float            # process-group timeout for init and collectives
    run_dir: str                   # per-launch folder: pipes, results, logs
    env: dict[str, str]            # full environment for the ranks (kernel env + torchrun variables)
    launcher_pid: int
    cell_sources: dict[str, tuple]  # {filename: linecache entry} of notebook cells, for readable tracebacks
    seed: int | None = None        # None: each rank draws fresh entropy, as under torchrun; an int:
                                   # reproducible, rank-dependent seeds (random_state.reseed)


def setup_worker_process(local_rank: int, job: WorkerJob) -> int:
    """Steps 1-3 above, for `launch` and for the warm `Pool` alike. Returns the rank."""
    rank = local_rank  # one machine: global rank == local rank
    # A process this rank's code starts, and what that one starts, stay in this rank's family even
    # when the middle one exits (a daemon's double fork, `setsid`): end_children finds them.
    adopt_orphans()
    _redirect_output(rank_file(job.run_dir, rank, "stdout"), rank_file(job.run_dir, rank, "stderr"))
    os.environ.clear()
    os.environ.update(job.env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), GROUP_RANK="0", ROLE_RANK=str(rank))
    _exit_when_orphaned(job.launcher_pid)
    # `kill -USR1 <pid>` prints where every thread of this worker is: how a hang is found.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # multiprocessing gave this process the start method it came from (forkserver); a worker that
    # torchrun starts has the platform's default. Set that back, so that processes a rank starts
    # (a DataLoader's workers) start as they would there, not through a new fork server that first
    # imports torch again.
    multiprocessing.set_start_method(None, force=True)
    # torch was imported (in the forkserver) before this environment was set, so apply
    # what torch reads at import time by hand: threads, and TORCH_DISTRIBUTED_DEBUG.
    torch.set_num_threads(omp_threads(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.set_debug_level_from_env()
    linecache.cache.update(job.cell_sources)
    # Forked from the same server, every rank would draw the server's numbers: a state of its own,
    # as a process torchrun starts has (fresh entropy), or seed + rank when a seed is asked for.
    reseed(rank, job.seed)
    rank_io.setup()   # figures and display() reach the notebook; input() says there is no stdin
    rank_pdb.install()   # breakpoint() and dist.breakpoint: a pdb prompt in the notebook cell
    install_in_rank(rank_file(job.run_dir, rank, "rendezvous"))   # tutorial code's own init_process_group
    return rank


def init_process_group(backend: str, local_rank: int, timeout_s: float) -> None:
    """What the launcher does before the user's function when `init=True`."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before init, so NCCL binds this rank to its own GPU
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if backend == "gloo":
        # Gloo connects every pair of ranks inside init. Without this wait a rank with nothing
        # to do could finish and exit while a peer was still connecting to it ("connectFullMesh
        # failed ... Connection closed by peer", a few launches in a hundred).
        wait_for_every_rank(timeout_s)


STARTED_KEY = "ddp_helpers/started"   # in the default group's store (a prefix of its own)


def wait_for_every_rank(timeout_s: float) -> None:
    """Return once every rank's init_process_group has returned. It waits on the rendezvous store,
    not with a collective: a barrier here would be the first entry of the learner's Flight Recorder
    (`gloo:barrier`, a collective they never called) and shift their collectives' sequence numbers."""
    store = dist.distributed_c10d._get_default_store()
    if store.add(STARTED_KEY, 1) == dist.get_world_size():
        store.set(STARTED_KEY + "/all", "1")
    store.wait([STARTED_KEY + "/all"], timedelta(seconds=timeout_s))


def report_error(run_dir: str, rank: int, exc: BaseException) -> None:
    """Leave the exception, with its traceback, for the launcher (an `ErrorRecord` as a plain dict,
    pickled: see `error_record`)."""
    with atomic_write(rank_file(run_dir, rank, "error")) as f:
        f.write(pickle.dumps(describe_exception(exc, rank).as_dict()))


def end_worker() -> None:
    """What every worker does last: flush its output, and end the processes it started
    (`subprocess.Popen(...)` left running): nothing outlives a launch."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    end_children()


class ThreadsLeftRunning(RuntimeError):
    """The launched function returned while threads it started (not daemon threads) still ran."""

    def __init__(self, threads: list[threading.Thread]) -> None:
        names = ", ".join(repr(t.name) for t in threads)
        super().__init__(
            f"the function returned while its threads still run: {names}. The rank cannot exit until "
            f"they end; join them before returning (thread.join()), or start them with daemon=True")


def threads_left_running(grace_s: float = THREADS_GRACE_S) -> list[threading.Thread]:
    """Non-daemon threads other than the main one that are still alive `grace_s` after the call
    returned: Python would wait for them before the process may exit. As Python does at exit,
    threading's own exit hooks run first (an idle ThreadPoolExecutor's workers then leave)."""
    deadline = time.monotonic() + grace_s

    def others() -> list[threading.Thread]:
        main = threading.main_thread()
        return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]

    if others() and getattr(threading, "_threading_atexits", None):
        hooks = threading.Thread(target=_run_threading_exit_hooks, name="ddp-helpers-exit-hooks", daemon=True)
        hooks.start()
        hooks.join(max(0.0, deadline - time.monotonic()))
    for thread in others():
        thread.join(max(0.0, deadline - time.monotonic()))
    return others()


def _run_threading_exit_hooks() -> None:
    """What threading._shutdown runs before it joins the threads left (concurrent.futures' hooks:
    they tell idle executors' workers to leave). Each hook may run again at exit: they allow it."""
    for hook in reversed(list(getattr(threading, "_threading_atexits", []))):
        try:
            hook()
        except Exception:
            pass


def _redirect_output(stdout_path: str, stderr_path: str) -> None:
    """Point fds 1 and 2 at the launcher's pipes; line-buffer Python's streams."""
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fd in ((stdout_path, 1), (stderr_path, 2)):
        pipe_fd = os.open(path, os.O_WRONLY)
        os.dup2(pipe_fd, fd)
        os.close(pipe_fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def _exit_when_orphaned(launcher_pid: int, period_s: float = 0.5) -> None:
    """End this worker if the launching process (the notebook kernel) goes away.

    Two signs, checked twice a second: the launcher's PID is gone (or a zombie),
    or nobody reads our stdout pipe any more (only the launcher had it open).
    """
    poller = select.poll()
    poller.register(1, select.POLLERR)

    def watch() -> None:
        while True:
            if poller.poll(period_s * 1000) or not alive(launcher_pid):
                end_children()
                os._exit(1)

    threading.Thread(target=watch, name="ddp-helpers-watchdog", daemon=True).start()
