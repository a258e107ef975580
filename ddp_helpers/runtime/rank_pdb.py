"""A rank's debugger: the stdlib's pdb, whose prompt and output are in the notebook cell.

A rank has no terminal, so `breakpoint()` there would read an empty stdin. Here each rank's pdb
(`RankPdb`, a `pdb.Pdb` given file-like stdin and stdout) talks to the kernel over a private
channel: a Unix socket in the run folder (mode 0600; its path is in `SOCKET_ENV`), which the
supervisor's wait loop serves (`debug_session.DebugServer`). What pdb prints goes to the kernel,
which prints it in the cell as `[rank N] ...` lines and answers each `(Pdb) ` prompt: with the
learner's line (`input()`, the kernel's stdin channel), or with commands given up front
(`%%ddp --pdb`, `%ddp debug -c`).

- `breakpoint()` and `dist.breakpoint(rank)` stop this rank (`install` sets both). `q` leaves the
  debugger and lets the rank go on (never BdbQuit ending the cell); `dist.breakpoint` then waits in
  the group's barrier, as torch's does, so the other ranks go on with it.
- `post_mortem(exc)`: pdb at the deepest frame of the learner's code in the exception's
  traceback (`%ddp debug` on a warm pool).
- No one to answer (no channel, a kernel without stdin, a script without a terminal, the kernel not
  waiting): one line `breakpoint() at FILE:LINE: no one to answer here; continuing`, and the rank
  continues. `PYTHONBREAKPOINT=0` disables `breakpoint()` as it always does.
"""
from __future__ import annotations

import itertools
import json
import os
import pdb
import re
import sys
import sysconfig
import threading
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from types import FrameType, TracebackType
from typing import IO, Any, cast

from . import PACKAGE_DIR

SOCKET_ENV = "DDP_HELPERS_PDB_SOCKET"
ACK_S = 30           # how long a rank waits for the kernel to take up its prompt
_LIBRARY = tuple({PACKAGE_DIR, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                  sysconfig.get_paths()["platlib"]})
# a notebook cell's code file in ipykernel (/tmp/ipykernel_<pid>/<hash>.py): its pid changes each run
KERNEL_CELL = re.compile(r"\S*ipykernel_\d+/\d+\.py")
_channel: dict[str, Any] = {"conn": None, "pid": None}
_session = threading.Lock()   # one pdb session at a time in a rank (threads may break too)
_skipped: dict[tuple, int] = {}   # dist.breakpoint(skip=...): calls seen per calling line
_stop_ids = itertools.count(1)   # each stop at a pdb prompt in this rank: the kernel's commands start again


def install() -> None:
    """In a rank, once: `breakpoint()` and `dist.breakpoint` stop here, with the prompt in the cell."""
    import torch.distributed as dist
    sys.breakpointhook = _breakpointhook
    dist.breakpoint = dist_breakpoint
    os.register_at_fork(after_in_child=_forget_channel)


def _breakpointhook(*args: Any, **kwargs: Any) -> Any:
    hook = os.environ.get("PYTHONBREAKPOINT", "")
    if hook == "0":
        return None
    if hook not in ("", "pdb.set_trace"):
        return sys.__breakpointhook__(*args, **kwargs)
    set_trace(sys._getframe(1), "breakpoint()")


def dist_breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:
    """torch.distributed.breakpoint, with the prompt in the cell: stop rank `rank`, then every rank
    waits in a barrier until it goes on. `q` there continues too, so the others never stay stuck
    in the barrier. `skip`: ignore the first `skip` calls from this line. `timeout_s`: the groups'
    timeout while the rank is debugged (as torch sets it)."""
    import torch.distributed as dist
    caller = sys._getframe(1)
    if skip > 0:
        key = (caller.f_code.co_filename, caller.f_lineno)
        _skipped[key] = _skipped.get(key, 0) + 1
        if _skipped[key] <= skip:
            return
    c10d = dist.distributed_c10d
    set_timeout = getattr(c10d, "set_timeout", None) or getattr(c10d, "_set_pg_timeout", None)
    if timeout_s is not None and set_timeout is not None:
        for group in list(getattr(c10d, "_pg_map", {})):
            try:
                set_timeout(timedelta(seconds=timeout_s), group)
            except Exception:
                pass   # a backend that cannot change it keeps its own
    if dist.get_rank() == rank:
        set_trace(caller, f"dist.breakpoint({rank})", now=True)
    dist.barrier()


def set_trace(frame: FrameType, what: str = "breakpoint()", now: bool = False) -> None:
    """Stop in `frame`: at its next line (as pdb.set_trace does), or `now`, at the line it is on
    (dist.breakpoint: before its barrier, which would otherwise be stepped into first)."""
    if not _session.acquire(blocking=False):
        return   # this thread is already in the debugger (a breakpoint() typed at the prompt)
    try:
        debugger = RankPdb("breakpoint", what)
        debugger.called_at = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if now:
            debugger.stop_now(frame)
        else:
            debugger.set_trace(frame)
    finally:
        _session.release()


def post_mortem(exc: BaseException) -> None:
    """pdb in the frames of `exc`'s traceback, at the deepest frame of the learner's code."""
    with _session:
        debugger = RankPdb("post-mortem", "post-mortem")
        debugger.reset()
        debugger.interaction(None, exc.__traceback__)


def _plumbing(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_LIBRARY)


class RankPdb(pdb.Pdb):
    """pdb whose stdin and stdout are the kernel: see the module docstring."""

    def __init__(self, mode: str, what: str) -> None:
        self.mode, self.what, self.stops, self.nobody = mode, what, 0, False
        self.called_at: str | None = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.output = _Output()
        super().__init__(stdin=cast(IO[str], _Input(self)), stdout=cast(IO[str], self.output), nosigint=True,
                         readrc=False, skip=["ddp_helpers.*"])
        self.prompt = "(Pdb) "

    def setup(self, f: FrameType | None, tb: TracebackType | None) -> Any:
        stop = super().setup(f, tb)
        # the frames of the launcher's plumbing (forkserver, serve, exec_cell) are not the learner's
        first = 0
        for i in range(self.curindex):
            name = self.stack[i][0].f_code.co_filename
            if name.startswith(PACKAGE_DIR):
                first = i + 1
            elif not _plumbing(self.stack[i][0]) and name != "<string>":   # the learner's outermost frame
                break
        if first:
            del self.stack[:first]
            self.curindex -= first
        if self.mode == "post-mortem":   # an error raised inside torch: start at the learner's line
            while self.curindex > 0 and _plumbing(self.stack[self.curindex][0]):
                self.curindex -= 1
        self.curframe = self.stack[self.curindex][0]
        self.curframe_locals = self.curframe.f_locals
        return stop

    def interaction(self, frame: FrameType | None, traceback: Any) -> None:
        self.stops = next(_stop_ids)
        try:
            super().interaction(frame, traceback)
        finally:
            text = self.output.take()
            if not self.nobody:   # the end of this stop: the kernel may take up another rank's prompt
                _send(("out", self.rank, text, self.stops, self.mode))

    def stop_now(self, frame: FrameType) -> None:
        """The prompt at once, in `frame`; then trace on (as set_trace would) unless continued."""
        self.reset()
        outer: FrameType | None = frame
        while outer is not None:
            outer.f_trace = self.trace_dispatch
            self.botframe, outer = outer, outer.f_back
        self.set_step()
        self.interaction(frame, None)
        if self.stoplineno == -1 and not self.breaks:   # c or q: the rank goes on untraced
            self.set_continue()
        else:
            sys.settrace(self.trace_dispatch)

    def user_return(self, frame: FrameType, value: Any) -> None:
        """Stepping past the end of the learner's code (a cell, a launched function) lets the rank go
        on, rather than stop in the launcher's frames after it."""
        if self.stops and (frame.f_back is None or _plumbing(frame.f_back)):
            self.set_continue()
            return
        super().user_return(frame, value)

    def where(self) -> str:
        if self.called_at:
            return self.called_at
        frame, line = (self.curframe, self.curframe.f_lineno) if self.curframe else (None, 0)
        return f"{frame.f_code.co_filename if frame else '?'}:{line}"

    def do_quit(self, arg: str) -> Any:
        """q(uit): leave the debugger; at a breakpoint the rank goes on (the others with it)."""
        if self.mode == "breakpoint":
            self.clear_all_breaks()
            self.set_continue()
            return 1
        return super().do_quit(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> Any:
        return self.do_quit(arg)


class _Output:
    """pdb's stdout: kept until the next prompt, then sent with it."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


class _Input:
    """pdb's stdin: each line is asked of the kernel, with what pdb printed since the last one."""

    def __init__(self, debugger: RankPdb) -> None:
        self.debugger = debugger

    def readline(self) -> str:
        d = self.debugger
        text = d.output.take()
        if text.endswith(d.prompt):
            text = text[:-len(d.prompt)]
        if not d.nobody:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()   # what the rank printed before comes first in the cell
            answer = _ask(("ask", d.rank, text, d.stops, d.mode))
            if answer is not None:
                return answer + "\n"
            d.nobody = True
            then = "continuing" if d.mode == "breakpoint" else "leaving the debugger"
            where = KERNEL_CELL.sub("<notebook cell>", d.where())
            print(f"{d.what} at {where}: no one to answer here; {then}", flush=True)
        return "q\n"


def _ask(message: tuple) -> str | None:
    """Send a prompt; the kernel's answer (a line), or None when no one answers."""
    conn = _connect()
    if conn is None:
        return None
    try:
        conn.send_bytes(json.dumps(message).encode())
        if not conn.poll(ACK_S):   # the kernel does not serve us (it is not waiting for this run)
            raise OSError("no answer")
        conn.recv_bytes()   # ["ack", null]: the kernel took it up; a person may take long to answer
        kind, line = json.loads(conn.recv_bytes())
    except (EOFError, OSError, KeyboardInterrupt) as exc:
        _forget_channel()
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None
    return line if kind == "line" else None


def _send(message: tuple) -> None:
    conn = _connect()
    try:
        if conn is not None:
            conn.send_bytes(json.dumps(message).encode())
    except OSError:
        _forget_channel()


def _connect() -> Connection | None:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return None
    if _channel["conn"] is None or _channel["pid"] != os.getpid():
        try:
            _channel["conn"], _channel["pid"] = Client(path, family="AF_UNIX"), os.getpid()
        except OSError:
            return None
    return _channel["conn"]


def _forget_channel() -> None:
    """After an error, or in a child the rank forked: the next prompt connects anew."""
    conn, _channel["conn"] = _channel["conn"], None
    if conn is not None and _channel["pid"] == os.getpid():
        try:
            conn.close()
        except OSError:
            pass
