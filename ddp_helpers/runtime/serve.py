"""What runs inside each worker process of a warm `Pool`: form the group, then answer requests.

`serve(local_rank, job, connections)` is the target handed to
`torch.multiprocessing.start_processes`. It sets the process up as `launch`'s workers are set up
(`rank_setup.setup_worker_process`: output pipes, environment, watchdog), forms the process group,
says "ok" on its connection, and then answers the kernel's requests one at a time: run a cell
(on every rank, or on some: `rank_io.only_ranks`), call a function, set or read a variable, stop.

The requests and the answer (`protocol.Reply`: the pickled value or the `ErrorRecord` of what it
raised, whether the process group still stands, whether this rank has child processes, which one
system call tells) are the dataclasses of `protocol`.

A cell may fork (`os.fork()`): the child shares this rank's connection to the kernel, and would
answer for the rank when it reaches the end of the cell (or is interrupted there). So the child
closes its copy of the connection as it starts, and ends instead of answering.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch.distributed as dist

from . import rank_io, rank_pdb
from .cell_exec import exec_cell, rank_namespace
from .cells import dumps, to_cpu
from .error_record import describe_exception
from .protocol import Call, Debug, Exec, Pull, Push, Reply, Request, Stop
from .random_state import reseed
from .rank_setup import WorkerJob, end_worker, init_process_group, setup_worker_process, threads_left_running


def serve(local_rank: int, job: WorkerJob, connections: list[Connection]) -> None:
    """Target of `start_processes` for a pool worker."""
    conn = connections[local_rank]
    for other in connections:
        if other is not conn:
            other.close()
    # Idle workers ignore Ctrl-C / Jupyter's Interrupt (sent to the kernel's whole process
    # group); only a running cell may be interrupted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = os.getpid()
    os.register_at_fork(after_in_child=lambda: _forget(conn))
    try:
        setup_worker_process(local_rank, job)
        init_process_group(job.backend, local_rank, job.pg_timeout_s)
        conn.send(Reply(value=dumps(rank_io.collectives_visible())))   # for %%ddp --ranks
    except BaseException as exc:
        conn.send(Reply(error=describe_exception(exc, local_rank), group_alive=dist.is_initialized()))
        end_worker()
        return
    state = _RankState()
    while True:
        try:
            sources, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        linecache.cache.update(sources)   # the notebook cells whose code the request carries
        request = cloudpickle.loads(payload)
        if isinstance(request, Stop):
            break
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if getattr(request, "seed", None) is not None:   # a seeded cell or call: the same draws each time
                reseed(local_rank, request.seed)
            reply = Reply(value=dumps(to_cpu(state.handle(request))))
        except BaseException as exc:
            reply = Reply(error=describe_exception(exc, local_rank))
            if isinstance(request, (Exec, Call)):
                state.failed = exc   # for `%ddp debug`, with its traceback and the frames' variables
        finally:
            if os.getpid() == me:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            sys.stdout.flush()
            sys.stderr.flush()
        if os.getpid() != me:   # a child the cell forked, at the end of the cell: never answer
            os._exit(0 if reply.ok else 1)
        reply.group_alive, reply.has_children = dist.is_initialized(), _has_children()
        conn.send(reply)
    if dist.is_initialized():
        dist.destroy_process_group()
    end_worker()
    if threads_left_running(grace_s=0):
        os._exit(0)   # threads a cell left running would keep this rank from exiting (%ddp stop)


def _forget(conn: Connection) -> None:
    """In a child forked by a cell: close this process's copy of the rank's connection (the rank's
    own stays open), so that the child can neither read the rank's requests nor answer them."""
    with contextlib.suppress(OSError):
        conn.close()


def _has_children() -> bool:
    """Whether this process has child processes (running, or exited and not yet waited for)."""
    if not hasattr(os, "waitid"):
        return True   # cannot tell cheaply: let the kernel look
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


class _RankState:
    """One rank's namespace, kept between cells."""

    def __init__(self) -> None:
        self.namespace = rank_namespace()
        self.from_kernel: dict[str, Any] = {}  # name -> the object the kernel last sent for it
        self.failed: BaseException | None = None   # the exception of the last cell or call that raised here

    def handle(self, request: Request) -> Any:
        if isinstance(request, Exec):
            self._take_from_kernel(request.sent)
            if request.only is None:
                return exec_cell(request.source, self.namespace, request.filename)
            with rank_io.only_ranks(request.only):   # %%ddp --ranks: no collective with the other ranks
                return exec_cell(request.source, self.namespace, request.filename)
        if isinstance(request, Call):
            return request.fn(*request.args, **request.kwargs)
        if isinstance(request, Push):
            self.namespace.update(request.values)
            return None
        if isinstance(request, Debug):
            if self.failed is None:
                raise ValueError(f"rank {dist.get_rank()} has no failed cell to debug")
            return rank_pdb.post_mortem(self.failed)
        if isinstance(request, Pull):
            if request.name not in self.namespace:
                raise NameError(f"rank {dist.get_rank()} has no variable {request.name!r}")
            return self.namespace[request.name]
        raise ValueError(f"unknown request {request!r}")

    def _take_from_kernel(self, sent: dict[str, Any]) -> None:
        """Notebook variables a cell uses fill in names the rank has not set itself:
        a rank's own variables are never overwritten by the kernel's."""
        for name, value in sent.items():
            current = self.namespace.get(name, _MISSING)
            if current is _MISSING or current is self.from_kernel.get(name, _MISSING):
                self.namespace[name] = value
                self.from_kernel[name] = value


_MISSING = object()
