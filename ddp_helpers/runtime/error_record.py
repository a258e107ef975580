"""What a rank that raised tells the kernel: `ErrorRecord`, made in the rank by `describe_exception`.

It crosses from a rank to the kernel two ways. A `launch` rank leaves it in its run folder
(`rank_setup.report_error`, the "error" file that `run_dirs` lists) as a plain dict (`as_dict`: str
and int values only, pickled), which the kernel reads back with `from_dict`: a reader that refuses
every class reference (the exercises' checkers read the ranks' files so) reads it, and it is JSON as
it is. A warm pool's rank sends the dataclass itself in its `protocol.Reply`. The kernel turns it into
a `WorkerError` (`launch_errors.error_from_record`). Every field is an exact str or int, so reading it
runs no code of the rank's.
"""
from __future__ import annotations

import dataclasses
import signal
import traceback
from types import TracebackType
from typing import Any

from . import PACKAGE_DIR


@dataclasses.dataclass(frozen=True)
class ErrorRecord:
    """An exception raised in a rank, as text."""
    type: str                   # the exception's class, e.g. "ValueError" (its __qualname__)
    module: str                 # where the class lives, e.g. "builtins"
    message: str                # str(exception)
    traceback: str              # the formatted traceback, without ddp_helpers' own frames at the top
    rank: int | None = None     # the rank that raised it
    signal: int | None = None   # the signal behind it: SIGINT for a KeyboardInterrupt (the Interrupt button)

    def as_dict(self) -> dict[str, Any]:
        """The record as builtin values only: what the error file holds."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> ErrorRecord:
        """The record an error file holds (`as_dict`); a TypeError for anything else. `type`, `message`
        and `traceback` are needed, the other fields may be missing."""
        if not isinstance(data, dict):
            raise TypeError(f"an error record is a dict, not a {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        if any(k not in known for k in data) or any(k not in data for k in ("type", "message", "traceback")):
            raise TypeError(f"not an error record: {sorted(map(str, data))}")

        def text(key: str) -> str:
            value = data.get(key, "")
            if type(value) is not str:
                raise TypeError(f"an error record's {key} is a str, not a {type(value).__name__}")
            return value

        def number(key: str) -> int | None:
            value = data.get(key)
            if value is not None and type(value) is not int:
                raise TypeError(f"an error record's {key} is an int or None, not a {type(value).__name__}")
            return value

        return cls(type=text("type"), module=text("module"), message=text("message"),
                   traceback=text("traceback"), rank=number("rank"), signal=number("signal"))


def describe_exception(exc: BaseException, rank: int | None = None) -> ErrorRecord:
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
    return ErrorRecord(type=_exact_str(type(exc).__qualname__), module=_exact_str(type(exc).__module__),
                       message=_exact_str(message), traceback=_exact_str(text),
                       rank=None if rank is None else int(rank),
                       signal=int(signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else None)


def _exact_str(value: object) -> str:
    return str.__str__(value) if isinstance(value, str) else f"<not a str: {type(value).__name__}>"


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Skip the frames of ddp_helpers' own plumbing at the top of a traceback."""
    first = tb
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        tb = tb.tb_next
    return tb or first
