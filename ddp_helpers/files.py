"""Writing a file so that a reader never sees half of it: the one atomic write of ddp_helpers.

The trainer's checkpoints, the data cache and the workers' result files all use it.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import re
import tempfile
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, shared: bool = False) -> Iterator[BinaryIO]:
    """`with atomic_write(path) as f: f.write(data)`: write to a temporary file of our own in the
    same folder, then rename it over `path` (atomic on one file system). A reader sees the old file
    or the new one; two writers never share a temporary file; on an error the temporary file is
    removed and the error raised.

    Only the owner may read the file (0600, a missing folder is made 0700), as with every file
    ddp_helpers writes, unless `shared`: then the folder is made 0777 and the file 0666, both less
    the umask, as for any file (for a group's folder, `chmod g+s`).
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o777 if shared else 0o700, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)  # 0600
    try:
        with os.fdopen(handle, "wb") as f:
            yield f
        if shared:
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)  # nothing left behind
        raise


def nearest_folder(folder: str | os.PathLike) -> pathlib.Path:
    """The folder, or its nearest ancestor that exists."""
    folder = pathlib.Path(folder)
    while not folder.exists():
        folder = folder.parent
    return folder


def why_unwritable(folder: str | os.PathLike) -> str | None:
    """Why no file can be made in `folder` (or in the nearest ancestor that exists, where the
    missing folders would be made), or None when one can."""
    near = nearest_folder(folder)
    if not near.is_dir():
        return f"cannot write in {near} (not a folder)"
    if not os.access(near, os.W_OK | os.X_OK):
        return f"cannot write in {near} (no permission, or a read-only file system)"
    # os.access says yes to root everywhere (/proc, /sys): try what saving will do, a folder and a file in it
    made = None
    try:
        made = tempfile.mkdtemp(prefix=".write-check-", dir=near) if near != pathlib.Path(folder) else None
        handle, probe = tempfile.mkstemp(prefix=".write-check-", dir=made or near)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        return f"cannot write in {near} ({err.strerror or err})"
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(made)
    return None


def newest_file(pattern: str) -> str | None:
    """Of the files `pattern` names ({epoch} in it, or one fixed name), the highest epoch's; or None."""
    return next(iter(files_by_epoch(pattern)), None)


def files_by_epoch(pattern: str) -> list[str]:
    """The files `pattern` names ({epoch} in it, or one fixed name), the highest epoch first."""
    parts = re.split(r"\{epoch(?::[^}]*)?\}", pattern)
    if len(parts) == 1:
        return [pattern] if os.path.isfile(pattern) else []
    number = re.compile(r"(\d+)".join(map(re.escape, parts)) + "$")
    found = {int(m.group(1)): path for path in glob.glob("*".join(map(glob.escape, parts)))
             if (m := number.match(path))}
    return [found[epoch] for epoch in sorted(found, reverse=True)]
