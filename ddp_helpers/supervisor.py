"""Start a group of ranks, watch them, stop them: the loop that `launch` and the warm `Pool` share.

    with Supervisor(world_size) as ranks:         # a run folder, a rendezvous store, the output pipes
        job = WorkerJob(..., run_dir=ranks.run_dir, env=ranks.env)
        ranks.start(run_worker, (job,))            # world_size processes, forked from the forkserver
        outcome, detail = ranks.wait(deadline)     # every rank done, some failed, or the deadline passed
    # leaving the block stops every rank and what it started, and frees the port and the folder

The same shape as torch elastic's PContext (start, wait, close), for ranks on this machine.
While it waits it prints each rank's output as `[rank N] ...`.

Why it is built this way:
- Workers are forked from the *forkserver*: a fresh Python process (never a fork of the
  notebook kernel, which may have touched CUDA) that imports torch once; forking a copy of it
  is cheap, where spawn would import torch anew in every worker.
- The supervisor starts the rendezvous store (a `TCPStore` on 127.0.0.1, on a port the OS
  picks) in a process beside the ranks (`store_host`), in their private network (`private_net`),
  as torchrun's agent hosts one, and gives each worker the environment torchrun would give.
- Each rank's stdout and stderr come back through named pipes in the run folder; a full log
  per rank stays there.
"""
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import re
import signal
import sys
import time

import psutil
import torch.multiprocessing

from . import forkserver, machine, private_net
from .compat import loopback_interface
from .rank_io import MARK
from .run_dirs import new_run_dir, process_alive, release_run_dir
from .store_host import Rendezvous, StoreHost  # noqa: F401 (Rendezvous: used from here elsewhere)
from .worker import (error_file, no_group_file, omp_threads, rendezvous_file, result_file, stderr_pipe,
                     stdout_pipe)

STOP_GRACE_S = 2.0           # SIGTERM, then SIGKILL after this long
LOOK_AT_CHILDREN_S = 0.5     # how often wait() notes the processes the ranks started


class Supervisor:
    """`world_size` ranks on this machine: start, wait, stop. See the module docstring.

    env: extra environment variables for the ranks (checked here, before anything exists).
    quiet: keep the ranks' output out of the cell (it still goes to the logs).
    """

    def __init__(self, world_size, quiet=False, env=None):
        self.world_size = world_size
        self.processes = []
        self._context = None
        self._started = set()        # processes the ranks started, as last seen (psutil.Process)
        self._next_look = 0.0
        env = worker_env(world_size, 0, env)   # checks the settings first: nothing exists yet
        self._resources = contextlib.ExitStack()
        try:
            self.run_dir = new_run_dir()
            self._resources.callback(release_run_dir, self.run_dir)
            self.store = self._resources.enter_context(StoreHost())
            _say_once_if_not_private(self.store.private)
            self._resources.callback(remove_scratch, self.run_dir, world_size)
            self.output = OutputPump(self.run_dir, world_size, quiet)
            self._resources.callback(self.output.close)
        except BaseException:
            self._resources.close()
            raise
        self.port = self.store.port
        self.private_network = self.store.private is None   # see private_net
        self.env = {**env, "MASTER_PORT": str(self.port)}

    def start(self, target, args):
        """Start the ranks: `target(local_rank, *args)` in each."""
        forkserver.start()   # unless it runs already (started by an earlier launch or by `import ddp_helpers`)
        with main_script_not_rerun():
            self._context = torch.multiprocessing.start_processes(
                target, args=args, nprocs=self.world_size, join=False, start_method=forkserver.start_method())
        self.processes = self._context.processes

    def wait(self, deadline, replies=None, on_reply=None, finished=None, check=None):
        """Print the ranks' output until every rank is done, some failed, or `deadline`
        (a time.monotonic() value) has passed.

        Ranks that exit when done (launch): `finished(rank)` says whether an exited rank left
        its result; exiting otherwise, or with a non-zero code, is a failure.
        Ranks that stay up (the pool): `replies` maps each rank to the connection on which it
        answers once; `on_reply(rank, message)` sees each answer and may return an earlier
        deadline (one rank raised: the others get a little longer). Any exit is a failure.
        `check()`, called each time round, may name failed ranks the exits do not show.

        Returns ("done", None), ("failed", [ranks]) or ("timeout", [unfinished ranks]).
        """
        pending = dict(replies) if replies is not None else None
        closed = set()   # ranks whose connection ended: their exit is about to show
        # what the ranks started is noted while they run, from half a second on: a quick cell of a
        # warm pool costs no scan (its ranks say when they have children: note_started_processes)
        self._next_look = time.monotonic() + LOOK_AT_CHILDREN_S
        exited = {}
        # Whose exit status to ask for (each time a poll of the fork server's pipe): the ranks whose
        # sentinel is ready, as an exit makes it; every one when nothing at all was ready.
        look_at = ()
        while True:
            self._note_started_processes()
            for r in look_at:
                code = self.processes[r].exitcode
                if code is not None:
                    exited[r] = code
            if pending is not None:
                failed = sorted(exited)
            else:
                failed = sorted(r for r, code in exited.items()
                                if code != 0 or (finished is not None and not finished(r)))
            if not failed and check is not None:
                failed = check() or []
            if failed:
                return "failed", failed
            unfinished = (sorted(pending) if pending is not None
                          else [r for r in range(self.world_size) if r not in exited])
            if not unfinished:
                return "done", None
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", unfinished
            waiting = [conn for r, conn in (pending or {}).items() if r not in closed]
            sentinels = {p.sentinel: r for r, p in enumerate(self.processes) if r not in exited}
            ready = multiprocessing.connection.wait(waiting + self.output.fds() + list(sentinels),
                                                    timeout=min(left, 0.5))
            look_at = [sentinels[s] for s in ready if s in sentinels] if ready else list(sentinels.values())
            self.output.read([fd for fd in ready if isinstance(fd, int)])
            for rank, conn in list((pending or {}).items()):
                if conn not in ready:
                    continue
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    closed.add(rank)
                    continue
                del pending[rank]
                earlier = on_reply(rank, message) if on_reply is not None else None
                if earlier is not None:
                    deadline = min(deadline, earlier)

    def note_started_processes(self):
        """Note now what the running ranks started (a warm pool's rank that says it has children,
        after a cell): psutil reads every process on the machine to find them."""
        self._note_started_processes(now=True)

    def _note_started_processes(self, now=False):
        """Remember the processes the running ranks started (and what those started). A rank ends
        them itself when it finishes, but a rank that dies by a signal or os._exit cannot, and its
        orphans are no longer anybody's children we could ask for: stop() ends the ones noted here.
        (psutil.Process knows its start time, so a PID used again later is never signalled.)
        Unless `now`, at most every LOOK_AT_CHILDREN_S."""
        if not now and time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + LOOK_AT_CHILDREN_S
        started = {p for p in self._started if p.is_running()}
        for p in self.processes:
            if p.exitcode is None:
                with contextlib.suppress(psutil.Error):
                    started.update(psutil.Process(p.pid).children(recursive=True))
        self._started = started

    def gone(self):
        """Ranks whose process has ended although its exit status has not arrived yet: under the
        forkserver start method the status comes from the fork server, a moment later, and a rank
        killed by a signal can look alive when its peers' errors ("Connection reset") are already in."""
        return [r for r, p in enumerate(self.processes) if p.exitcode is None and not process_alive(p.pid)]

    def dump_stacks(self, ranks, wait_s=0.5):
        """Ask stuck ranks where they are (faulthandler on SIGUSR1) and print it."""
        for r in ranks:
            try:
                os.kill(self.processes[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            self.output.read(multiprocessing.connection.wait(self.output.fds(), timeout=0.05))

    def stop(self, grace_s=STOP_GRACE_S):
        """SIGTERM every rank still running and every process it started, SIGKILL what is left
        after `grace_s`, reap them all, print what they wrote last."""
        family = set(self._started)
        for p in self.processes:
            if p.exitcode is None:
                with contextlib.suppress(psutil.Error):
                    family.update(psutil.Process(p.pid).children(recursive=True))
                p.terminate()
        _signal_all(family, "terminate")
        deadline = time.monotonic() + grace_s
        while any(p.exitcode is None for p in self.processes) and time.monotonic() < deadline:
            live = [p.sentinel for p in self.processes if p.exitcode is None]
            self.output.read(multiprocessing.connection.wait(self.output.fds() + live, timeout=0.05))
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
            p.join()
        _, left = psutil.wait_procs(family, timeout=max(0.0, deadline - time.monotonic()))
        _signal_all(left, "kill")
        self.output.read(self.output.fds())

    def close(self):
        """Stop the ranks; free the port; remove pipes and result files (the logs stay)."""
        try:
            self.stop()
        finally:
            for path in getattr(self._context, "error_files", []):   # torch's, in $TMPDIR
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._resources.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _signal_all(processes, how):
    for p in processes:
        with contextlib.suppress(psutil.Error):
            getattr(p, how)()


@contextlib.contextmanager
def main_script_not_rerun():
    """multiprocessing re-runs the main script in every new process (as `__mp_main__`), so that the
    functions it pickled by name can be found there. A rank needs none of it: the function and
    everything it uses travel by value. So a script that calls `launch` without the
    `if __name__ == "__main__":` guard works (each rank re-ran it and launched again), and a script
    read from standard input (`python - < script.py`, a "<stdin>" that is no file) starts too."""
    real = multiprocessing.spawn.get_preparation_data

    def without_main(name):
        data = real(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = real


_said = []


def _say_once_if_not_private(reason):
    """One line at the first launch where the ranks could not get a network of their own."""
    if reason is None or reason == f"{private_net.SWITCH}=0" or _said:
        return
    _said.append(reason)
    print(f"ddp_helpers: the ranks use this machine's network ({reason}): other local users can "
          "connect to their ports (README: For instructors)", flush=True)


def interrupted(message):
    """The KeyboardInterrupt to raise after an interrupt stopped the ranks: IPython shows it as
    the one line `KeyboardInterrupt: <message>`, not as the frames of the launcher's plumbing."""
    exc = KeyboardInterrupt(message)
    exc._render_traceback_ = lambda: [f"KeyboardInterrupt: {message}"]
    return exc


def describe_exit(exitcode):
    """'was killed by signal SIGSEGV', 'exited with code 3 ...' for a worker's exit code."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (often the out-of-memory killer, or the launcher stopping it)" if name == "SIGKILL" else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {exitcode} without a Python exception"


def remove_scratch(run_dir, n):
    """Remove pipes, result and marker files; keep the logs."""
    for r in range(n):
        for path in (stdout_pipe(run_dir, r), stderr_pipe(run_dir, r), result_file(run_dir, r),
                     error_file(run_dir, r), no_group_file(run_dir, r), rendezvous_file(run_dir, r)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# ------------------------------------------------------ environment and store
def worker_env(world_size, master_port, extra_env=None):
    """The environment each worker gets: the kernel's own, plus what torchrun sets.

    RANK, LOCAL_RANK, GROUP_RANK and ROLE_RANK differ per rank; the worker adds them.
    A bad OMP_NUM_THREADS (the kernel's or in extra_env) is a ValueError here.
    """
    env = dict(os.environ)
    env.update(extra_env or {})
    threads = max(1, machine.cpu_count() // world_size)
    env.setdefault("OMP_NUM_THREADS", str(threads))  # torchrun would use 1; share the cores instead
    omp_threads(env["OMP_NUM_THREADS"])
    lo = loopback_interface()
    env.setdefault("GLOO_SOCKET_IFNAME", lo)   # Gloo and NCCL talk over loopback only
    env.setdefault("NCCL_SOCKET_IFNAME", lo)
    env.update({
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        # Like torchrun: workers connect to the store the launcher hosts instead of rank 0 creating one.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "ddp_helpers",
    })
    env.update(extra_env or {})
    return env


# ------------------------------------------------------------------- output
_LINE_ENDS = re.compile(rb"(\r\n|\r|\n)")
# In the ranks' private network no DNS server answers, so c10d's reverse lookup of a socket's own
# loopback address (as "::ffff:127.0.0.1") fails "temporarily" (EAI_AGAIN), and it warns on every
# connection. Harmless (it then uses the number): kept in the log, not shown in the cell.
_UNANSWERABLE_LOOKUP = re.compile(r"socket\.cpp:\d+\] \[c10d\] The hostname of the client socket cannot "
                                  r"be retrieved\. err=-3\n?$")


class OutputPump:
    """Reads each rank's stdout/stderr pipe and prints it as `[rank N] ...` lines.

    Named pipes (FIFOs) in the run folder: the workers open them by name, so no file
    descriptor has to travel through the forkserver. Lines wait for their end, so lines of
    different ranks never mix; what one read brings is printed in one write. A `\\r`
    (a progress bar redrawing its line) is passed on at once, the prefix after it.

    A line that carries a mime bundle (`rank_io.MARK`: a figure, an image, HTML) is displayed
    in the cell instead, after a `[rank N]` line. Where it all goes is the *sink*: `sink=`, or
    the one `output_sink(sink)` sets for a block of code, or `CellSink` (print, display).
    """

    def __init__(self, run_dir, world_size, quiet, sink=None):
        self.quiet = quiet
        self.sink = sink
        self.streams = {}     # fd -> _Stream
        self.logs = {}
        self._open_line = {"stdout": None, "stderr": None}   # the stream whose line is unfinished there
        for rank in range(world_size):
            self.logs[rank] = open(os.path.join(run_dir, f"rank{rank}.log"), "ab")
            for path, dest in ((stdout_pipe(run_dir, rank), "stdout"), (stderr_pipe(run_dir, rank), "stderr")):
                os.mkfifo(path, 0o600)
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                self.streams[fd] = _Stream(rank, dest)

    def fds(self):
        return list(self.streams)

    def read(self, ready):
        """Read what is waiting on the given fds, print it; return the number of bytes read."""
        total, printed, touched = 0, {"stdout": [], "stderr": []}, set()
        for fd in ready:
            stream = self.streams.get(fd)
            if stream is None:
                continue
            try:
                data = os.read(fd, 1 << 16)
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

    def _print(self, printed):
        if self.quiet:
            return
        sink = self.sink or (_sinks[-1] if _sinks else CellSink)
        for dest, pieces in printed.items():
            text = []
            for rank, piece in pieces + [(None, None)]:
                if isinstance(piece, str):
                    text.append((rank, piece))
                    continue
                if text:
                    sink.write(dest, text)
                    text = []
                if piece is not None:
                    sink.display(rank, piece.data, piece.metadata)

    def _take(self, stream, pieces, printed):
        for shown, logged in pieces:
            self.logs[stream.rank].write(logged)
            if not shown or (isinstance(shown, str) and _UNANSWERABLE_LOOKUP.search(shown)):
                continue
            owner = self._open_line[stream.dest]
            if owner is not None and isinstance(shown, _Display):
                printed[stream.dest].append((owner.rank, "\n"))   # end an open progress line first
            elif owner is not None and owner is not stream:
                if not shown.startswith("\r"):
                    shown = "\n" + shown   # another rank's progress line is open: start a new one
            printed[stream.dest].append((stream.rank, shown))
            self._open_line[stream.dest] = None if isinstance(shown, _Display) or shown.endswith("\n") else stream

    def end_lines(self):
        """End every unfinished line (a prompt, `print(..., end="")`) now, so that it is shown with
        this cell's output rather than joined to the next cell's first line (a warm pool's ranks
        outlive the cell)."""
        printed = {"stdout": [], "stderr": []}
        for stream in self.streams.values():
            self._take(stream, stream.finish(), printed)
            stream.after_cr = False
        self._print(printed)

    def drain(self):
        """Print everything the workers have written so far."""
        while self.read(self.fds()):
            pass

    def close(self):
        printed = {"stdout": [], "stderr": []}
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
    def write(dest, pieces):
        """pieces: [(rank, text with its `[rank N] ` prefixes)], in order."""
        out = sys.stdout if dest == "stdout" else sys.stderr
        out.write("".join(text for _, text in pieces))
        out.flush()

    @staticmethod
    def display(rank, data, metadata):
        shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
        if shell is None or not any(key != "text/plain" for key in data):
            text = data.get("text/plain", "").replace("\n", "\n" + " " * len(f"[rank {rank}] "))
            print(f"[rank {rank}] {text}", flush=True)
            return
        from IPython.display import display
        print(f"[rank {rank}]", flush=True)
        display(data, metadata=metadata, raw=True)


_sinks = []   # set by output_sink, innermost last


@contextlib.contextmanager
def output_sink(sink):
    """Send the output of the ranks started or run in this block to `sink` (see CellSink)."""
    _sinks.append(sink)
    try:
        yield sink
    finally:
        _sinks.remove(sink)


class _Display:
    """A mime bundle a rank sent on its stdout."""

    def __init__(self, data, metadata):
        self.data, self.metadata = data, metadata

    @classmethod
    def parse(cls, segment):
        """The bundle a marked line carries, or None for a line of text."""
        if not segment.startswith(_MARK):
            return None
        try:
            bundle = json.loads(segment[len(_MARK):])
            return cls(dict(bundle["data"]), dict(bundle.get("metadata") or {}))
        except (ValueError, KeyError, TypeError):
            return None


_MARK = MARK.encode()


class _Stream:
    """One rank's stdout or stderr: cut into lines, and `\\r` updates, each shown with the prefix."""

    def __init__(self, rank, dest):
        self.rank, self.dest = rank, dest
        self.prefix = f"[rank {rank}] "
        self.pending = b""       # the unfinished piece
        self.after_cr = False    # the unfinished piece redraws the line a `\r` started

    def feed(self, data):
        """[(text to show, bytes to log)] for what `data` completes; a redrawn line is shown at once."""
        parts = _LINE_ENDS.split(self.pending + data)
        self.pending = parts.pop()
        pieces = []
        for i in range(0, len(parts), 2):
            pieces.extend(self._pieces(parts[i], parts[i + 1]))
        redrawn = self.pending.split(b"\0")[0]   # not the start of a display's line
        if self.after_cr and redrawn:
            pieces.append((f"\r{self.prefix}{self._text(redrawn)}", b""))
        return pieces

    def finish(self):
        """What is left when the stream ends."""
        if not self.pending:
            return [("\n", b"") if self.after_cr else ("", b"")]
        pieces = self._pieces(self.pending, b"\n")
        self.pending = b""
        return pieces

    def _pieces(self, segment, end):
        """A line that carries a display: the text before its mark (a line left unfinished), then
        the display."""
        at = segment.find(_MARK) if end != b"\r" else -1
        shown = _Display.parse(segment[at:]) if at >= 0 else None
        if shown is None:
            return [self._piece(segment, end)]
        pieces = [self._piece(segment[:at], end)] if at > 0 else []
        self.after_cr = False
        return pieces + [(shown, f"[display: {', '.join(shown.data)}]\n".encode())]

    def _piece(self, segment, end):
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
    def _text(segment):
        return segment.decode("utf-8", "replace")
