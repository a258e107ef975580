"""Warm workers: ranks that stay up between cells, with the process group formed once.

    pool = Pool(world_size=4)                   # in a notebook: %ddp start -n 4
    pool.run_cell("x = torch.ones(1) * rank")   # %%ddp cells then run here
    pool.run_cell("dist.all_reduce(x); x")      # each rank still has its x
    pool.push(lr=0.1); pool.pull("x")           # values in and out
    pool.stop()                                 # %ddp stop

Like ipyparallel's engines, but already joined in a torch.distributed process
group. Workers start exactly as `launch` starts them (forkserver, store in the
kernel, output as `[rank N] ...`); each then waits for requests on a pipe.

If a cell is interrupted, times out, or leaves ranks stuck after another rank
raised, a collective may have been cut half-way and the group cannot be
trusted: the workers are stopped and the next cell starts fresh ones (you are
told that the ranks' variables were reset). A worker that dies is reported the
same way.
"""
import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time

import cloudpickle
import torch.distributed as dist
import torch.multiprocessing

from .cells import PerRank, globals_to_send
from .launcher import (OutputPump, Rendezvous, WorkerError, WorkerTimeout, check_env, check_timeout,
                       check_world_size, describe_exit, dump_stacks, dumps, error_from_record,
                       forkserver, new_run_dir, notebook_cell_sources, release_run_dir,
                       remove_scratch, resolve_backend, stop_processes, worker_env)
from .worker import (WorkerJob, describe_exception, exec_cell, init_process_group, rank_namespace,
                     setup_worker_process, to_cpu)

PG_TIMEOUT_S = 600       # collectives inside a cell; cells have their own timeout
STUCK_AFTER_ERROR_S = 2  # after a rank raises, how long the others may take to finish


class Pool:
    """`world_size` warm ranks on this machine. See the module docstring."""

    def __init__(self, world_size=2, backend="gloo", env=None, start_timeout=60):
        self.world_size = check_world_size(world_size)
        self.backend = resolve_backend(backend, self.world_size)
        self.env = check_env(env)
        self.start_timeout = check_timeout(start_timeout)
        self._procs = None           # None: not running (never started, stopped or discarded)
        self._stopped = False
        self._start()
        atexit.register(self.stop)

    # ------------------------------------------------------------ public API
    def run_cell(self, source, user_ns=None, filename="<ddp-cell>", timeout=120):
        """Run `source` on every rank, in that rank's namespace; return each rank's
        value of the last expression (None when the cell ends in a statement)."""
        sent = globals_to_send(source, user_ns or {})
        values = self._request(("exec", source, sent, filename), timeout)
        return None if all(v is None for v in values) else PerRank(values)

    def run(self, fn, *args, timeout=120, **kwargs):
        """Call `fn(*args, **kwargs)` on every rank; return the results by rank."""
        return self._request(("call", fn, args, kwargs), timeout)

    def push(self, **values):
        """Set variables in every rank's namespace."""
        self._request(("push", values), timeout=60)

    def pull(self, name):
        """Each rank's value of the variable `name`."""
        return PerRank(self._request(("pull", name), timeout=60))

    def status(self):
        """Each rank's PID, state ("idle", "dead", "stopped") and resident memory in MiB."""
        if self._procs is None:
            return [{"rank": r, "pid": None, "state": "stopped", "memory_mib": None}
                    for r in range(self.world_size)]
        return [{"rank": r, "pid": p.pid, "state": "idle" if p.exitcode is None else "dead",
                 "memory_mib": _resident_mib(p.pid) if p.exitcode is None else None}
                for r, p in enumerate(self._procs)]

    def stop(self):
        """End the workers; the pool cannot be used afterwards."""
        self._stopped = True
        if self._procs is not None:
            for conn, p in zip(self._conns, self._procs):
                if p.exitcode is None:
                    try:
                        conn.send_bytes(dumps(("stop",)))
                    except OSError:
                        pass
            _wait_all(self._procs, seconds=2)
            self._discard()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def __repr__(self):
        state = "stopped" if self._stopped else "running" if self._procs else "restarts on next use"
        return f"Pool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # ------------------------------------------------------------ internals
    def _start(self):
        n = self.world_size
        self.run_dir = new_run_dir()   # live (never pruned) until _discard releases it
        try:
            self._rendezvous = Rendezvous().__enter__()
        except BaseException:
            release_run_dir(self.run_dir)
            raise
        try:
            self._output = OutputPump(self.run_dir, n, quiet=False)
        except BaseException:
            self._rendezvous.__exit__(None, None, None)
            release_run_dir(self.run_dir)
            raise
        pipes = [multiprocessing.Pipe() for _ in range(n)]
        job = WorkerJob(payload=b"", world_size=n, backend=self.backend, init=True,
                        pg_timeout_s=PG_TIMEOUT_S, run_dir=self.run_dir,
                        env=worker_env(n, self._rendezvous.port, self.env),
                        launcher_pid=os.getpid(), cell_sources=notebook_cell_sources())
        self._conns = [mine for mine, _ in pipes]
        try:
            context = torch.multiprocessing.start_processes(
                serve, args=(job, [theirs for _, theirs in pipes]), nprocs=n, join=False,
                start_method=forkserver())
            self._procs = context.processes
        except BaseException:
            self._discard()
            raise
        finally:
            for _, theirs in pipes:
                theirs.close()
        self._collect(self.start_timeout, what="start")  # each rank says ready once its group is formed

    def _request(self, request, timeout):
        if self._stopped:
            raise RuntimeError("this pool was stopped; start a new one (%ddp start)")
        if self._procs is None:
            self._start()
            print(f"ddp pool: started {self.world_size} new ranks ({self.backend}); their variables are empty.",
                  file=sys.stderr)
        timeout = check_timeout(timeout)
        payload = dumps(request)
        for conn in self._conns:
            conn.send_bytes(payload)
        return self._collect(timeout, what="cell")

    def _collect(self, timeout, what):
        """Wait for one reply per rank, printing output meanwhile; raise on any failure."""
        pending = dict(enumerate(self._conns))
        replies, deadline, error_seen_at = {}, time.monotonic() + timeout, None
        try:
            while pending:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    self._output.drain()
                    how = "; ".join(f"rank {r} {describe_exit(self._procs[r].exitcode)}" for r in dead)
                    self._discard()
                    raise WorkerError(f"{how}. The pool was stopped and starts again on the next cell, "
                                      f"with empty variables. Logs: {self.run_dir}", rank=dead[0])
                now = time.monotonic()
                if now > deadline:
                    self._give_up_timeout(sorted(pending), timeout)
                if error_seen_at is not None and now - error_seen_at > STUCK_AFTER_ERROR_S:
                    self._give_up_stuck(replies, sorted(pending))
                ready = multiprocessing.connection.wait(
                    list(pending.values()) + self._output.fds() + [p.sentinel for p in self._procs],
                    timeout=min(0.5, max(0.0, deadline - now)))
                self._output.read([fd for fd in ready if isinstance(fd, int)])
                for rank, conn in list(pending.items()):
                    if conn in ready:
                        try:
                            replies[rank] = conn.recv()
                        except EOFError:
                            continue  # it died: reported at the top of the loop
                        del pending[rank]
                        if replies[rank][0] == "error" and error_seen_at is None:
                            error_seen_at = time.monotonic()
        except KeyboardInterrupt:
            self._output.drain()
            self._discard()
            print("ddp pool: interrupted. A collective may have been cut half-way, so the ranks were "
                  "stopped; the next cell starts fresh ones (their variables are reset).", file=sys.stderr)
            raise
        self._output.drain()
        errors = sorted(r for r, (kind, _) in replies.items() if kind == "error")
        if errors:
            if what == "start":
                self._discard()
            first = errors[0]
            note = f"ranks {errors[1:]} raised too" if len(errors) > 1 else ""
            raise error_from_record(first, replies[first][1], self.run_dir, note)
        return [cloudpickle.loads(replies[r][1]) for r in range(self.world_size)]

    def _give_up_timeout(self, unfinished, timeout):
        dump_stacks(self._procs, unfinished, self._output)
        self._discard()
        raise WorkerTimeout(
            f"timed out after {timeout:g} s: rank(s) {unfinished} had not finished; their stacks are "
            "printed above. The ranks were stopped; the next cell starts fresh ones (variables reset).",
            unfinished_ranks=unfinished, log_dir=self.run_dir)

    def _give_up_stuck(self, replies, stuck):
        first = min(r for r, (kind, _) in replies.items() if kind == "error")
        record = replies[first][1]
        self._discard()
        raise error_from_record(
            first, record, self.run_dir,
            note=f"rank(s) {stuck} were still running {STUCK_AFTER_ERROR_S} s later, probably waiting for "
                 f"rank {first} in a collective, so the ranks were stopped; the next cell starts fresh "
                 "ones (variables reset)")

    def _discard(self):
        """Stop every worker now and free the port; the next request starts new ones."""
        if self._procs is not None:
            stop_processes(self._procs, self._output)
        for conn in getattr(self, "_conns", []):
            conn.close()
        self._output.close()
        self._rendezvous.__exit__(None, None, None)
        remove_scratch(self.run_dir, self.world_size)
        release_run_dir(self.run_dir)
        self._procs, self._conns = None, []


def _wait_all(processes, seconds):
    end = time.monotonic() + seconds
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))


def _resident_mib(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- worker side
def serve(local_rank, job, connections):
    """Target of `start_processes` for a pool worker: form the group, then answer requests."""
    rank = setup_worker_process(local_rank, job)
    conn = connections[rank]
    for other in connections:
        if other is not conn:
            other.close()
    # Idle workers ignore Ctrl-C / Jupyter's Interrupt (sent to the kernel's whole process
    # group); only a running cell may be interrupted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        init_process_group(job.backend, local_rank, job.pg_timeout_s)
        conn.send(("ok", dumps(None)))
    except BaseException as exc:
        conn.send(("error", describe_exception(exc)))
        return
    state = _RankState()
    while True:
        try:
            request = cloudpickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if request[0] == "stop":
            break
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            reply = ("ok", dumps(to_cpu(state.handle(request))))
        except BaseException as exc:
            reply = ("error", describe_exception(exc))
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            sys.stdout.flush()
            sys.stderr.flush()
        conn.send(reply)
    if dist.is_initialized():
        dist.destroy_process_group()


class _RankState:
    """One rank's namespace, kept between cells."""

    def __init__(self):
        self.namespace = rank_namespace()
        self.from_kernel = {}  # name -> the object the kernel last sent for it

    def handle(self, request):
        kind = request[0]
        if kind == "exec":
            _, source, sent, filename = request
            self._take_from_kernel(sent)
            return exec_cell(source, self.namespace, filename)
        if kind == "call":
            _, fn, args, kwargs = request
            return fn(*args, **kwargs)
        if kind == "push":
            self.namespace.update(request[1])
            return None
        if kind == "pull":
            name = request[1]
            if name not in self.namespace:
                raise NameError(f"rank {dist.get_rank()} has no variable {name!r}")
            return self.namespace[name]
        raise ValueError(f"unknown request {kind!r}")

    def _take_from_kernel(self, sent):
        """Notebook variables a cell uses fill in names the rank has not set itself:
        a rank's own variables are never overwritten by the kernel's."""
        for name, value in sent.items():
            current = self.namespace.get(name, _MISSING)
            if current is _MISSING or current is self.from_kernel.get(name, _MISSING):
                self.namespace[name] = value
                self.from_kernel[name] = value


_MISSING = object()
