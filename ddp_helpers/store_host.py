"""The rendezvous store of a launch: a TCPStore on 127.0.0.1, in a small process beside the ranks.

The ranks meet at a store (torch's `TCPStore`), as torchrun's workers meet at their agent's. The
ranks live in a network of their own (`private_net`), which the notebook's kernel cannot reach, so
the store cannot live in the kernel: `StoreHost` starts it in one more process forked from the same
fork server as the ranks, and talks to it over a pipe. It ends with the launch (or the pool), or at
once if the kernel goes away.

    with StoreHost() as store:      # store.port: MASTER_PORT for the ranks
        ...                         # store.num_keys(); store.private: None, or why not private
"""
import multiprocessing
import os
import signal
import socket
from datetime import timedelta

import torch.distributed as dist

START_TIMEOUT_S = 60     # the first one may wait for the fork server to finish importing torch


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


class StoreHost:
    """The kernel's handle on the store process. See the module docstring.
    log: the file that takes the store's own output (torch's warnings)."""

    def __init__(self, log=os.devnull):
        self.log = log

    def __enter__(self):
        from . import forkserver
        from .supervisor import main_script_not_rerun
        forkserver.start()
        context = multiprocessing.get_context(forkserver.start_method())
        self._conn, theirs = context.Pipe()
        self.process = context.Process(target=serve_store, args=(theirs, self.log), name="ddp-helpers-store",
                                       daemon=True)
        try:
            with main_script_not_rerun():
                self.process.start()
            theirs.close()
            if not self._conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"the rendezvous store did not start within {START_TIMEOUT_S} s")
            kind, value, self.private = self._conn.recv()
            if kind != "ok":
                raise RuntimeError(f"the rendezvous store could not start: {value}")
            self.port = value
        except BaseException:
            self._end()
            raise
        return self

    def num_keys(self):
        self._conn.send("num_keys")
        return self._conn.recv()

    def __exit__(self, *exc):
        self._end()
        return False

    def _end(self):
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self._conn.close()
        if self.process.pid is not None:
            self.process.join(2)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()


def serve_store(conn, log):
    """The store process: serve the store until the kernel says stop, or its end of the pipe closes."""
    from . import forkserver
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)   # not the kernel's output, which Jupyter may show in whichever cell runs
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the Interrupt button is for the cell; the kernel ends us
    try:
        rendezvous = Rendezvous().__enter__()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", None))
        return
    conn.send(("ok", rendezvous.port, forkserver.NETWORK))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break
        if request == "num_keys":
            conn.send(rendezvous.store.num_keys())
        else:
            break
    rendezvous.__exit__(None, None, None)
