"""Warm workers: ranks that stay up between cells, with the process group formed once.

    pool = Pool(world_size=4)                   # in a notebook: %ddp start -n 4
    pool.run_cell("x = torch.ones(1) * rank")   # %%ddp cells then run here
    pool.run_cell("dist.all_reduce(x); x")      # each rank still has its x
    pool.push(lr=0.1); pool.pull("x")           # values in and out
    pool.stop()                                 # %ddp stop

Like ipyparallel's engines, but already joined in a torch.distributed process
group. Workers start exactly as `launch` starts them (the same `Supervisor`:
forkserver, a store of its own in the ranks' private network, output as `[rank N] ...`); each then runs
`runtime.serve.serve`, which waits for requests (`runtime.protocol`) on a pipe.

If a cell is interrupted, times out, leaves ranks stuck after another rank
raised, or destroys the process group, a collective may have been cut half-way
and the group cannot be trusted: the workers are stopped and the next cell
starts fresh ones (you are told that the ranks' variables were reset). A worker
that dies, even while idle, is reported the same way.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any, Literal, NoReturn

import cloudpickle
import psutil

from . import gpu_leases
from .launch_checks import check_env, check_gpu_wait, check_seed, check_timeout, check_world_size, resolve_backend
from .launch_errors import WorkerError, error_from_record, timeout_error
from .runtime.cells import PerRank, dumps, dumps_with_sources, globals_to_send
from .runtime.debug_session import NO_ONE, answering
from .runtime.error_record import ErrorRecord
from .runtime.protocol import Call, Debug, Exec, Pull, Push, Reply, Request, Stop
from .runtime.rank_setup import WorkerJob
from .runtime.serve import serve
from .runtime.stacks import stacks_of
from .runtime.supervisor import Supervisor, describe_exit, interrupted

PG_TIMEOUT_S = 600       # collectives inside a cell; cells have their own timeout
STUCK_AFTER_ERROR_S = 5  # after a rank raises, how long the others may take to finish
RESET = "the next cell starts fresh ones (their variables are reset)"


class Pool:
    """`world_size` warm ranks on this machine. See the module docstring."""

    def __init__(self, world_size: int = 2, backend: str = "gloo", env: dict[str, str] | None = None,
                 start_timeout: float = 60, seed: int | None = None, gpu_wait: float | None = None) -> None:
        """seed: the ranks' random state as they start (and start again after a reset): None, fresh
        entropy in each rank; a whole number, rank r seeded with seed + r (see `launch`).
        gpu_wait: as in `launch`; NCCL ranks' GPUs are leased until `stop()`, restarts included."""
        self.world_size = check_world_size(world_size)
        self.backend = resolve_backend(backend, self.world_size, env)
        self.env = check_env(env)
        self.start_timeout = check_timeout(start_timeout)
        self.seed = check_seed(seed)
        self._ranks: Supervisor | None = None   # while running; None: stopped or discarded
        self._conns: list[Connection] = []
        self._stopped = False
        self.run_dir: str = ""              # the ranks' run folder, once they started
        self.port: int | None = None
        self.failed_ranks: list[int] = []   # the ranks where the last cell (or run) raised: `debug`
        self._errors: list[int] = []
        self._failed_gone = False
        self._broken = False         # some ranks were stopped after an error; the others stay for `debug`
        self._stuck: list[int] = []  # those stopped
        self.backend, self.lease = gpu_leases.for_ranks(self.backend, backend, self.world_size,
                                                        check_gpu_wait(gpu_wait), self.env, "a warm pool")
        self.env = {**self.env, **self.lease.env}
        try:
            self._start()
        except BaseException:
            self.lease.release()
            raise
        atexit.register(self.stop)

    # ------------------------------------------------------------ public API
    def run_cell(self, source: str, user_ns: dict | None = None, filename: str = "<ddp-cell>",
                 timeout: float = 120, ranks: Iterable[int] | None = None,
                 seed: int | None = None) -> PerRank | None:
        """Run `source` on every rank (or on `ranks` only), in that rank's namespace; return each
        rank's value of the last expression (None when the cell ends in a statement everywhere).

        On some ranks only, a collective (or a send/recv) that needs another rank raises
        `runtime.rank_io.CollectiveOutsideRanks` in the rank that calls it, before it starts: those ranks
        would never join. The pool stays as it was.

        seed: None keeps each rank's random state as the earlier cells left it; a whole number
        reseeds rank r with seed + r first (torch, NumPy, `random`), so the cell draws the same
        numbers each time it runs (`%%ddp --seed N`)."""
        seed = check_seed(seed)
        ranks = self.check_ranks(ranks)
        sent = globals_to_send(source, user_ns or {})
        only = None if ranks == list(range(self.world_size)) else ranks
        if only is not None and self._ranks is not None and not self._sees_collectives:
            _notice(f"this torch does not show the ranks their collectives: one in a cell on ranks {ranks} "
                    f"would wait until the timeout ({timeout:g} s).")
        values = self._cell(Exec(source, sent, filename, only, seed=seed), timeout, ranks)
        return PerRank.of(values, ranks)

    def check_ranks(self, ranks: Iterable[int] | None) -> list[int]:
        """`ranks` as a list (None: every rank); a ValueError for an empty list, a repeated rank or
        one that is not in this pool."""
        if ranks is None:
            return list(range(self.world_size))
        ranks = list(ranks)
        if not ranks:
            raise ValueError("no ranks given")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"rank {next(r for r in ranks if ranks.count(r) > 1)} is given twice: {ranks}")
        bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"rank {bad[0]!r} is not in this pool of {self.world_size} ranks "
                             f"(0 to {self.world_size - 1})" if self.world_size > 2 else
                             f"rank {bad[0]!r} is not in this pool of {self.world_size} ranks "
                             f"({' or '.join(map(str, range(self.world_size)))})")
        return ranks

    def run(self, fn: Callable, *args: Any, timeout: float = 120, seed: int | None = None, **kwargs: Any) -> list:
        """Call `fn(*args, **kwargs)` on every rank; return the results by rank. `timeout` and `seed`
        are the pool's own (as in `run_cell`), not passed to `fn`."""
        seed = check_seed(seed)
        return self._cell(Call(fn, args, kwargs, seed=seed), timeout)

    def debug(self, rank: int | None = None, timeout: float = 120) -> None:
        """pdb in `rank`, in the traceback of the last cell (or `run`) where it raised, at the frame
        of the learner's code that raised (None: the lowest rank that raised). Its prompts are
        answered in the kernel (`runtime.debug_session`); the rank stays up, with its variables.
        A ValueError, before anything is sent, when that rank did not raise in the last cell."""
        if not self.failed_ranks:
            why = ("the ranks were stopped after it raised (their variables are gone)" if self._failed_gone
                   else "no rank raised in the last cell")
            raise ValueError(f"nothing to debug: {why}")
        if rank is None:
            rank = self.failed_ranks[0]
        if rank not in self.failed_ranks:
            self.check_ranks([rank])
            raise ValueError(f"rank {rank} did not raise in the last cell (rank(s) {self.failed_ranks} did)")
        self._request(Debug(), timeout, ranks=[rank])

    def push(self, **values: Any) -> None:
        """Set variables in every rank's namespace. A value that cannot travel (a lock, an open
        file, a generator) is a TypeError naming it, and nothing is sent."""
        self._request(Push(values), timeout=60)

    def pull(self, name: str) -> PerRank:
        """Each rank's value of the variable `name`."""
        return PerRank(self._request(Pull(name), timeout=60))

    def status(self) -> list[dict]:
        """Each rank's PID, state ("idle", "dead", "stopped") and resident memory in MiB."""
        if self._ranks is None:
            return [{"rank": r, "pid": None, "state": "stopped", "memory_mib": None}
                    for r in range(self.world_size)]
        return [{"rank": r, "pid": p.pid, "state": "idle" if p.exitcode is None else "dead",
                 "memory_mib": _resident_mib(p.pid) if p.exitcode is None else None}
                for r, p in enumerate(self._ranks.processes)]

    def stop(self) -> None:
        """End the workers; the pool cannot be used afterwards."""
        self._stopped = True
        if self._ranks is not None:
            for conn in self._conns:
                try:
                    conn.send_bytes(_message(Stop()))
                except OSError:
                    pass
            self._ranks.wait_for_exits(time.monotonic() + 2)   # they leave the group themselves
            self._discard()
        self.lease.release()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.stop()
        return False

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running" if self._ranks else "restarts on next use"
        return f"Pool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # ------------------------------------------------------------ internals
    def _cell(self, request: Request, timeout: float, ranks: list[int] | None = None) -> list:
        """A cell or a call: which ranks raised in it is kept for `debug`."""
        self.failed_ranks, self._errors, self._failed_gone = [], [], False
        try:
            return self._request(request, timeout, ranks)
        finally:
            self.failed_ranks = self._errors if self._ranks is not None else []
            self._failed_gone = bool(self._errors) and self._ranks is None
    def _start(self) -> None:
        n = self.world_size
        ranks = Supervisor(n, quiet=False, env=self.env)
        pipes = [multiprocessing.Pipe() for _ in range(n)]
        job = WorkerJob(payload=b"", world_size=n, backend=self.backend, init=True,
                        pg_timeout_s=PG_TIMEOUT_S, run_dir=ranks.run_dir, env=ranks.env,
                        launcher_pid=os.getpid(), cell_sources={}, seed=self.seed)
        try:
            ranks.start(serve, (job, [theirs for _, theirs in pipes]))
        except BaseException:
            for mine, _ in pipes:
                mine.close()
            ranks.close()
            raise
        finally:
            for _, theirs in pipes:
                theirs.close()
        self._ranks, self._conns = ranks, [mine for mine, _ in pipes]
        self.run_dir, self.port = ranks.run_dir, ranks.port
        # each rank says ready once its group is formed, and whether it can see its collectives
        self._sees_collectives = all(self._collect(self.start_timeout, what="start"))

    def _request(self, request: Request, timeout: float, ranks: list[int] | None = None) -> list:
        if self._stopped:
            raise RuntimeError("this pool was stopped; start a new one (%ddp start)")
        timeout = check_timeout(timeout)
        try:
            message = _message(request)
        except KeyboardInterrupt:   # still pickling it (a big push): nothing was sent
            raise interrupted("nothing was sent to the ranks; they keep their variables.") from None
        except Exception as exc:
            raise _cannot_send(request, exc) from None
        if self._broken and not isinstance(request, Debug):
            self._discard()   # the ranks kept for `debug` after an error: fresh ones now
        if not self._broken:
            self._replace_dead_ranks()
        if self._ranks is None:
            self._start()
            _notice(f"started {self.world_size} new ranks ({self.backend}); their variables are empty.")
        ranks = list(range(self.world_size)) if ranks is None else ranks
        try:
            for r in ranks:
                try:
                    self._conns[r].send_bytes(message)
                except OSError:
                    break   # a rank died just now: _collect reports it
        except KeyboardInterrupt:
            # Part of a message may have gone (a big push takes a while): that rank waits for the
            # rest, and the others for what they never got. As after an interrupted cell: new ranks.
            self._discard()
            raise interrupted(f"the ranks were stopped while the request was being sent; {RESET}.") from None
        return self._collect(timeout, what="debug" if isinstance(request, Debug) else "cell", ranks=ranks)

    def _replace_dead_ranks(self) -> None:
        """A rank that died while idle (killed, out of memory): say so, and drop the pool."""
        if self._ranks is None:
            return
        dead = [(r, p.exitcode) for r, p in enumerate(self._ranks.processes) if p.exitcode is not None]
        if dead:
            how = "; ".join(f"rank {r} {describe_exit(code)}" for r, code in dead)
            self._ranks.output.drain()
            self._discard()
            _notice(f"{how} while idle (logs: {self.run_dir}); the ranks were stopped.")

    def _collect(self, timeout: float, what: str, ranks: list[int] | None = None) -> list:
        """Wait for one reply per rank (of `ranks`: all by default), printing output meanwhile;
        raise on any failure."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        replies: dict[int, Reply] = {}
        errors_at: list[float] = []

        def take(rank: int, message: Reply) -> float | None:
            replies[rank] = message
            if not message.ok and not errors_at:
                errors_at.append(time.monotonic())
                return time.monotonic() + STUCK_AFTER_ERROR_S
            return None

        supervisor = self._supervisor
        try:
            outcome, named = supervisor.wait_for_replies(time.monotonic() + timeout, on_reply=take,
                                                          replies={r: self._conns[r] for r in ranks},
                                                          stopped=frozenset(self._stuck))
        except KeyboardInterrupt:
            if what == "debug" and self._end_debugging(ranks):
                raise interrupted("the debugging session was ended; the rank keeps its variables.") from None
            self._discard()
            raise interrupted(f"the ranks were stopped (a collective may have been cut half-way); {RESET}.") from None
        detail = named or []   # the ranks that failed, or had not answered
        if outcome == "failed":
            supervisor.output.drain()
            how = "; ".join(f"rank {r} {describe_exit(supervisor.processes[r].exitcode)}" for r in detail)
            self._discard()
            raise WorkerError(f"{how}. The pool was stopped and starts again on the next cell, "
                              f"with empty variables. Logs: {self.run_dir}", rank=detail[0], log_dir=self.run_dir)
        if outcome == "timeout":
            if errors_at:
                self._give_up_stuck(replies, detail)
            self._give_up_timeout(detail, timeout, "start_timeout=" if what == "start" else None)
        supervisor.output.drain()
        supervisor.output.end_lines()   # a prompt or an unfinished line belongs to this cell
        if any(reply.has_children for reply in replies.values()):
            supervisor.note_started_processes()   # ended with the pool, even if their rank dies
        errors = sorted(r for r, reply in replies.items() if not reply.ok)
        self._errors = errors
        if not all(reply.group_alive for reply in replies.values()):
            self._discard()
            _notice(f"the cell destroyed the process group, so the ranks were stopped; {RESET}.")
        if errors:
            if what == "start":
                self._discard()
            first = errors[0]
            note = f"ranks {errors[1:]} raised too" if len(errors) > 1 else ""
            raise error_from_record(first, _record(replies[first]), self.run_dir, note)
        return [cloudpickle.loads(replies[r].value) for r in ranks]

    def _end_debugging(self, ranks: list[int], wait_s: float = 5) -> bool:
        """After an Interrupt during `debug` (no collective runs): end the rank's pdb session (it hears
        that no one answers any more, or gets the Interrupt itself) and wait for its reply. Whether
        it came: the rank is idle again, and the pool stays."""
        self._supervisor.debug.close_sessions()
        try:
            with answering(NO_ONE):   # pdb's own loop takes an Interrupt as a command, and asks again
                outcome, _ = self._supervisor.wait_for_replies(time.monotonic() + wait_s,
                                                               stopped=frozenset(self._stuck),
                                                               replies={r: self._conns[r] for r in ranks})
        except KeyboardInterrupt:
            return False
        return outcome == "done"

    def _give_up_timeout(self, unfinished: list[int], timeout: float, name: str | None = None) -> NoReturn:
        stacks = stacks_of(self._supervisor, unfinished)
        self._discard()
        raise timeout_error(timeout, unfinished, stacks, self.run_dir, name=name,
                            after=f"The ranks were stopped; {RESET}.")

    def _give_up_stuck(self, replies: dict[int, Reply], stuck: list[int]) -> NoReturn:
        """Ranks still running after another raised, waiting for it in a collective: they are
        stopped now; the ranks that raised stay, for `debug`, until the next request (not `debug`),
        which starts fresh ranks."""
        self._errors = sorted(r for r, reply in replies.items() if not reply.ok)
        first = self._errors[0]
        for r in stuck:
            with contextlib.suppress(OSError):
                os.kill(self._supervisor.processes[r].pid, signal.SIGKILL)
        for r in stuck:
            self._supervisor.processes[r].join(5)
        self._broken, self._stuck = True, stuck
        raise error_from_record(
            first, _record(replies[first]), self.run_dir,
            note=f"rank(s) {stuck} were still running {STUCK_AFTER_ERROR_S} s later, probably waiting for "
                 f"rank {first} in a collective, so they were stopped; rank {first} stays for `%ddp debug` "
                 f"until the next cell, which starts fresh ranks (their variables are reset)")

    @property
    def _supervisor(self) -> Supervisor:
        """The running ranks' Supervisor (a request starts them first)."""
        if self._ranks is None:
            raise RuntimeError("the pool's ranks are not running")
        return self._ranks

    def _discard(self) -> None:
        """Stop every worker now and free the port; the next request starts new ones."""
        ranks, conns = self._ranks, self._conns
        self._ranks, self._conns, self._broken, self._stuck = None, [], False, []
        self._failed_gone, self.failed_ranks = self._failed_gone or bool(self.failed_ranks), []
        for conn in conns:
            conn.close()
        if ranks is not None:
            ranks.close()


def _notice(text: str) -> None:
    """Information, not an error: stdout (errors alone go to stderr, shown in red), flushed now so
    that it comes before the output the ranks print next."""
    sys.stderr.flush()
    print(f"ddp pool: {text}", flush=True)


def _record(reply: Reply) -> ErrorRecord:
    """The ErrorRecord of a reply that says it failed."""
    if reply.error is None:
        raise ValueError("this reply is no error")
    return reply.error


def _message(request: Request) -> bytes:
    """A request as it travels: (sources of the notebook cells its code comes from, the request)."""
    payload, sources = dumps_with_sources(request)
    return pickle.dumps((sources, payload), protocol=pickle.HIGHEST_PROTOCOL)


def _cannot_send(request: Request, exc: Exception) -> TypeError:
    """The error for a request that cannot be pickled, naming what cannot travel (nothing was sent)."""
    what = "the function or its arguments"
    if isinstance(request, Push):
        names = []
        for name, value in request.values.items():
            try:
                dumps(value)
            except Exception as err:
                names.append(name)
                exc = err
        what = ", ".join(map(repr, names)) if names else "the values"
    return TypeError(f"cannot send {what} to the ranks: {type(exc).__name__}: {exc}. What travels is "
                     "pickled (with cloudpickle); locks, open files, sockets, generators and live process "
                     "groups cannot be. Make them in the ranks instead (in a %%ddp cell). Nothing was sent.")


def _resident_mib(pid: int) -> float | None:
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except psutil.Error:
        return None
