"""The kernel's side of a rank's debugger (`rank_pdb`): print its output, answer its prompts.

`DebugServer` listens on a Unix socket in the run folder (mode 0600, in the user's private run
root); the `Supervisor` passes its path to the ranks (`rank_pdb.SOCKET_ENV`) and serves it in the
loop where it waits for them. A rank at a pdb prompt sends what pdb printed (as JSON: plain data,
so nothing a rank sends can run code in the kernel, as unpickling could); it is printed in the
cell as `[rank N] ...` lines (after what the rank printed before), and the prompt is answered:

- with the commands given up front (`answering(commands)`: `%%ddp --pdb`, `%ddp debug -c`),
  each shown after `[rank N] (Pdb) ` as a person's would be; every stop of pdb starts the
  commands again, and when they run out the rank continues (`c`; `q` after a post-mortem);
- else with `input("[rank N] (Pdb) ")`: in a Jupyter kernel that goes through the stdin channel,
  as `%debug` does. A kernel without stdin (nbclient, nbval: StdinNotImplementedError), or a script
  whose stdin is not a terminal, has no one to answer: the rank is told so, says it in one line and
  continues.

While a person is being asked, the run's timeout clock stands still (`take_paused`): the time
spent at the prompt is added to the deadline. An Interrupt at the prompt raises KeyboardInterrupt
out of the wait, which ends the run as an Interrupt always does (the ranks are stopped).
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing.connection
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from .rank_pdb import KERNEL_CELL

_answers: list[Sequence[str] | None] = []   # a stack of command lists (answering)
NO_ONE = ("no one",)   # answering(NO_ONE): every prompt hears that no one answers


@contextlib.contextmanager
def answering(commands: Sequence[str] | None) -> Iterator[None]:
    """Answer the ranks' pdb prompts with `commands` (a list of lines; None: ask the person)."""
    _answers.append(commands if commands is None or commands is NO_ONE else list(commands))
    try:
        yield
    finally:
        _answers.pop()


class DebugServer:
    """The socket a run's ranks reach the kernel's pdb prompt through. See the module docstring."""

    def __init__(self, run_dir: str) -> None:
        self.conns: list[Connection] = []
        self.current: Connection | None = None   # the connection of the rank whose pdb session is going on
        self._waiting: list[tuple[Connection, list]] = []   # (connection, message) read and not yet taken up
        self.path: str | None = os.path.join(run_dir, "pdb.sock")
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(self.path)
            os.chmod(self.path, 0o600)
            self.listener.listen(64)
            self.listener.setblocking(False)
        except OSError:   # a path too long for a socket (a deep $TMPDIR): breakpoints find no one to answer
            self.close()
            self.path = self.listener = None
        except BaseException:
            self.close()
            raise
        self.paused_s = 0.0
        self._queues: dict[int, tuple[int, list[str]]] = {}   # rank -> (pdb stop number, commands left)

    def fds(self) -> list[Any]:
        return [self.listener, *self.conns] if self.listener is not None else []

    def serve(self, ready: list[Any], before_printing: Callable[[], None]) -> None:
        """Take up what is ready among `fds()`: new ranks, their output and prompts.
        `before_printing()` prints what the ranks wrote before (their pipes)."""
        if self.listener is not None and self.listener in ready:
            while True:
                try:
                    sock, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                sock.setblocking(True)
                self.conns.append(multiprocessing.connection.Connection(sock.detach()))
        for conn in [c for c in self.conns if c in ready]:
            try:
                message = json.loads(conn.recv_bytes())   # plain data: nothing a rank sends runs here
            except (EOFError, OSError, ValueError):
                self._drop(conn)
                continue
            if not _well_formed(message):
                self._drop(conn)
                continue
            if message[0] == "ask":
                self._reply(conn, ("ack", None))   # taken up: the rank waits for its answer now
            self._waiting.append((conn, message))
        # one rank's session at a time: another rank's prompt waits until this one's session ends
        while True:
            mine = [w for w in self._waiting if self.current in (None, w[0])]
            if not mine:
                break
            self._waiting.remove(mine[0])
            before_printing()
            self._take(*mine[0])

    def _take(self, conn: Connection, message: list) -> None:
        kind, rank, text, stop, mode = message
        commands = _answers[-1] if _answers else None
        if commands is NO_ONE:
            if kind == "ask":
                self._reply(conn, ("nobody", None))
            return
        if kind == "ask" and commands is None and not someone_to_ask():
            self._reply(conn, ("nobody", None))   # the rank says so, in one line
            return
        _print(rank, KERNEL_CELL.sub("<notebook cell>", text))
        self.current = conn if kind == "ask" else None
        if kind == "ask":
            line = self._answer(rank, stop, mode)
            self._reply(conn, ("line", line) if line is not None else ("nobody", None))

    def _reply(self, conn: Connection, *messages: tuple[str, str | None]) -> None:
        try:
            for message in messages:
                conn.send_bytes(json.dumps(message).encode())
        except OSError:   # the rank is gone
            self._drop(conn)

    def _answer(self, rank: int, stop: int, mode: str) -> str | None:
        commands = _answers[-1] if _answers else None
        prompt = f"[rank {rank}] (Pdb) "
        if commands is not None:
            if self._queues.get(rank, (None,))[0] != stop:
                self._queues[rank] = (stop, list(commands))
            left = self._queues[rank][1]
            line = left.pop(0) if left else ("c" if mode == "breakpoint" else "q")
            print(prompt + line, flush=True)
            return line
        started = time.monotonic()
        try:
            return _ask_person(prompt)
        finally:
            self.paused_s += time.monotonic() - started

    def take_paused(self) -> float:
        """Seconds spent waiting for a person since the last call (the run's clock stood still)."""
        paused, self.paused_s = self.paused_s, 0.0
        return paused

    def _drop(self, conn: Connection) -> None:
        if self.current is conn:
            self.current = None
        self._waiting = [w for w in self._waiting if w[0] is not conn]
        if conn in self.conns:
            self.conns.remove(conn)
            conn.close()

    def close_sessions(self) -> None:
        """End every rank's connection: a rank at a prompt hears that no one answers, and goes on."""
        for conn in list(self.conns):
            self._drop(conn)

    def close(self) -> None:
        self.close_sessions()
        if self.listener is not None:
            self.listener.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _well_formed(message: object) -> bool:
    """[kind, rank, pdb's output, stop number, mode], as `rank_pdb` sends it."""
    return (isinstance(message, list) and len(message) == 5 and message[0] in ("ask", "out")
            and isinstance(message[1], int) and isinstance(message[2], str)
            and message[4] in ("breakpoint", "post-mortem"))


def _print(rank: int, text: str) -> None:
    if not text:
        return
    sys.stderr.flush()
    lines = text[:-1] if text.endswith("\n") else text
    print("\n".join(f"[rank {rank}] {line}" for line in lines.split("\n")), flush=True)


def someone_to_ask() -> bool:
    """Whether input() can reach a person: a Jupyter kernel whose cell allows stdin, or a terminal."""
    shell = _ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        return getattr(kernel, "_allow_stdin", True)
    return sys.stdin is not None and sys.stdin.isatty()


def _ask_person(prompt: str) -> str | None:
    """The person's answer, or None when there is no one to ask here."""
    if not someone_to_ask():
        return None
    try:
        return input(prompt)
    except EOFError:
        return None
    except Exception as exc:   # IPython's StdinNotImplementedError: a kernel without stdin
        if type(exc).__name__ == "StdinNotImplementedError":
            return None
        raise


def _ipython() -> Any:
    if "IPython" not in sys.modules:
        return None
    return sys.modules["IPython"].get_ipython()
