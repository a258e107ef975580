"""The errors a launch, a warm pool or `%%ddp` raises in the cell: `WorkerError` (a rank raised, crashed
or was killed) and `WorkerTimeout` (ranks did not finish in time), and how they are made from what the
ranks left: a rank's `ErrorRecord` (`error_from_record`), the stacks of ranks that hung (`timeout_error`).

`from ddp_helpers import WorkerError` (and `ddp_helpers.launcher.WorkerError`) are these classes.
"""
from __future__ import annotations

from typing import Any

from .runtime.error_record import ErrorRecord
from .runtime.stacks import describe_timeout


class WorkerError(RuntimeError):
    """A worker raised, crashed or was killed. `rank`, `exc_type`, `exc_message`,
    `remote_traceback` describe the first rank that failed; `log_dir` holds full logs."""

    def __init__(self, message: str, rank: int | None = None, exc_type: str | None = None,
                 exc_message: str | None = None, remote_traceback: str | None = None, log_dir: str | None = None,
                 failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.log_dir = log_dir
        self.failures = failures or {}

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the launcher's own frames: the worker's traceback is what matters.
        return [f"{type(self).__name__}: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


class WorkerTimeout(WorkerError, TimeoutError):
    """Workers did not finish in time. `unfinished_ranks` lists those still running;
    `in_collective` maps those whose stack was inside torch.distributed to the function there."""

    def __init__(self, message: str, unfinished_ranks: list[int], log_dir: str | None = None,
                 in_collective: dict[int, str] | None = None) -> None:
        super().__init__(message, log_dir=log_dir)
        self.unfinished_ranks = unfinished_ranks
        self.in_collective = in_collective or {}


def error_from_record(rank: int, record: ErrorRecord, run_dir: str, note: str = "",
                      failures: dict[int, str] | None = None) -> WorkerError:
    """WorkerError for a rank that raised, from the record `describe_exception` made there."""
    tail = f"\n({note})" if note else ""
    message = (f"rank {rank} raised {record.type}: {record.message}\n\n"
               f"--- traceback from rank {rank} ---\n{record.traceback}"
               f"full logs: {run_dir}{tail}")
    return WorkerError(message, rank=rank, exc_type=record.type, exc_message=record.message,
                       remote_traceback=record.traceback, log_dir=run_dir, failures=failures)


def timeout_error(timeout: float, unfinished: list[int], stacks: dict[int, str], log_dir: str,
                  **how: Any) -> WorkerTimeout:
    """The WorkerTimeout for ranks that had not finished after `timeout` seconds
    (`runtime.stacks.describe_timeout` says what it says)."""
    message, in_collective = describe_timeout(timeout, unfinished, stacks, log_dir, **how)
    return WorkerTimeout(message, unfinished_ranks=unfinished, log_dir=log_dir, in_collective=in_collective)


def insert_hint(message: str, hint: str) -> str:
    """The message with `hint` as its second line."""
    first, _, rest = message.partition("\n")
    return f"{first}\n{hint}\n{rest}" if rest else f"{first}\n{hint}"
