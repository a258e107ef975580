"""Processes by PID: whether one is alive, and ending a group with everything it started.

A rank adopts the orphans of its family (`adopt_orphans`): a process that its code started, and that
left a child behind when it exited (a daemon's double fork, with `setsid`), would otherwise hand that
child to init, out of every tree followed here.

Three places end process trees: the supervisor (the ranks, and what they started), a rank at its
end (what its function started and left running), and `torchrun.run_nodes` (the agents and their
workers, which torchrun starts in sessions of their own, so no process group reaches them). They
all follow the tree down with psutil and use `end_all`. psutil.Process knows its start time, so a
PID used again by a new process is never signalled.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal
import sys
import time
from collections.abc import Callable, Iterable

import psutil

Pause = Callable[[float], object]


def alive(process: int | psutil.Process) -> bool:
    """Whether the process (a PID or a psutil.Process) is running. A zombie has exited: it only
    waits for its parent to read its exit status. One we may not look at is taken to be alive."""
    try:
        if not isinstance(process, psutil.Process):
            process = psutil.Process(process)
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    except psutil.Error:
        return False


def descendants(processes: Iterable[psutil.Process]) -> set[psutil.Process]:
    """Every live process whose parent, grandparent, ... is one of `processes`."""
    found = set()
    for p in processes:
        with contextlib.suppress(psutil.Error):   # it ended meanwhile
            found.update(p.children(recursive=True))
    return found


def children_of(pids: Iterable[int]) -> set[psutil.Process]:
    """What the processes with these PIDs started (and what those started), as far as they still run."""
    found = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.update(psutil.Process(pid).children(recursive=True))
    return found


def signal_all(processes: Iterable[psutil.Process], sig: int) -> None:
    """Send `sig` to each process; one that ended meanwhile is skipped."""
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def end_all(processes: Iterable[psutil.Process], grace_s: float, *, follow: bool = False,
            pause: Pause | None = None, reap_s: float = 5.0) -> None:
    """End `processes`: SIGTERM each, give them `grace_s` to exit, then SIGKILL what is left, and
    wait (at most `reap_s`) until they are gone (children of ours are reaped).

    follow: also end what they start meanwhile: the tree is followed down while they exit, and what
            is left is frozen with SIGSTOP before SIGKILL (a stopped process starts nothing new).
    pause:  called with a number of seconds while they exit (the supervisor prints their output
            then); by default time.sleep.
    """
    known = set(processes)
    signal_all(known, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(map(alive, known)):
        if follow:
            known |= descendants(known)
        (pause or time.sleep)(min(0.05, max(0.0, deadline - time.monotonic())))
    left = {p for p in known if alive(p)}
    while follow:   # freeze what is left, and what it started meanwhile
        signal_all(left, signal.SIGSTOP)
        new = descendants(left) - known
        if not new:
            break
        known |= new
        left |= new
    signal_all(left, signal.SIGKILL)
    psutil.wait_procs(known, timeout=reap_s)


def end_children(grace_s: float = 1.0) -> None:
    """End every process this one started (and what they started), SIGTERM first, then SIGKILL."""
    try:
        family = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    end_all(family, grace_s)


PR_SET_CHILD_SUBREAPER = 36   # linux/prctl.h


def adopt_orphans() -> bool:
    """Make this process the "child subreaper" of its descendants (Linux, prctl(2)): one whose
    parent exits is re-parented to this process instead of to init, and so stays among this
    process's children, where `end_children` finds it (even after `setsid`, which leaves the
    session and process group but not the tree). Returns whether it took effect (Linux 3.4 and
    later); elsewhere nothing changes. Descendants that exit after being adopted stay zombies
    until this process waits for them or ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
