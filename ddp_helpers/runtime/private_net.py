"""A network of the ranks' own, which nobody else on the machine can reach.

On a machine shared by a class (one JupyterHub server, say), every listening socket of a launch is
on 127.0.0.1, and any local user can connect to 127.0.0.1: the rendezvous store (a TCPStore, which
has no authentication) and the ranks' Gloo sockets included. So the ranks live in a **network
namespace** of their own (Linux): a copy of the network stack with only a loopback interface in it.
Their 127.0.0.1 is theirs alone; they reach each other, and nothing outside reaches them.

`enter()` moves the calling process into a new network namespace, with loopback up. The fork server
that every rank is forked from (`forkserver`) calls it once as it starts, so every rank, and the
rendezvous store that the launcher starts beside them, is born inside it. Making a network namespace
needs privilege; a user without it makes a user namespace first, in which it has that privilege,
with its own user and group ids mapped to themselves (files keep their owner). The same as
`unshare --user --map-current-user --net` and `ip link set lo up`, without those two programs.

The price: the ranks have no network beyond their own loopback. Download what they need in the
notebook first (the course's data code does), or turn this off with DDP_HELPERS_PRIVATE_NET=0.
Where Linux refuses (another OS, a container that forbids namespaces), the ranks share the
machine's loopback as before, and the first launch says so in one line.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
import sys
from typing import NoReturn

SWITCH = "DDP_HELPERS_PRIVATE_NET"     # "0": the ranks use the machine's own network
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def wanted() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def enter() -> str | None:
    """Move this process into a new network namespace with loopback up. Returns None when done, or
    the reason it could not (the process is then unchanged). Call it while the process has one thread."""
    if not wanted():
        return f"{SWITCH}=0"
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's ({sys.platform} has none)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWNET) != 0:   # root (or CAP_SYS_ADMIN) can make one directly
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            return f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError as exc:   # the namespaces exist now: without the maps we would be "nobody"
            return _give_up(f"mapping the user ids failed: {exc}")
    try:
        loopback_up()
    except OSError as exc:
        return _give_up(f"bringing loopback up failed: {exc}")
    return None


def loopback_up(name: bytes = b"lo") -> None:
    """`ip link set lo up`, as the ioctl that ip makes: a new namespace's loopback starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", name, 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", name, flags | IFF_UP, b""))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _give_up(reason: str) -> NoReturn:
    """A namespace we cannot use: this process must not go on in it (its ranks could not reach each
    other), and it cannot leave it. The fork server exits; the launcher then says why."""
    print(f"ddp_helpers: {reason}; set {SWITCH}=0 to run the ranks on the machine's network",
          file=sys.stderr, flush=True)
    os._exit(3)
