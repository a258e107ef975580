"""Run a function on N worker processes that form a torch.distributed process group.

    from ddp_helpers import launch
    results = launch(fn, world_size=4, backend="gloo")   # results[r] is what rank r returned

How it works, and why:
- Workers are started by `torch.multiprocessing.start_processes` with the
  *forkserver* start method. The forkserver is a fresh Python process (never a
  fork of the notebook kernel, which may have touched CUDA) that imports torch
  once; every launch then forks cheap copies of it. Spawn would import torch
  anew in every worker, which takes seconds.
- `fn` may be defined in the notebook: it travels by value, with cloudpickle.
- The launcher hosts the rendezvous store (a `TCPStore` on 127.0.0.1, on a port
  the OS picks), as torchrun's agent does, and gives each worker the
  environment torchrun would give it. No fixed port, so re-runs never clash.
- Each rank's stdout and stderr come back through a pipe and are printed
  line by line as `[rank N] ...`; a full log per rank stays in the run folder.
- Errors, crashes, hangs and the Interrupt button all end every worker and
  raise in the calling cell (`WorkerError`, `WorkerTimeout`, `KeyboardInterrupt`).
"""
import io
import itertools
import linecache
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import warnings
import types
from datetime import timedelta

import cloudpickle
import torch.distributed as dist
import torch.multiprocessing

from . import machine
from .worker import WorkerJob, _process_alive, error_file, result_file, run_worker, stderr_pipe, stdout_pipe

BACKENDS = ("gloo", "nccl", "auto")
MAX_WORLD_SIZE = 64          # one machine; past this use torchrun across nodes
STOP_GRACE_S = 2.0           # SIGTERM, then SIGKILL after this long
KEPT_RUN_DIRS = 20           # logs of the most recent finished launches kept on disk
MAX_TIMEOUT_S = 30 * 24 * 3600   # 30 days; far larger ones overflow torch's timeouts in the workers
_run_counter = itertools.count()
_run_dirs_lock = threading.Lock()
_live_run_dirs = set()       # run folders of this process still in use (a launch running, a pool up)
_fallback_roots = {}         # (temp dir, uid) -> a private root, when the usual one cannot be trusted


class WorkerError(RuntimeError):
    """A worker raised, crashed or was killed. `rank`, `exc_type`, `exc_message`,
    `remote_traceback` describe the first rank that failed; `log_dir` holds full logs."""

    def __init__(self, message, rank=None, exc_type=None, exc_message=None,
                 remote_traceback=None, log_dir=None, failures=None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.log_dir = log_dir
        self.failures = failures or {}

    def _render_traceback_(self):
        # IPython shows this instead of the launcher's own frames: the worker's traceback is what matters.
        return [f"{type(self).__name__}: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


class WorkerTimeout(WorkerError, TimeoutError):
    """Workers did not finish in time. `unfinished_ranks` lists those still running."""

    def __init__(self, message, unfinished_ranks, log_dir=None):
        super().__init__(message, log_dir=log_dir)
        self.unfinished_ranks = unfinished_ranks


def launch(fn, world_size=2, backend="gloo", args=(), kwargs=None, timeout=120,
           init=True, env=None, quiet=False):
    """Run `fn(*args, **kwargs)` on `world_size` new processes; return a list of results by rank.

    backend: "gloo" (CPU, always there), "nccl" (one CUDA GPU per rank), or
             "auto" (NCCL when there are enough GPUs, else Gloo).
    timeout: seconds until every worker is stopped and `WorkerTimeout` is raised.
    init:    call `init_process_group` before `fn` and `destroy_process_group`
             after it; with False, `fn` does it itself (e.g. to try `tcp://`).
    env:     extra environment variables for the workers (e.g. {"NCCL_DEBUG": "INFO"}).
    quiet:   do not print worker output in the cell (it still goes to the log).
    """
    world_size = check_world_size(world_size)
    backend = resolve_backend(backend, world_size)
    timeout = check_timeout(timeout)
    payload = pickle_job(fn, args, kwargs)
    extra_env = check_env(env)

    run_dir = new_run_dir()
    try:
        with Rendezvous() as store:
            job = WorkerJob(
                payload=payload, world_size=world_size, backend=backend, init=init,
                pg_timeout_s=timeout, run_dir=run_dir,
                env=worker_env(world_size, store.port, extra_env), launcher_pid=os.getpid(),
                cell_sources=notebook_cell_sources(),
            )
            return _run(job, timeout, quiet)
    finally:
        release_run_dir(run_dir)


# ---------------------------------------------------------------- input checks
def check_world_size(world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r} ({type(world_size).__name__})")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE} on one machine, got {world_size}")
    return world_size


def resolve_backend(backend, world_size):
    """Check the backend name and, for "auto", pick NCCL only if every rank gets a GPU."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(map(repr, BACKENDS))}")
    gpus = machine.gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend='nccl' is not available in this torch build; use 'gloo'")
        if gpus < world_size:
            raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} "
                             f"but this machine has {gpus} GPU(s). Use backend='gloo' or 'auto'.")
    return backend


def pickle_job(fn, args, kwargs):
    """cloudpickle fn and its arguments now, so a bad one fails before any process starts."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    bad_keys = [k for k in (kwargs or {}) if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"kwargs keys must be strings (they become keyword argument names), got {bad_keys!r}")
    for what, value in (("the function", fn), ("args", tuple(args)), ("kwargs", kwargs or {})):
        try:
            dumps(value)
        except Exception as exc:
            raise TypeError(
                f"cannot send {what} to the workers: {type(exc).__name__}: {exc}. Everything a "
                "worker needs is pickled (with cloudpickle); open files, locks, sockets, "
                "generators and live process groups cannot be. Create them inside the function."
            ) from None
    return dumps((fn, tuple(args), kwargs or {}))


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, except that code keeps its file name (cloudpickle 3 writes
    "<dynamic-code>"), so a worker's traceback can show the notebook line it points at."""

    def reducer_override(self, obj):
        reduce_code = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
        if isinstance(obj, types.CodeType) and reduce_code is not None:
            constructor, fields = reduce_code(obj)
            return constructor, tuple(obj.co_filename if f == "<dynamic-code>" else f for f in fields)
        return super().reducer_override(obj)


def dumps(obj):
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def check_timeout(timeout):
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_TIMEOUT_S):  # also rejects nan and inf
        raise ValueError(f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S} "
                         f"({MAX_TIMEOUT_S // 86400} days), got {timeout!r}")
    return float(timeout)


def check_env(env):
    env = dict(env or {})
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"env keys and values must be strings, got {bad!r}")
    return env


# ------------------------------------------------------ environment and store
def loopback_interface():
    """Name of the loopback network interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def worker_env(world_size, master_port, extra_env=None):
    """The environment each worker gets: the kernel's own, plus what torchrun sets.

    RANK, LOCAL_RANK, GROUP_RANK and ROLE_RANK differ per rank; the worker adds them.
    """
    env = dict(os.environ)
    threads = max(1, machine.cpu_count() // world_size)
    env.setdefault("OMP_NUM_THREADS", str(threads))  # torchrun would use 1; share the cores instead
    lo = loopback_interface()
    env.setdefault("GLOO_SOCKET_IFNAME", lo)   # Gloo and NCCL talk over loopback only
    env.setdefault("NCCL_SOCKET_IFNAME", lo)
    env.update({
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        # Like torchrun: workers connect to the store the launcher hosts instead of rank 0 creating one.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "ddp_helpers",
    })
    env.update(extra_env or {})
    return env


class Rendezvous:
    """A TCPStore served by this process on 127.0.0.1, on a port the OS picks.

    We bind the socket ourselves and hand it to the store: TCPStore alone would
    listen on every interface, and asking for a free port first, then binding it
    later, leaves a window in which another program can take it.
    """

    def __enter__(self):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind(("127.0.0.1", 0))
            self._sock.listen(128)
            self.port = self._sock.getsockname()[1]
            self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                                       master_listen_fd=self._sock.fileno(), timeout=timedelta(seconds=30))
        except BaseException:
            self._sock.close()
            raise
        self._sock.detach()  # the store owns the socket now and closes it when deleted
        return self

    def __exit__(self, *exc):
        del self.store  # stops the server and closes its socket: the port is free again
        return False


def notebook_cell_sources():
    """Sources of notebook cells (files that exist only in linecache), so worker
    tracebacks can show the lines of code a learner wrote in a cell."""
    return {name: entry for name, entry in list(linecache.cache.items())
            if len(entry) == 4 and ("ipykernel_" in name or name.startswith("<ipython-input"))
            and not os.path.exists(name)}


# ------------------------------------------------------------- run and watch
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    # Only takes effect when the forkserver first starts: it imports these once for all workers.
    # torch._dynamo: the first optimizer or DDP of a process imports it (over a second, in every rank);
    # torchvision's transforms: the reference trainer's. A name that fails to import is skipped.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torchvision.transforms.v2",
                                "cloudpickle", "ddp_helpers.worker", "ddp_helpers.pool"])
    return "forkserver"


def new_run_dir():
    """A new folder for one launch (or one pool's workers), in this user's private scratch root.

    Its name records the process that made it (`run-HHMMSS-<pid>-<n>-...`). It counts as live
    until `release_run_dir`; old folders are pruned (all but the newest KEPT_RUN_DIRS), but only
    released ones of this process and those of processes that are gone: never a run still going
    on here or in another notebook kernel.
    """
    with _run_dirs_lock:
        root = run_root()
        _prune(root)
        pid = os.getpid()
        path = tempfile.mkdtemp(prefix=f"run-{time.strftime('%H%M%S')}-{pid}-{next(_run_counter)}-", dir=root)
        _live_run_dirs.add(path)
        return path


def release_run_dir(path):
    """The run in `path` is over: its folder (logs) may be pruned by later launches."""
    with _run_dirs_lock:
        _live_run_dirs.discard(path)


def run_root():
    """`$TMPDIR/ddp_helpers-<uid>`, made with mode 0700, if it is a real folder of this user that
    nobody else can write to; otherwise (planted by another user, a symlink, ...) a private
    folder made for this process, with a warning. Result files in run folders are unpickled:
    nobody else may be able to put or rename anything there."""
    tmp, uid = tempfile.gettempdir(), os.getuid()
    root = os.path.join(tmp, f"ddp_helpers-{uid}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    problem = _untrusted_root(root, uid)
    if problem is None:
        return root
    fallback = _fallback_roots.get((tmp, uid))
    if fallback is None or _untrusted_root(fallback, uid) is not None:
        fallback = tempfile.mkdtemp(prefix=f"ddp_helpers-{uid}-", dir=tmp)  # new, 0700, ours
        _fallback_roots[(tmp, uid)] = fallback
        warnings.warn(f"not using {root}: {problem}; run folders go to {fallback} instead", stacklevel=3)
    return fallback


def _untrusted_root(path, uid):
    """Why `path` cannot hold run folders, or None when it can (then it is made mode 0700)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect it ({exc})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != uid:
        return f"it belongs to user id {st.st_uid}, not {uid}"
    if st.st_mode & 0o022:
        return f"other users can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    if stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(path, 0o700, follow_symlinks=False)  # e.g. 0755 from older versions: logs stay private
        except (OSError, NotImplementedError):
            pass
    return None


def _run_dir_owner(name):
    """PID recorded in a run folder's name (`run-HHMMSS-<pid>-<n>-...`), or None for other names."""
    parts = name.split("-")
    if len(parts) >= 5 and parts[0] == "run" and parts[2].isdigit() and parts[3].isdigit():
        return int(parts[2])
    return None


def _prune(root):
    """Delete all but the newest KEPT_RUN_DIRS finished run folders (caller holds _run_dirs_lock).
    Other processes prune the same root at the same time: anything may vanish meanwhile."""
    me = os.getpid()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    finished = []
    for name in names:
        path = os.path.join(root, name)
        owner = _run_dir_owner(name)
        if owner is None:
            if not name.startswith("run-"):
                continue  # not ours to delete
        elif owner == me:
            if path in _live_run_dirs:
                continue
        elif _process_alive(owner):
            continue  # another process's run: it may still be going on, and it prunes its own
        try:
            finished.append((os.lstat(path).st_mtime, path))
        except FileNotFoundError:
            continue
    finished.sort()
    for _, stale in finished[:-KEPT_RUN_DIRS]:
        shutil.rmtree(stale, ignore_errors=True)


def _run(job, timeout, quiet):
    n = job.world_size
    output = OutputPump(job.run_dir, n, quiet)
    context = None
    try:
        context = torch.multiprocessing.start_processes(
            run_worker, args=(job,), nprocs=n, join=False, start_method=forkserver())
        processes = context.processes
        failed_first = _watch(processes, output, deadline=time.monotonic() + timeout)
        if failed_first is None and any(p.exitcode is None for p in processes):
            unfinished = [r for r, p in enumerate(processes) if p.exitcode is None]
            dump_stacks(processes, unfinished, output)
            stop_processes(processes, output)
            done = [r for r in range(n) if r not in unfinished]
            where = "in the logs" if quiet else "printed above"
            raise WorkerTimeout(
                f"timed out after {timeout:g} s: rank(s) {unfinished} had not finished "
                f"(finished: {done or 'none'}). A rank waiting in a collective for a rank that "
                f"never calls it waits forever; their stacks are {where}. Logs: {job.run_dir}",
                unfinished_ranks=unfinished, log_dir=job.run_dir)
        stop_processes(processes, output)  # the rest, after a failure
        if failed_first is not None:
            raise _failure_error(job.run_dir, processes, failed_first)
        silent = [r for r in range(n) if not os.path.exists(result_file(job.run_dir, r))]
        if silent:  # exit code 0 but no value: sys.exit(0) or os._exit(0) inside fn
            raise WorkerError(f"rank {silent[0]} exited with code 0 before returning a value "
                              f"(sys.exit or os._exit inside the function?). Logs: {job.run_dir}",
                              rank=silent[0], log_dir=job.run_dir)
        return [_read_result(job.run_dir, r) for r in range(n)]
    finally:
        if context is not None:
            stop_processes(context.processes, output)  # KeyboardInterrupt lands here too
        output.close()
        remove_scratch(job.run_dir, n)


def _watch(processes, output, deadline):
    """Pump output until all ranks exit, one fails (return its rank), or the deadline passes."""
    while True:
        running = [p for p in processes if p.exitcode is None]
        for rank, p in enumerate(processes):
            if p.exitcode not in (None, 0):
                return rank
        if not running:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready = multiprocessing.connection.wait(
            output.fds() + [p.sentinel for p in running], timeout=min(left, 1.0))
        output.read(ready)


def stop_processes(processes, output):
    """SIGTERM every live worker, SIGKILL what is left after STOP_GRACE_S, reap all."""
    for p in processes:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
        live = [p.sentinel for p in processes if p.exitcode is None]
        output.read(multiprocessing.connection.wait(output.fds() + live, timeout=0.05))
    for p in processes:
        if p.exitcode is None:
            p.kill()
        p.join()
    output.read(output.fds())  # whatever the workers wrote last


def dump_stacks(processes, ranks, output, wait_s=0.5):
    """Ask the stuck ranks where they are (faulthandler on SIGUSR1) and print it."""
    for r in ranks:
        try:
            os.kill(processes[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        output.read(multiprocessing.connection.wait(output.fds(), timeout=0.05))


def _failure_error(run_dir, processes, first):
    failures = {r: _describe_exit(run_dir, r, p.exitcode) for r, p in enumerate(processes)
                if p.exitcode not in (0, None)}
    others = sorted(r for r in failures if r != first)
    note = f"other ranks then stopped: {others}" if others else ""
    record = _read_error(run_dir, first)
    if record:
        return error_from_record(first, record, run_dir, note, failures)
    tail = f"\n({note})" if note else ""
    return WorkerError(f"rank {first} {failures[first]}. Full logs: {run_dir}{tail}",
                       rank=first, log_dir=run_dir, failures=failures)


def error_from_record(rank, record, run_dir, note="", failures=None):
    """WorkerError for a rank that raised, from the record `describe_exception` made there."""
    tail = f"\n({note})" if note else ""
    message = (f"rank {rank} raised {record['type']}: {record['message']}\n\n"
               f"--- traceback from rank {rank} ---\n{record['traceback']}"
               f"full logs: {run_dir}{tail}")
    return WorkerError(message, rank=rank, exc_type=record["type"], exc_message=record["message"],
                       remote_traceback=record["traceback"], log_dir=run_dir, failures=failures)


def describe_exit(exitcode):
    """'was killed by signal SIGSEGV', 'exited with code 3 ...' for a worker's exit code."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (often the out-of-memory killer, or the launcher stopping it)" if name == "SIGKILL" else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {exitcode} without a Python exception"


def _describe_exit(run_dir, rank, exitcode):
    record = _read_error(run_dir, rank)
    if record:
        return f"raised {record['type']}: {record['message']}"
    return describe_exit(exitcode)


def _read_error(run_dir, rank):
    try:
        with open(error_file(run_dir, rank), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def _read_result(run_dir, rank):
    with open(result_file(run_dir, rank), "rb") as f:
        return pickle.load(f)


def remove_scratch(run_dir, n):
    """Remove pipes and result files; keep the logs."""
    for r in range(n):
        for path in (stdout_pipe(run_dir, r), stderr_pipe(run_dir, r),
                     result_file(run_dir, r), error_file(run_dir, r)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class OutputPump:
    """Reads each rank's stdout/stderr pipe and prints whole lines as `[rank N] ...`.

    Named pipes (FIFOs) in the run folder: the workers open them by name, so no
    file descriptor has to travel through the forkserver. Partial lines wait
    for their end, so lines of different ranks never mix.
    """

    def __init__(self, run_dir, world_size, quiet):
        self.quiet = quiet
        self.streams = {}   # fd -> (rank, destination name, partial line bytes)
        self.logs = {}
        for rank in range(world_size):
            self.logs[rank] = open(os.path.join(run_dir, f"rank{rank}.log"), "ab")
            for path, dest in ((stdout_pipe(run_dir, rank), "stdout"), (stderr_pipe(run_dir, rank), "stderr")):
                os.mkfifo(path, 0o600)
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                self.streams[fd] = [rank, dest, b""]

    def fds(self):
        return list(self.streams)

    def read(self, ready):
        """Read what is waiting on the given fds; return the number of bytes read."""
        total = 0
        for fd in ready:
            if fd not in self.streams:
                continue
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            total += len(data)
            stream = self.streams[fd]
            if not data:  # the worker closed its end (it exited)
                if stream[2]:
                    self._emit(stream[0], stream[1], stream[2])
                os.close(fd)
                del self.streams[fd]
                continue
            *lines, stream[2] = (stream[2] + data).split(b"\n")
            for line in lines:
                self._emit(stream[0], stream[1], line)
        return total

    def drain(self):
        """Print everything the workers have written so far."""
        while self.read(self.fds()):
            pass

    def _emit(self, rank, dest, line):
        self.logs[rank].write(line + b"\n")
        self.logs[rank].flush()
        if not self.quiet:
            out = sys.stdout if dest == "stdout" else sys.stderr
            out.write(f"[rank {rank}] {line.decode('utf-8', 'replace')}\n")
            out.flush()

    def close(self):
        for fd, (rank, dest, partial) in self.streams.items():
            if partial:
                self._emit(rank, dest, partial)
            os.close(fd)
        self.streams.clear()
        for log in self.logs.values():
            log.close()
