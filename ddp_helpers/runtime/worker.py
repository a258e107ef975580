"""What runs inside each worker process that `launch` starts.

`run_worker(local_rank, job)` is the target handed to
`torch.multiprocessing.start_processes`. In order, it:

1. sends this process's stdout and stderr (file descriptors 1 and 2, so C++
   output from Gloo/NCCL too) into a pipe that the launcher reads line by line;
2. sets the environment torchrun would set (RANK, WORLD_SIZE, MASTER_PORT, ...), and gives
   the process a random state of its own (`random_state.reseed`), as a fresh process has;
3. starts a watchdog that ends this worker if the launching process dies;
4. optionally calls `init_process_group`, runs the user's function, and
   calls `destroy_process_group`;
5. writes the return value, or the exception with its traceback, to a file in
   the run folder for the launcher to read: an error in steps 1-3 too. A function
   that returns while threads it started still run (not daemon threads: Python
   waits for those before the process may exit) is an error that names them
   (ThreadsLeftRunning), THREADS_GRACE_S later, rather than a rank that never ends;
6. ends any process the function started and left running (the rank adopts the orphans of its
   family, so a daemon that double-forked and left its session is among them).

A warm pool's workers run `serve.serve` instead, which shares steps 1-3 and 6.
"""
import ast
import dataclasses
import faulthandler
import io
import linecache
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
import tokenize
import traceback
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from .. import tutorials
from ..files import atomic_write
from . import PACKAGE_DIR, rank_io, rank_pdb
from .processes import adopt_orphans, alive, end_children
from .random_state import reseed
from .run_dirs import rank_file


THREADS_GRACE_S = 2.0   # how long a rank waits for the threads its function left running


@dataclasses.dataclass
class WorkerJob:
    """Everything a worker needs; built by the launcher, pickled to each worker."""
    payload: bytes            # cloudpickle of (fn, args, kwargs)
    world_size: int
    backend: str
    init: bool                # call init/destroy_process_group around fn
    pg_timeout_s: float       # process-group timeout for init and collectives
    run_dir: str              # per-launch folder: pipes, results, logs
    env: dict                 # full environment for the workers (kernel env + torchrun variables)
    launcher_pid: int
    cell_sources: dict        # {filename: lines} of notebook cells, for readable tracebacks
    seed: int | None = None   # None: each rank draws fresh entropy, as under torchrun; an int:
                              # reproducible, rank-dependent seeds (random_state.reseed)


def run_worker(local_rank, job):
    """Target of `torch.multiprocessing.start_processes` for `launch`: one call of the job's function."""
    rank = local_rank  # one machine: global rank == local rank
    try:
        setup_worker_process(local_rank, job)
        fn, args, kwargs = cloudpickle.loads(job.payload)
        if job.init:
            init_process_group(job.backend, local_rank, job.pg_timeout_s)
        else:
            joined = _note_joining()
        result = fn(*args, **kwargs)
        left = threads_left_running()
        if left:   # Python would wait for them before this process may exit: forever, maybe
            report_error(job.run_dir, rank, ThreadsLeftRunning(left))
            end_worker()
            os._exit(1)
        if job.init and dist.is_initialized():
            dist.destroy_process_group()
        if not job.init and not joined:
            open(rank_file(job.run_dir, rank, "nogroup"), "w").close()
        with atomic_write(rank_file(job.run_dir, rank, "result")) as f:
            f.write(cloudpickle.dumps(to_cpu(result)))
    except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the launcher must hear of them
        report_error(job.run_dir, rank, exc)
        if threads_left_running(grace_s=0):   # Python would wait for them before exiting
            end_worker()
            os._exit(1)
        sys.exit(1)
    finally:
        end_worker()


class ThreadsLeftRunning(RuntimeError):
    """The launched function returned while threads it started (not daemon threads) still ran."""

    def __init__(self, threads):
        names = ", ".join(repr(t.name) for t in threads)
        super().__init__(
            f"the function returned while its threads still run: {names}. The rank cannot exit until "
            f"they end; join them before returning (thread.join()), or start them with daemon=True")


def threads_left_running(grace_s=THREADS_GRACE_S):
    """Non-daemon threads other than the main one that are still alive `grace_s` after the call
    returned: Python would wait for them before the process may exit. As Python does at exit,
    threading's own exit hooks run first (an idle ThreadPoolExecutor's workers then leave)."""
    deadline = time.monotonic() + grace_s

    def others():
        main = threading.main_thread()
        return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]

    if others() and getattr(threading, "_threading_atexits", None):
        hooks = threading.Thread(target=_run_threading_exit_hooks, name="ddp-helpers-exit-hooks", daemon=True)
        hooks.start()
        hooks.join(max(0.0, deadline - time.monotonic()))
    for thread in others():
        thread.join(max(0.0, deadline - time.monotonic()))
    return others()


def _run_threading_exit_hooks():
    """What threading._shutdown runs before it joins the threads left (concurrent.futures' hooks:
    they tell idle executors' workers to leave). Each hook may run again at exit: they allow it."""
    for hook in reversed(list(getattr(threading, "_threading_atexits", []))):
        try:
            hook()
        except Exception:
            pass


def report_error(run_dir, rank, exc):
    """Leave the exception, with its traceback, for the launcher (and in this rank's log)."""
    with atomic_write(rank_file(run_dir, rank, "error")) as f:
        f.write(pickle.dumps(describe_exception(exc)))


def end_worker():
    """What every worker does last: flush its output, and end the processes it started
    (`subprocess.Popen(...)` left running): nothing outlives a launch."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    end_children()


def setup_worker_process(local_rank, job):
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
    tutorials.install_in_rank(rank_file(job.run_dir, rank, "rendezvous"))
    return rank


def omp_threads(value):
    """The threads a rank uses, from OMP_NUM_THREADS: a positive whole number, or one per level
    of nested parallelism ("4,2", OpenMP's syntax), of which the first applies here."""
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a positive whole number of threads per rank "
                         "(set it in the notebook's environment or in launch's env=)")
    return int(first)


def _note_joining():
    """For init=False: a list that gets an entry when the function forms a process group (it may
    destroy it again before it returns, which leaves no other trace). Where this torch has no
    `_update_default_pg` to watch, the list says "joined": nobody is blamed for leaving early."""
    c10d = dist.distributed_c10d
    real = getattr(c10d, "_update_default_pg", None)
    if real is None:
        return [True]
    joined = []

    def update_default_pg(pg):
        if pg is not None:
            joined.append(True)
        return real(pg)

    c10d._update_default_pg = update_default_pg
    return joined


def rank_namespace():
    """What a `%%ddp` cell's namespace starts with on every rank. The cell runs as a script's top
    level under torchrun: `__name__` is "__main__", so a pasted script's `if __name__ == "__main__":`
    block runs, and sys.argv holds no arguments (the kernel's own, `-f kernel.json`, would reach the
    script's argparse)."""
    del sys.argv[1:]
    initialised = dist.is_initialized()
    return {"__name__": "__main__", "torch": torch, "dist": dist,
            "rank": dist.get_rank() if initialised else 0,
            "world_size": dist.get_world_size() if initialised else 1,
            "display": rank_io.display}


def exec_cell(source, namespace, filename):
    """Execute a cell like IPython does: the last bare expression is evaluated and returned (a
    `rank_io.Shown` when it has a richer view than text), and the figures left open are shown."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:   # kept in the cell's own code, so that pdb steps onto it as onto any line
        tree.body[-1] = ast.copy_location(ast.Assign([ast.Name(_LAST_VALUE, ast.Store())], last.value), last)
        ast.fix_missing_locations(tree)
    try:
        exec(compile(tree, filename, "exec"), namespace)
        if last is None:
            return None
        value = namespace.pop(_LAST_VALUE)
        if _ends_with_semicolon(source):   # as in IPython: a trailing `;` hides the value
            return None
        return rank_io.last_value(to_cpu(value))
    finally:
        rank_io.show_figures()


_LAST_VALUE = "_ddp_helpers_last_value"


def _ends_with_semicolon(source):
    """Whether the cell's last token (comments and blank lines aside) is `;`."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER,
                                    tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, SyntaxError):
        return False
    return bool(tokens) and tokens[-1].string == ";"


def run_cell(source, sent_globals, filename):
    """`%%ddp` without a pool: run the cell once, in a fresh namespace, on this rank."""
    namespace = rank_namespace()
    namespace.update(sent_globals)
    return exec_cell(source, namespace, filename)


def init_process_group(backend, local_rank, timeout_s):
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


def wait_for_every_rank(timeout_s):
    """Return once every rank's init_process_group has returned. It waits on the rendezvous store,
    not with a collective: a barrier here would be the first entry of the learner's Flight Recorder
    (`gloo:barrier`, a collective they never called) and shift their collectives' sequence numbers."""
    store = dist.distributed_c10d._get_default_store()
    if store.add(STARTED_KEY, 1) == dist.get_world_size():
        store.set(STARTED_KEY + "/all", "1")
    store.wait([STARTED_KEY + "/all"], timedelta(seconds=timeout_s))


def describe_exception(exc):
    """A plain, always-picklable record of an exception and its traceback (even when the
    exception's own str() fails)."""
    try:
        message = str(exc)
    except Exception as err:
        message = f"<str() of this {type(exc).__name__} failed: {type(err).__name__}>"
    try:
        text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
    except Exception:
        text = "".join(traceback.format_tb(_user_frames(exc.__traceback__))) + f"{type(exc).__qualname__}: {message}\n"
    # Exact str copies: a str subclass (a learner's, with a __reduce__) would run code in the kernel
    # when the launcher unpickles this record.
    return {"type": _exact_str(type(exc).__qualname__), "module": _exact_str(type(exc).__module__),
            "message": _exact_str(message), "traceback": _exact_str(text)}


def _exact_str(value):
    return str.__str__(value) if isinstance(value, str) else f"<not a str: {type(value).__name__}>"


def _user_frames(tb):
    """Skip the frames of ddp_helpers' own plumbing at the top of a traceback."""
    first = tb
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        tb = tb.tb_next
    return tb or first


def to_cpu(value):
    """Move tensors in (nested) lists, tuples and dicts to the CPU, so that
    reading results never initialises CUDA in the notebook kernel."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def _redirect_output(stdout_path, stderr_path):
    """Point fds 1 and 2 at the launcher's pipes; line-buffer Python's streams."""
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fd in ((stdout_path, 1), (stderr_path, 2)):
        pipe_fd = os.open(path, os.O_WRONLY)
        os.dup2(pipe_fd, fd)
        os.close(pipe_fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def _exit_when_orphaned(launcher_pid, period_s=0.5):
    """End this worker if the launching process (the notebook kernel) goes away.

    Two signs, checked twice a second: the launcher's PID is gone (or a zombie),
    or nobody reads our stdout pipe any more (only the launcher had it open).
    """
    poller = select.poll()
    poller.register(1, select.POLLERR)

    def watch():
        while True:
            if poller.poll(period_s * 1000) or not alive(launcher_pid):
                end_children()
                os._exit(1)

    threading.Thread(target=watch, name="ddp-helpers-watchdog", daemon=True).start()
