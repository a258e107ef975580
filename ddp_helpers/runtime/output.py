"""What the ranks print, shown in the cell: each rank's stdout and stderr as `[rank N] ...` lines.

The supervisor makes an `OutputPump` for each group of ranks and reads it while it waits; the
ranks write into named pipes in the run folder (`worker`), and each rank's full log stays there.
Where the lines go is a *sink*: the cell (`CellSink`), or per-rank tabs (`rank_views.TabSink`,
for `%%ddp --tabs`), set for a block of code with `output_sink`.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

from .rank_io import MARK
from .run_dirs import rank_file

_LINE_ENDS = re.compile(rb"\r\n|\r|\n")
_READ_SIZE = 1 << 16     # a pipe's buffer (Linux)
_READS_AT_CLOSE = 16   # what is left in the pipes is read at the end (a writer that never stops: not forever)
# In the ranks' private network no DNS server answers, so c10d's reverse lookup of a socket's own
# loopback address (as "::ffff:127.0.0.1") fails "temporarily" (EAI_AGAIN), and it warns on every
# connection. Harmless (it then uses the number): kept in the log, not shown in the cell.
_UNANSWERABLE_LOOKUP = re.compile(r"socket\.cpp:\d+\] \[c10d\] The hostname of the client socket cannot "
                                  r"be retrieved\. err=-3\n?$")


# what one read prints: {"stdout" or "stderr": [(rank, a piece of text or a display)]}
_Printed = dict[str, list[tuple[int, "str | _Display"]]]


class OutputPump:
    """Reads each rank's stdout/stderr pipe and prints it as `[rank N] ...` lines.

    Named pipes (FIFOs) in the run folder: the workers open them by name, so no file
    descriptor has to travel through the forkserver. Lines wait for their end, so lines of
    different ranks never mix; what one read brings is printed in one write. A `\\r`
    (a progress bar redrawing its line) is passed on at once, the prefix after it.

    A line that carries a mime bundle (`rank_io.MARK`: a figure, an image, HTML) is displayed
    in the cell instead, after a `[rank N]` line; one larger than DISPLAY_LIMIT, or cut off by its
    rank's end, is one line saying so (never its base64 as text). Where it all goes is the *sink*:
    `sink=`, or the one `output_sink(sink)` sets for a block of code, or `CellSink` (print, display).
    """

    def __init__(self, run_dir: str, world_size: int, quiet: bool, sink: Any = None) -> None:
        self.quiet = quiet
        self.sink = sink
        self.streams: dict[int, _Stream] = {}
        self.logs: dict[int, IO[bytes]] = {}
        # the stream whose line is unfinished there
        self._open_line: dict[str, _Stream | None] = {"stdout": None, "stderr": None}
        for rank in range(world_size):
            self.logs[rank] = open(rank_file(run_dir, rank, "log"), "ab")
            for dest in ("stdout", "stderr"):
                path = rank_file(run_dir, rank, dest)
                os.mkfifo(path, 0o600)
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                self.streams[fd] = _Stream(rank, dest)

    def fds(self) -> list[int]:
        return list(self.streams)

    def read(self, ready: Iterable[Any]) -> int:
        """Read what is waiting on the given fds, print it; return the number of bytes read."""
        total = 0
        printed: _Printed = {"stdout": [], "stderr": []}
        touched: set[int] = set()
        for fd in ready:
            stream = self.streams.get(fd)
            if stream is None:
                continue
            try:
                data = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                continue
            total += len(data)
            if not data:  # the worker closed its end (it exited)
                self._take(stream, stream.finish(), printed)
                os.close(fd)
                del self.streams[fd]
            else:
                self._take(stream, stream.feed(data), printed)
            touched.add(stream.rank)
        for rank in touched:
            self.logs[rank].flush()
        self._print(printed)
        return total

    def _print(self, printed: _Printed) -> None:
        if self.quiet:
            return
        sink = self.sink or (_sinks[-1] if _sinks else CellSink)
        for dest, pieces in printed.items():
            text: list[tuple[int, str]] = []
            for rank, piece in pieces:
                if isinstance(piece, str):
                    text.append((rank, piece))
                    continue
                if text:
                    sink.write(dest, text)
                    text = []
                sink.display(rank, piece.data, piece.metadata)
            if text:
                sink.write(dest, text)

    def _take(self, stream: _Stream, pieces: list[tuple[str | _Display, bytes]], printed: _Printed) -> None:
        for shown, logged in pieces:
            self.logs[stream.rank].write(logged)
            if not shown or (isinstance(shown, str) and _UNANSWERABLE_LOOKUP.search(shown)):
                continue
            owner = self._open_line[stream.dest]
            if owner is not None and isinstance(shown, _Display):
                printed[stream.dest].append((owner.rank, "\n"))   # end an open progress line first
            elif owner is not None and owner is not stream and isinstance(shown, str):
                if not shown.startswith("\r"):
                    shown = "\n" + shown   # another rank's progress line is open: start a new one
            printed[stream.dest].append((stream.rank, shown))
            self._open_line[stream.dest] = None if isinstance(shown, _Display) or shown.endswith("\n") else stream

    def end_lines(self) -> None:
        """End every unfinished line (a prompt, `print(..., end="")`) now, so that it is shown with
        this cell's output rather than joined to the next cell's first line (a warm pool's ranks
        outlive the cell)."""
        printed: _Printed = {"stdout": [], "stderr": []}
        for stream in self.streams.values():
            if stream.sending_display():
                continue   # a rank's display still on its way (a thread of a warm pool's rank) comes later
            self._take(stream, stream.finish(), printed)
            stream.after_cr = False
        self._print(printed)

    def drain(self) -> None:
        """Print everything the workers have written so far."""
        while self.read(self.fds()):
            pass

    def close(self) -> None:
        """Print what is left (a display cut off by its rank's end is one line), close the pipes."""
        for _ in range(_READS_AT_CLOSE):
            if not self.read(self.fds()):
                break
        printed: _Printed = {"stdout": [], "stderr": []}
        for fd, stream in self.streams.items():
            self._take(stream, stream.finish(), printed)
            os.close(fd)
        self.streams.clear()
        self._print(printed)
        for log in self.logs.values():
            log.close()


class CellSink:
    """Where a pump's output goes unless told otherwise: print (the cell's stdout and stderr), and
    display a rank's mime bundle after a `[rank N]` line (its text alone outside IPython)."""

    @staticmethod
    def write(dest: str, pieces: list[tuple[int, str]]) -> None:
        """pieces: [(rank, text with its `[rank N] ` prefixes)], in order."""
        out = sys.stdout if dest == "stdout" else sys.stderr
        out.write("".join(text for _, text in pieces))
        out.flush()

    @staticmethod
    def display(rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
        if shell is None or not any(key != "text/plain" for key in data):
            text = data.get("text/plain", "").replace("\n", "\n" + " " * len(f"[rank {rank}] "))
            print(f"[rank {rank}] {text}", flush=True)
            return
        from IPython.display import display
        print(f"[rank {rank}]", flush=True)
        display(data, metadata=metadata, raw=True)


_sinks: list[Any] = []   # set by output_sink, innermost last


@contextlib.contextmanager
def output_sink(sink: Any) -> Iterator[Any]:
    """Send the output of the ranks started or run in this block to `sink` (see CellSink)."""
    _sinks.append(sink)
    try:
        yield sink
    finally:
        _sinks.remove(sink)


class _Display:
    """A mime bundle a rank sent on its stdout."""

    def __init__(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.data, self.metadata = data, metadata

    @classmethod
    def parse(cls, segment: bytes) -> _Display | None:
        """The bundle a marked line carries, or None for a line of text."""
        if not segment.startswith(_MARK):
            return None
        try:
            bundle = json.loads(segment[len(_MARK):])
            return cls(dict(bundle["data"]), dict(bundle.get("metadata") or {}))
        except (ValueError, KeyError, TypeError):
            return None


_MARK = MARK.encode()
# The most one display message may have as it travels (MARK, JSON, binary data in base64): 32 MB,
# about 24 MB of image. It bounds what one rank can make the kernel hold (a message is read whole,
# decoded, sent on to the browser and saved in the notebook: a few copies of it), and it passes, with
# room, what a lesson shows: a matplotlib figure is 40 KB at the default size, 1.3 MB for a 12x8 inch
# imshow of noise at 300 dpi; a 16 MB image of random bytes (which no PNG makes smaller) is 21 MB as
# sent. A larger one is passed over as it arrives, and one line says so.
DISPLAY_LIMIT = 32 * 10**6
_REDRAW_LIMIT = 4096   # an unfinished line after a `\r` (a progress bar's) is redrawn at each read while shorter
_MIME_KEY = re.compile(rb'"([\w.+-]+/[\w.+-]+)": ')
_CUT_OFF = " (its rank ended, or was stopped, before it was all sent): not shown"


class _Stream:
    """One rank's stdout or stderr: cut into lines, and `\\r` updates, each shown with the prefix.

    Each read looks only at its own bytes for line ends (and for a display's mark), and the
    unfinished piece grows in place: a line of any length is read in time linear in its length."""

    def __init__(self, rank: int, dest: str) -> None:
        self.rank, self.dest = rank, dest
        self.prefix = f"[rank {rank}] "
        self.pending = bytearray()   # the unfinished piece
        self.mark_at = -1            # where a display's mark starts in it (-1: none yet)
        self.skipping: list | None = None   # a display over DISPLAY_LIMIT, passed over: [its first bytes, its size]
        self.after_cr = False        # the unfinished piece redraws the line a `\r` started

    def feed(self, data: bytes) -> list[tuple[str | _Display, bytes]]:
        """[(text to show, bytes to log)] for what `data` completes; a redrawn line is shown at once."""
        pieces: list[tuple[str | _Display, bytes]] = []
        start = 0
        if self.skipping is not None:
            end = _LINE_ENDS.search(data)
            if end is None:
                self.skipping[1] += len(data)
                return pieces
            head, size = self.skipping
            self.skipping = None
            pieces.append(self._passed_over(head, size + end.start()))
            start = end.end()
        for end in _LINE_ENDS.finditer(data, start):
            if self.pending:
                self.pending += data[start:end.start()]
                segment = bytes(self.pending)
                self._clear()
            else:
                segment = data[start:end.start()]
            pieces.extend(self._pieces(segment, end.group()))
            start = end.end()
        if start < len(data):
            pieces.extend(self._grow(data[start:]))
        if self.after_cr and self.pending and len(self.pending) <= _REDRAW_LIMIT:
            redrawn = bytes(self.pending).split(b"\0")[0]   # not the start of a display's line
            if redrawn:
                pieces.append((f"\r{self.prefix}{self._text(redrawn)}", b""))
        return pieces

    def _grow(self, data: bytes) -> list[tuple[str | _Display, bytes]]:
        """Add to the unfinished piece; a display that grows past DISPLAY_LIMIT is passed over from
        here on (the text before it is shown as a line)."""
        searched = max(0, len(self.pending) - len(_MARK) + 1)
        self.pending += data
        if self.mark_at < 0:
            self.mark_at = self.pending.find(_MARK, searched)
        if self.mark_at < 0 or len(self.pending) - self.mark_at <= DISPLAY_LIMIT:
            return []
        at = self.mark_at
        before, self.skipping = bytes(self.pending[:at]), [bytes(self.pending[at:at + 4096]), len(self.pending) - at]
        self._clear()
        self.after_cr = False
        return [self._piece(before, b"\n")] if before else []

    def _clear(self) -> None:
        self.pending = bytearray()
        self.mark_at = -1

    def sending_display(self) -> bool:
        """Is a display message on its way (its mark read, not yet its end)?"""
        return self.skipping is not None or self.mark_at >= 0

    def finish(self) -> list[tuple[str | _Display, bytes]]:
        """What is left when the stream ends. A display cut off there is one line, never its text."""
        if self.skipping is not None:
            head, size = self.skipping
            self.skipping = None
            return [self._not_shown(head, f"was cut off after {size / 1e6:.1f} MB{_CUT_OFF}")]
        if not self.pending:
            return [("\n", b"") if self.after_cr else ("", b"")]
        segment = bytes(self.pending)
        self._clear()
        return self._pieces(segment, b"\n", cut=True)

    def _passed_over(self, head: bytes, size: int) -> tuple[str, bytes]:
        return self._not_shown(head, f"of {size / 1e6:.1f} MB was not shown: larger than the "
                                     f"{DISPLAY_LIMIT / 1e6:g} MB limit for one display; save it to a file "
                                     "instead (plt.savefig, Image.save) and show a smaller one")

    def _not_shown(self, head: bytes, why: str) -> tuple[str, bytes]:
        """One line instead of a display: `head` (its first bytes) says what it held."""
        kinds = [k.decode() for k in _MIME_KEY.findall(head) if k != b"text/plain"]
        images = [k for k in kinds if k.startswith("image/")]
        what = (f"an image ({', '.join(images)})" if images else
                f"a display ({', '.join(kinds)})" if kinds else "a display")
        line = f"{self.prefix}{what} {why}\n"
        self.after_cr = False
        return line, line.encode()

    def _pieces(self, segment: bytes, end: bytes, cut: bool = False) -> list[tuple[str | _Display, bytes]]:
        """A line that carries a display: the text before its mark (a line left unfinished), then
        the display. A marked line that is not a whole display (cut off, or other output written
        into it) is one line saying so, never its text."""
        at = segment.find(_MARK)
        if at < 0:
            return [self._piece(segment, end)]
        pieces = [self._piece(segment[:at], end)] if at > 0 else []
        size = len(segment) - at
        head = segment[at:at + 4096]
        if size > DISPLAY_LIMIT:
            return pieces + [self._passed_over(head, size)]
        shown = _Display.parse(segment[at:])
        if shown is None:
            why = (f"was cut off after {size / 1e6:.1f} MB{_CUT_OFF}" if cut else
                   f"of {size / 1e6:.1f} MB could not be read (other output was written into it?): not shown")
            return pieces + [self._not_shown(head, why)]
        self.after_cr = False
        return pieces + [(shown, f"[display: {', '.join(shown.data)}]\n".encode())]

    def _piece(self, segment: bytes, end: bytes) -> tuple[str | _Display, bytes]:
        text = self._text(segment)
        if end == b"\r":
            shown = f"\r{self.prefix}{text}" if self.after_cr else f"{self.prefix}{text}"
            if not segment:
                shown = ""
            self.after_cr = True
            return shown, segment + end
        # a line ends
        if self.after_cr:
            shown = f"\r{self.prefix}{text}\n" if segment else "\n"
        else:
            shown = f"{self.prefix}{text}\n"
        self.after_cr = False
        return shown, segment + b"\n"

    @staticmethod
    def _text(segment: bytes) -> str:
        return segment.decode("utf-8", "replace")
