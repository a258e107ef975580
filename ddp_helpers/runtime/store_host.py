"""The rendezvous store of a launch: a TCPStore on 127.0.0.1, in a small process beside the ranks.

The ranks meet at a store (torch's `TCPStore`), as torchrun's workers meet at their agent's. The
ranks live in a network of their own (`private_net`), which the notebook's kernel cannot reach, so
the stores cannot live in the kernel: they live in one more process forked from the same fork server
as the ranks, started at the first launch, to which the kernel talks over a pipe. Each launch (or
pool) gets a store of its own, closed at its end; the process ends when the kernel goes away.

    with StoreHost() as store:      # store.port: MASTER_PORT for the ranks
        ...                         # store.num_keys(); store.private: None, or why not private
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import torch.distributed as dist

START_TIMEOUT_S = 60     # the first one may wait for the fork server to finish importing torch


class Rendezvous:
    """A TCPStore served by this process on 127.0.0.1, on a port the OS picks.

    We bind the socket ourselves and hand it to the store: TCPStore alone would
    listen on every interface, and asking for a free port first, then binding it
    later, leaves a window in which another program can take it.
    """

    def __enter__(self) -> Rendezvous:
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

    def __exit__(self, *exc: object) -> Literal[False]:
        del self.store  # stops the server and closes its socket: the port is free again
        return False


class StoreHost:
    """One launch's store, served by the store process (see the module docstring)."""

    def __enter__(self) -> StoreHost:
        self.port, self.private = _ask("open")
        return self

    def num_keys(self) -> int:
        return _ask("num_keys", self.port)

    def __exit__(self, *exc: object) -> Literal[False]:
        try:
            _ask("close", self.port)
        except (OSError, EOFError, RuntimeError):
            pass   # the store process is gone: so is the store
        return False


class _Host:
    """The store process of this kernel, started at its first launch: one more fork of the fork
    server, which lives as long as the kernel (it ends when its pipe closes). Each launch asks it
    for a store of its own (a new TCPStore on a new port) and closes it at the end: a request on a
    pipe costs about a millisecond, where starting a process for each launch cost 40."""
    process: BaseProcess | None = None
    conn: Connection | None = None
    owner: int | None = None   # the PID that started it (a fork of the kernel starts its own)
    lock = threading.Lock()


def _ask(*request: Any) -> Any:
    with _Host.lock:
        for attempt in (1, 2):   # a store process that died (killed, say) is replaced once
            conn = _Host.conn
            if conn is None or _Host.owner != os.getpid() or _Host.process is None or not _Host.process.is_alive():
                conn = _start_host()
            try:
                conn.send(request)
                kind, value = conn.recv()
                break
            except (OSError, EOFError):
                _Host.owner = None
                if attempt == 2:
                    raise
    if kind != "ok":
        raise RuntimeError(f"the rendezvous store could not {request[0]}: {value}")
    return value


def _start_host() -> Connection:
    from . import forkserver, run_dirs
    forkserver.start()
    context: Any = multiprocessing.get_context(forkserver.start_method())
    conn, theirs = context.Pipe()
    log = os.path.join(run_dirs.run_root(), f"store-{os.getpid()}.log")
    process = context.Process(target=serve_stores, args=(theirs, log), name="ddp-helpers-store", daemon=True)
    with forkserver.main_script_not_rerun():
        process.start()
    theirs.close()
    if not conn.poll(START_TIMEOUT_S):
        process.kill()
        raise RuntimeError(f"the rendezvous store did not start within {START_TIMEOUT_S} s")
    conn.recv()   # ready
    _Host.process, _Host.conn, _Host.owner = process, conn, os.getpid()
    return conn


def serve_stores(conn: Connection, log: str) -> None:
    """The store process: open, count and close stores as the kernel asks, until its pipe closes."""
    from . import forkserver
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)   # not the kernel's output, which Jupyter may show in whichever cell runs
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the Interrupt button is for the cell; the kernel ends us
    stores = {}
    conn.send(("ok", "ready"))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if request[0] == "open":
                rendezvous = Rendezvous().__enter__()
                stores[rendezvous.port] = rendezvous
                reply = (rendezvous.port, forkserver.NETWORK)
            elif request[0] == "num_keys":
                reply = stores[request[1]].store.num_keys()
            elif request[0] == "close":
                stores.pop(request[1]).__exit__(None, None, None)
                reply = None
            else:
                raise ValueError(f"unknown request {request!r}")
            conn.send(("ok", reply))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
