"""Run folders: one per launch (or per warm pool), holding its pipes, result files and logs.

Each rank's files there are named by `rank_file(run_dir, rank, kind)`, one kind per entry of
RANK_FILES; `remove_scratch` removes all but the logs when the run ends.

They live in `$TMPDIR/ddp_helpers-<uid>`, a folder of this user's that nobody else may write to
(result files are unpickled). When that name is taken (another user made it first, or a file is
there), one fallback folder of this user's, `$TMPDIR/ddp_helpers-<uid>-XXXXXXXX`, is made once and
used by every later process too, so that kernels leave no new folder behind. A run folder's name
records the process that made it (`run-HHMMSS-<pid>-<n>-...`); old ones are pruned, but never a run
still going on here or in another notebook kernel.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings

from .processes import alive

KEPT_RUN_DIRS = 20           # logs of the most recent finished launches kept on disk
_run_counter = itertools.count()
_run_dirs_lock = threading.Lock()
_live_run_dirs: set[str] = set()   # run folders of this process still in use (a launch running, a pool up)
# (temp dir, uid) -> this process's private root, when the usual one cannot be trusted
_fallback_roots: dict[tuple[str, int], str] = {}


RANK_FILES = {
    "stdout": "a named pipe: the rank writes its stdout there, the kernel reads it",
    "stderr": "the same for its stderr",
    "result": "what the rank's function returned (cloudpickle)",
    "error": "what it raised instead (an error_record.ErrorRecord as a plain dict, pickled)",
    "nogroup": "left by a rank of an init=False launch that returned without ever joining a process group",
    "rendezvous": "the address a rank waits on while it is in init_process_group (see `tutorials`)",
    "log": "everything the rank printed: kept after the run",
}


def rank_file(run_dir: str, rank: int, kind: str) -> str:
    """The path of one of a rank's files in a run folder: `kind` is a key of RANK_FILES."""
    if kind not in RANK_FILES:
        raise ValueError(f"no rank file of kind {kind!r}: one of {', '.join(RANK_FILES)}")
    return os.path.join(run_dir, f"rank{rank}.{kind}")


def remove_scratch(run_dir: str, world_size: int) -> None:
    """Remove the ranks' pipes, result and marker files; keep the logs."""
    for rank in range(world_size):
        for kind in RANK_FILES:
            if kind != "log":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(rank_file(run_dir, rank, kind))


def new_run_dir() -> str:
    """A new folder for one launch (or one pool's workers), in this user's private scratch root.

    It counts as live until `release_run_dir`; old folders are pruned (all but the newest
    KEPT_RUN_DIRS), but only released ones of this process and those of processes that are gone.
    """
    with _run_dirs_lock:
        root = run_root()
        _prune(root)
        pid = os.getpid()
        path = tempfile.mkdtemp(prefix=f"run-{time.strftime('%H%M%S')}-{pid}-{next(_run_counter)}-", dir=root)
        _live_run_dirs.add(path)
        return path


def release_run_dir(path: str) -> None:
    """The run in `path` is over: its folder (logs) may be pruned by later launches."""
    with _run_dirs_lock:
        _live_run_dirs.discard(path)


def run_root() -> str:
    """`$TMPDIR/ddp_helpers-<uid>`, made with mode 0700, if it is a real folder of this user that
    nobody else can write to; otherwise (planted by another user, a symlink, ...) the fallback
    (`_fallback_root`), with a warning. Result files in run folders are unpickled: nobody else may be
    able to put or rename anything there."""
    tmp, uid = tempfile.gettempdir(), os.getuid()
    root = os.path.join(tmp, f"ddp_helpers-{uid}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    problem = untrusted_folder(root, uid)
    if problem is None:
        return root
    fallback = _fallback_roots.get((tmp, uid))
    if fallback is None or untrusted_folder(fallback, uid) is not None:
        fallback = _fallback_root(tmp, uid)
        _fallback_roots[(tmp, uid)] = fallback
        warnings.warn(f"not using {root}: {problem}; run folders go to {fallback} instead", stacklevel=4)
    return fallback


def _fallback_root(tmp: str, uid: int) -> str:
    """The first `ddp_helpers-<uid>-*` folder in `tmp` that this user owns and nobody else can write
    to (an earlier process made it), or a new one (mkdtemp: 0700, ours). Another user can make a
    folder of that name, but not one that this user owns: theirs are passed over."""
    prefix = f"ddp_helpers-{uid}-"
    try:
        names = sorted(n for n in os.listdir(tmp) if n.startswith(prefix))
    except OSError:
        names = []
    for name in names:
        path = os.path.join(tmp, name)
        if untrusted_folder(path, uid) is None:
            return path
    return tempfile.mkdtemp(prefix=prefix, dir=tmp)


def untrusted_folder(path: str, uid: int) -> str | None:
    """Why `path` cannot hold this user's private files (run folders, the fork server's bytecode), or
    None when it can (then it is made mode 0700)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect it ({exc})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != uid:
        return f"it belongs to user id {st.st_uid}, not {uid}"
    if st.st_mode & 0o022:
        return f"other users can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    if stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(path, 0o700, follow_symlinks=False)  # e.g. 0755 from older versions: logs stay private
        except (OSError, NotImplementedError):
            pass
    return None


def _run_dir_owner(name: str) -> int | None:
    """PID recorded in a run folder's name (`run-HHMMSS-<pid>-<n>-...`), or None for other names."""
    parts = name.split("-")
    if len(parts) >= 5 and parts[0] == "run" and parts[2].isdigit() and parts[3].isdigit():
        return int(parts[2])
    return None


def _prune(root: str) -> None:
    """Delete all but the newest KEPT_RUN_DIRS finished run folders (caller holds _run_dirs_lock).
    Other processes prune the same root at the same time: anything may vanish meanwhile."""
    me = os.getpid()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    finished = []
    for name in names:
        path = os.path.join(root, name)
        owner = _run_dir_owner(name)
        if owner is None:
            if not name.startswith("run-"):
                continue  # not ours to delete
        elif owner == me:
            if path in _live_run_dirs:
                continue
        elif alive(owner):
            continue  # another process's run: it may still be going on, and it prunes its own
        try:
            finished.append((os.lstat(path).st_mtime, path))
        except FileNotFoundError:
            continue
    finished.sort()
    for _, stale in finished[:-KEPT_RUN_DIRS]:
        shutil.rmtree(stale, ignore_errors=True)
