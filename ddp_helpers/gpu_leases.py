"""Machine-wide GPU leases: on one GPU server shared by a class, NCCL ranks run on GPUs nobody else holds.

    with take(2, wait=0, what="launch") as lease:   # raises GpusBusy at once if 2 are not free
        ...start the ranks with lease.env...        # CUDA_VISIBLE_DEVICES: the leased GPUs only

`launch(backend="nccl"/"auto")` and the warm pool (`%ddp start -b nccl`) lease one GPU per rank before
any rank starts and give the ranks `CUDA_VISIBLE_DEVICES` naming those GPUs, so rank r's `cuda:r` is
its own leased GPU. A launch releases them when it returns, a pool when it stops; a kernel that ends,
even by SIGKILL, releases them too, because the kernel (not a rank) holds each lease's lock.

How a lease works:
- The folder: `DDP_HELPERS_GPU_LEASES`, default /tmp/ddp_helpers-gpu-leases; created mode 1777 as /tmp
  is (everyone may add files; only a file's owner, the folder's owner and root may remove them).
- A lease is a file of the holder's own, `<GPU key>.<random>.lease`, readable by all, with one line:
  user, pid, what holds it. The holder creates it under a temporary name, takes an exclusive
  `fcntl.flock` on it, then renames it into place: a lease file is locked from the moment it can be
  seen. The kernel drops a flock when the holder's last descriptor of it closes (the process ends).
- A GPU is taken when any lease file of its key is locked. Anyone can test that (a shared,
  non-blocking flock fails) and nobody can take it from its holder. The user a message names comes
  from the file's owner (the kernel's word), the pid from its text. After publishing its own, a taker
  looks again: two that published at once both back off and try again a moment later.
- Keys: the GPU's UUID (`nvidia-smi -L`), so the same GPU has the same key whatever a learner's or
  JupyterHub's `CUDA_VISIBLE_DEVICES` calls it; leases apply within the GPUs that variable leaves
  visible. Without nvidia-smi: the index after mapping CUDA_VISIBLE_DEVICES.

A squatter, another user who made the folder or files first, can block or fool no one beyond the
GPUs they really hold: a file they left unlocked is not a lease; one others cannot read, a link or
anything but a plain file is ignored; nobody can make a file under another's random name. A default
folder someone made unusable (not a directory, a link, not sticky and writable by all) is passed
over for the next of `<folder>-2` ... `<folder>-8`, the same one for every user. What the folder's
owner could still do (remove others' lease files) is why an instructor creates it as root (README).

`DDP_HELPERS_GPU_WAIT=SECONDS`: how long to wait for GPUs where a launch does not say (`gpu_wait=`);
0 by default (told at once). A test suite whose workers share one GPU sets it, so that they take turns.

`DDP_HELPERS_FAKE_GPUS=GPU-a,GPU-b` says which GPU UUIDs this machine has, in place of nvidia-smi:
for tests and for trying a class's setup on a machine without GPUs.
"""
from __future__ import annotations

import fcntl
import functools
import os
import pwd
import random
import re
import shutil
import stat
import subprocess
import time

from . import machine

FOLDER_VAR = "DDP_HELPERS_GPU_LEASES"
DEFAULT_FOLDER = "/tmp/ddp_helpers-gpu-leases"
FAKE_VAR = "DDP_HELPERS_FAKE_GPUS"
WAIT_VAR = "DDP_HELPERS_GPU_WAIT"   # seconds launch and the pool wait for GPUs when gpu_wait is not given
FALLBACKS = 8
RACE_TRIES = 5            # a lost race (two takers published at once) is tried again this often
POLL_S = 0.5              # while waiting for a GPU

_held = []   # this process's leases: what show() prints


class GpusBusy(RuntimeError):
    """Not enough free GPUs. `held`: [(GPU index, holder)]; `summary`: "1 of 2 GPUs are held: ..."."""

    def __init__(self, message, held, summary=""):
        super().__init__(message)
        self.held, self.summary = held, summary

    def _render_traceback_(self):   # IPython: the message, not the launcher's frames
        return [f"GpusBusy: {self}"]


# ------------------------------------------------------------------ which GPUs
def physical_gpus() -> list[str]:
    """UUIDs of this machine's GPUs in nvidia-smi's order (CUDA_VISIBLE_DEVICES ignored), [] if unknown."""
    fake = os.environ.get(FAKE_VAR)
    if fake is not None:
        return [u.strip() for u in fake.split(",") if u.strip()]
    return list(_nvidia_smi_uuids())


@functools.lru_cache(maxsize=1)
def _nvidia_smi_uuids():
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(re.findall(r"^GPU \d+:.*\(UUID: (GPU-[0-9a-fA-F-]+)\)", done.stdout, re.MULTILINE))


def visible_gpus(env: dict | None = None) -> list[tuple[str, str]]:
    """[(key, name)] of the GPUs CUDA would show this process (or ranks with `env`), in CUDA's order:
    `key` names the physical GPU in the lease folder, `name` is what CUDA_VISIBLE_DEVICES calls it."""
    wanted = (env or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    uuids = physical_gpus()
    if not uuids or "MIG-" in (wanted or ""):   # MIG slices: keyed by the names CUDA_VISIBLE_DEVICES gives
        count = machine.gpu_count()
        names = [str(i) for i in range(count)] if wanted is None else wanted.split(",")[:count]
        return [(n.strip() if n.strip().startswith(("GPU-", "MIG-")) else f"index{n.strip()}", n.strip())
                for n in names]
    if wanted is None:
        return [(u, u) for u in uuids]
    chosen = []
    for item in (i.strip() for i in wanted.split(",")):   # as CUDA reads it: up to the first bad entry
        match = ([uuids[int(item)]] if item.isdigit() and int(item) < len(uuids)
                 else [u for u in uuids if item.startswith("GPU-") and u.startswith(item)])
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return [(u, u) for u in chosen]


def default_wait() -> float:
    """$DDP_HELPERS_GPU_WAIT as seconds (0 when unset): e.g. a test suite whose workers share one GPU."""
    text = os.environ.get(WAIT_VAR, "").strip() or "0"
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{WAIT_VAR}={text!r}: give a number of seconds") from None


# ------------------------------------------------------------------ the folder
def folder(make: bool = True) -> str | None:
    """The lease folder every user of this machine finds (made if missing; with make=False, None
    where none is made yet: nobody has leased a GPU, and looking makes nothing)."""
    base = os.environ.get(FOLDER_VAR) or DEFAULT_FOLDER
    problems = []
    for path in [base] + [f"{base}-{i}" for i in range(2, FALLBACKS + 1)]:
        if not make and not os.path.lexists(path):
            return None
        problem = _usable(path)
        if problem is None:
            return path
        problems.append(f"{path}: {problem}")
    raise RuntimeError("no usable GPU lease folder: " + "; ".join(problems)
                       + f". Set {FOLDER_VAR} to a folder made with `install -d -m 1777 PATH` (as root).")


def _usable(path):
    """None if `path` is (or now is) a lease folder; else why not."""
    for _ in range(3):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            _make(path)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return "not a directory" + (" (a link)" if stat.S_ISLNK(st.st_mode) else "")
        if st.st_mode & 0o1007 != 0o1007:   # sticky, and others may list, add and enter
            return f"mode {stat.S_IMODE(st.st_mode):o}, not 1777 (made by {_user(st.st_uid)})"
        return None
    return "could not be made"


def _make(path):
    """mkdir mode 1777, atomically: made aside, chmodded, then renamed into place (never seen 0700)."""
    parent = os.path.dirname(path) or "."
    aside = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}.{random.getrandbits(32):x}")
    try:
        os.mkdir(aside, 0o700)
    except OSError:
        return
    try:
        os.chmod(aside, 0o1777)
        os.rename(aside, path)
    except OSError:
        os.rmdir(aside)


def _user(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# ------------------------------------------------------------------ leases
def holders(where: str, key: str, skip: str | None = None) -> list[dict]:
    """The live leases of GPU `key`: [{user, uid, pid, what}], testing each file's lock."""
    found = []
    for name in sorted(os.listdir(where)):
        if not (name.startswith(key + ".") and name.endswith(".lease")) or name == skip:
            continue
        try:
            fd = os.open(os.path.join(where, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue   # gone, unreadable or a link: not a lease anyone can see
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.read(fd, 200).decode(errors="replace").split()
                pid = int(text[1]) if len(text) > 1 and text[1].isdigit() else None
                found.append({"user": _user(st.st_uid), "uid": st.st_uid, "pid": pid,
                              "what": " ".join(text[2:]) or "?"})
                continue
            if st.st_uid == os.geteuid():   # our own, left by a process that ended: tidy it
                try:
                    os.unlink(os.path.join(where, name))
                except OSError:
                    pass
        finally:
            os.close(fd)
    return found


def _publish(where, key, what):
    """Our lease on `key`: (fd, name) if nobody else holds it, else None."""
    token = f"{os.getpid()}-{random.getrandbits(48):012x}"
    aside = os.path.join(where, f".{token}.new")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)   # readable by all whatever the umask: others must be able to test it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{_user(os.geteuid())} {os.getpid()} {what}\n".encode())
        name = f"{key}.{token}.lease"
        os.rename(aside, os.path.join(where, name))
    except BaseException:
        os.close(fd)
        _unlink(os.path.join(where, os.path.basename(aside)))
        raise
    return fd, name


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


class Lease:
    """GPUs this process holds: `env` gives ranks CUDA_VISIBLE_DEVICES naming them, in rank order."""

    def __init__(self, where, gpus, what):
        self.where, self.gpus, self.what = where, gpus, what   # gpus: [(index, key, name, fd, file)]
        self.env = {"CUDA_VISIBLE_DEVICES": ",".join(g[2] for g in gpus)}
        _held.append(self)

    @property
    def indices(self):
        return [g[0] for g in self.gpus]

    def release(self):
        if self in _held:
            _held.remove(self)
        for _, _, _, fd, name in self.gpus:
            _unlink(os.path.join(self.where, name))   # unlinked while still locked: nobody sees it stale
            os.close(fd)
        self.gpus = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __repr__(self):
        return f"Lease(GPUs {self.indices}, {self.what})"


def take(n: int, wait: float = 0, what: str = "launch", env: dict | None = None) -> Lease:
    """Lease `n` of the visible GPUs nobody holds; if fewer are free, wait up to `wait` seconds for
    them, then raise GpusBusy naming who holds the others."""
    gpus = visible_gpus(env)
    if len(gpus) < n:
        raise GpusBusy(f"{n} GPU(s) asked for, but {len(gpus)} visible", [])
    where = folder()
    deadline = time.monotonic() + wait
    while True:
        got, held = _try_take(where, gpus, n, what)
        if got is not None:
            return got
        if time.monotonic() >= deadline:
            summary = f"{len(held)} of {len(gpus)} GPUs are held: " + ", ".join(
                f"GPU {i} by {describe_holder(h)}" for i, h in held)
            waited = f" after waiting {wait:g} s" if wait else ""
            raise GpusBusy(f"{n} GPU(s) needed but {len(gpus) - len(held)} free{waited}: {summary}. Wait for "
                           "one with gpu_wait=SECONDS, use backend='gloo', or ask the holder to end their run "
                           "(a warm pool holds its GPUs until `%ddp stop`).", held, summary)
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def _try_take(where, gpus, n, what):
    """(Lease, None) with n GPUs, or (None, [(index, holder)] of the held ones)."""
    mine, held = [], []
    try:
        for index, (key, name) in enumerate(gpus):
            if len(mine) == n:
                break
            for attempt in range(RACE_TRIES):
                others = holders(where, key)
                if others:
                    held.append((index, others[0]))
                    break
                fd, file = _publish(where, key, what)
                mine.append((index, key, name, fd, file))
                if not holders(where, key, skip=file):
                    break
                mine.pop()
                _unlink(os.path.join(where, file))   # someone published at the same moment: both back off
                os.close(fd)
                time.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
    except BaseException:   # an interrupt while waiting for GPUs: let go of those taken so far
        Lease(where, mine, what).release()
        raise
    if len(mine) == n:
        return Lease(where, mine, what), None
    Lease(where, mine, what).release()
    return None, held


def describe_holder(h):
    mine = h["uid"] == os.geteuid() and h["pid"] == os.getpid()
    return f"{'you' if mine else h['user']} (pid {h['pid']}, {h['what']})"


def report() -> list[str]:
    """Lines: each visible GPU, and whether this process or whom holds it."""
    gpus = visible_gpus()
    if not gpus:
        return ["GPU leases: no GPU visible"]
    try:
        where = folder(make=False)   # a report makes no folder (the first of a class should be root's)
    except RuntimeError as exc:
        return [f"GPU leases: {exc}"]
    if where is None:
        return ["GPU leases: none taken yet (no lease folder)"] + [f"  GPU {index} ({name}): free"
                                                                  for index, (_, name) in enumerate(gpus)]
    ours = {g[1]: lease.what for lease in _held for g in lease.gpus}
    lines = [f"GPU leases ({where}, folder owned by {_user(os.lstat(where).st_uid)}):"]
    for index, (key, name) in enumerate(gpus):
        if key in ours:
            lines.append(f"  GPU {index} ({name}): held by this process ({ours[key]})")
            continue
        others = holders(where, key)
        state = f"taken by {describe_holder(others[0])}" if others else "free"
        lines.append(f"  GPU {index} ({name}): {state}")
    return lines


def show() -> None:
    """Print what this machine has and its GPU leases: the GPUs this process (a kernel: its launches
    and warm pool) holds, those other learners' runs hold, and those free."""
    print("\n".join([machine.summary_line(), *report()]))


class NoLease:
    """What ranks without NCCL hold: nothing."""
    env = {}
    gpus = []

    def release(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def for_ranks(backend: str, asked: str, world_size: int, wait: float, env: dict, what: str):
    """(backend, Lease) for ranks about to start: NCCL ranks get `world_size` leased GPUs, others a
    NoLease. `asked` "auto" falls back to Gloo, saying so, when the GPUs are there but held by others."""
    if backend != "nccl":
        return backend, NoLease()
    try:
        return backend, take(world_size, wait, what, env)
    except GpusBusy as exc:
        if asked != "auto" or not exc.held:
            raise
        print(f"ddp_helpers: backend='auto' chose gloo: {exc.summary}.", flush=True)
        return "gloo", NoLease()
