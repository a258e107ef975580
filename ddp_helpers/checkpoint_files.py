"""The trainer's checkpoint files: written whole and privately, checked whole before they are read.

`train.py` saves and loads the training state; this module holds what concerns the files themselves:
the up-front checks of a checkpoint name and a file to resume from, the private atomic write, and
the careful read: why a file cannot be read (empty, cut short, a changed byte, another program's).
"""
import errno
import io
import os
import stat
import zipfile
from collections.abc import Callable

import torch

from .files import atomic_write, files_by_epoch, nearest_folder, why_unwritable


def checkpoint_checks(template: str | None) -> list[tuple[bool, str]]:
    """The checkpoint name takes {epoch} only, and its folder (or the nearest that exists) must be writable."""
    if template is None:
        return []
    try:
        path = os.path.abspath(template.format(epoch=0))
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return [(False, f"checkpoint={template!r}: the name may hold {{epoch}} (the epoch's number), "
                        "nothing else")]
    if os.path.isdir(path):
        return [(False, f"checkpoint={template!r} is a folder: name a file in it, "
                        f"e.g. {os.path.join(template, 'epoch-{epoch}.pt')}")]
    why = ("it exists and is not a regular file (a device, a pipe or a socket): saving would replace it"
           if os.path.exists(path) and not os.path.isfile(path) else why_unwritable(os.path.dirname(path)))
    return [(why is None, f"checkpoint={template!r}: {why}")]


def resume_checks(path: str | None) -> list[tuple[bool, str]]:
    """A checkpoint named to resume from must be whole (not cut short, no byte changed)."""
    if path in (None, "auto") or not os.path.isfile(path):
        return []
    why = checkpoint_problem(path)
    return [(why is None, UnreadableCheckpoint(path, why).message)]


def write_privately(state: dict, path: str) -> None:
    """torch.save to a temporary file of our own, renamed over `path` (`files.atomic_write`): a
    reader sees the old file or the new one, never half of one. Only the owner may read it (0600,
    a new folder 0700) unless the learner chose a shared folder: one with the setgid bit
    (`chmod g+s`, as a group's folder is set up); there the umask decides, as for any file."""
    folder = os.path.dirname(os.path.abspath(path))
    shared = bool(nearest_folder(folder).stat().st_mode & stat.S_ISGID)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        with atomic_write(path, shared=shared) as f:
            f.write(buffer.getbuffer())  # a full disk raises ENOSPC here (torch.save hides it)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            message = f"checkpoint not saved: the disk is full ({folder})"
            raise OSError(errno.ENOSPC, message) from err
        raise


class UnreadableCheckpoint(ValueError):
    """A checkpoint this trainer cannot resume from: `why` says what is wrong with the file at `path`."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        self.message = f"resume={path!r}: this checkpoint cannot be read ({why})"
        super().__init__(self.message)


def checkpoint_problem(path: str) -> str | None:
    """Why the file at `path` is not a whole checkpoint, or None. torch.save writes a zip archive
    with a CRC-32 checksum for each of its parts: a file cut short has no directory at its end, and a
    changed byte fails its part's checksum (torch.load itself would load such weights without a word)."""
    try:
        if os.path.getsize(path) == 0:
            return "empty"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()   # reads every part
    except OSError as err:
        return err.strerror or str(err)
    except Exception as err:   # zipfile's errors for a file that is no whole zip archive
        return f"cut short or not a checkpoint: {err}"
    return None if bad is None else f"damaged: its part {bad} fails its checksum"


def load_whole(path: str, map_location: torch.device, keys: tuple[str, ...]) -> dict:
    """torch.load of a whole checkpoint (weights only: no code runs from the file) that holds at least
    `keys`; UnreadableCheckpoint says why not."""
    why = checkpoint_problem(path)
    if why is None:
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as err:
            why = f"torch.load: {(str(err).splitlines() or [type(err).__name__])[0][:200]}"
    if why is None:
        missing = [key for key in keys if not isinstance(state, dict) or key not in state]
        if not missing:
            return state
        has = f"it has {', '.join(map(repr, state))}" if isinstance(state, dict) else f"it is a {type(state).__name__}"
        why = f"not a checkpoint of this trainer: it has no {', '.join(map(repr, missing))} ({has})"
    raise UnreadableCheckpoint(path, why)


def newest_readable(pattern: str, read: Callable[[str], dict]) -> tuple[str | None, dict | None, str | None]:
    """Of the files `pattern` names, the newest that `read` can read: (path, state, a line naming those
    passed over, or None); (None, None, why) when none can be; (None, None, None) when there are none."""
    passed_over = []
    for path in files_by_epoch(pattern):
        try:
            state = read(path)
        except UnreadableCheckpoint as err:
            passed_over.append((path, err.why))
            continue
        said = ", ".join(f"{p} cannot be read ({why})" for p, why in passed_over)
        return path, state, f"resume auto: {said}; resuming from {path} instead" if passed_over else None
    if not passed_over:
        return None, None, None
    return None, None, (f"resume auto: no checkpoint that checkpoint={pattern!r} names can be read: "
                        + "; ".join(f"{p} ({why})" for p, why in passed_over)
                        + "; remove them to start from scratch")
