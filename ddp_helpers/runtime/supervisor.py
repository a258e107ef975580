"""Start a group of ranks, watch them, stop them: the loop that `launch` and the warm `Pool` share.

    with Supervisor(world_size) as ranks:         # a run folder, a rendezvous store, the output pipes
        job = WorkerJob(..., run_dir=ranks.run_dir, env=ranks.env)
        ranks.start(run_worker, (job,))            # world_size processes, forked from the forkserver
        outcome, detail = ranks.wait_for_exits(deadline)   # every rank done, some failed, or the deadline passed
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
- Each rank's stdout and stderr come back through named pipes in the run folder, which one
  `output.OutputPump` reads while the supervisor waits: for the ranks to exit (`launch`), or for
  their replies (the warm pool); a full log per rank stays there.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any, Literal

import psutil
import torch.multiprocessing

from . import forkserver, private_net, processes
from .debug_session import DebugServer
from .output import OutputPump
from .rank_env import worker_env
from .rank_pdb import SOCKET_ENV
from .run_dirs import new_run_dir, release_run_dir, remove_scratch
from .store_host import StoreHost

STOP_GRACE_S = 2.0           # SIGTERM, then SIGKILL after this long
LOOK_AT_CHILDREN_S = 0.5     # how often the waits note the processes the ranks started


class Supervisor:
    """`world_size` ranks on this machine: start, wait, stop. See the module docstring.

    env: extra environment variables for the ranks (checked here, before anything exists).
    quiet: keep the ranks' output out of the cell (it still goes to the logs).
    """

    def __init__(self, world_size: int, quiet: bool = False, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.processes: list[Any] = []   # multiprocessing's process objects, one per rank
        self._context: Any = None
        self._started: set[psutil.Process] = set()      # processes the ranks started, as last seen (psutil.Process)
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
            self.debug = DebugServer(self.run_dir)   # the ranks' pdb prompts (rank_pdb)
            self._resources.callback(self.debug.close)
        except BaseException:
            self._resources.close()
            raise
        self.port = self.store.port
        self.private_network = self.store.private is None   # see private_net
        self.env = {**env, "MASTER_PORT": str(self.port)}
        if self.debug.path is not None:
            self.env[SOCKET_ENV] = self.debug.path

    def start(self, target: Callable[..., None], args: tuple) -> None:
        """Start the ranks: `target(local_rank, *args)` in each."""
        forkserver.start()   # unless it runs already (started by an earlier launch or by `import ddp_helpers`)
        with forkserver.main_script_not_rerun():
            self._context = torch.multiprocessing.start_processes(
                target, args=args, nprocs=self.world_size, join=False, start_method=forkserver.start_method())
        self.processes = self._context.processes

    def wait_for_exits(self, deadline: float, finished: Callable[[int], bool] | None = None,
                       check: Callable[[], list[int] | None] | None = None) -> tuple[str, list[int] | None]:
        """Print the ranks' output until every rank has exited, some failed, or `deadline` (a
        time.monotonic() value) has passed: for ranks that exit when done (launch).

        `finished(rank)` says whether an exited rank left its result; exiting otherwise, or with a
        non-zero code, is a failure. `check()`, called each time round, may name failed ranks the
        exits do not show.
        Returns ("done", None), ("failed", [ranks]) or ("timeout", [unfinished ranks]).
        """
        def failed(exited: dict[int, int]) -> list[int]:
            return sorted(r for r, code in exited.items() if code != 0 or (finished is not None and not finished(r)))

        def unfinished(exited: dict[int, int]) -> list[int]:
            return [r for r in range(self.world_size) if r not in exited]

        return self._pump(deadline, failed, unfinished, check=check)

    def wait_for_replies(self, deadline: float, replies: dict[int, Connection],
                         on_reply: Callable[[int, Any], float | None] | None = None,
                         stopped: frozenset = frozenset()) -> tuple[str, list[int] | None]:
        """Print the ranks' output until each rank in `replies` (rank -> the connection on which it
        answers once) has answered, some rank exited (ranks that stay up: any exit is a failure),
        or `deadline` has passed (`stopped`: ranks stopped on purpose, whose exit is none). `on_reply(rank,
        message)` sees each answer and may return an
        earlier deadline (one rank raised: the others get a little longer).
        Returns what `wait_for_exits` returns; "timeout" names the ranks that had not answered.
        """
        pending = dict(replies)
        closed: set[int] = set()   # ranks whose connection ended: their exit is about to show

        def take(ready: list[Any]) -> float | None:
            earliest: float | None = None
            for rank, conn in list(pending.items()):
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
                    earliest = earlier if earliest is None else min(earliest, earlier)
            return earliest

        return self._pump(deadline, lambda exited: sorted(set(exited) - stopped), lambda exited: sorted(pending),
                          waiting=lambda: [conn for r, conn in pending.items() if r not in closed], take=take)

    def _pump(self, deadline: float, failed: Callable[[dict[int, int]], list[int]],
              unfinished: Callable[[dict[int, int]], list[int]], check: Callable[[], list[int] | None] | None = None,
              waiting: Callable[[], list[Any]] | None = None,
              take: Callable[[list[Any]], float | None] | None = None) -> tuple[str, list[int] | None]:
        """The loop both waits share: note what the ranks started, print their output, see their
        exits; `failed(exited)` and `unfinished(exited)` ({rank: exit code} so far) say when it ends.
        `waiting()`: connections to wait on as well; `take(ready)` reads the ready ones and may
        return an earlier deadline."""
        # what the ranks started is noted while they run, from half a second on: a quick cell of a
        # warm pool costs no scan (its ranks say when they have children: note_started_processes)
        self._next_look = time.monotonic() + LOOK_AT_CHILDREN_S
        exited: dict[int, int] = {}
        # Whose exit status to ask for (each time a poll of the fork server's pipe): the ranks whose
        # sentinel is ready, as an exit makes it; every one when nothing at all was ready.
        look_at: list[int] = []
        while True:
            self._note_started_processes()
            for r in look_at:
                code = self.processes[r].exitcode
                if code is not None:
                    exited[r] = code
            gone = failed(exited)
            if not gone and check is not None:
                gone = check() or []
            if gone:
                return "failed", gone
            left_over = unfinished(exited)
            if not left_over:
                return "done", None
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", left_over
            sentinels = {p.sentinel: r for r, p in enumerate(self.processes) if r not in exited}
            watched = (waiting() if waiting else []) + self.output.fds() + list(sentinels) + self.debug.fds()
            ready = multiprocessing.connection.wait(watched, timeout=min(left, 0.5))
            look_at = [sentinels[s] for s in ready if s in sentinels] if ready else list(sentinels.values())
            self.output.read([fd for fd in ready if isinstance(fd, int)])
            self.debug.serve(ready, self.output.drain)   # a rank at a pdb prompt
            deadline += self.debug.take_paused()          # time at the prompt does not count
            earlier = take(ready) if take is not None else None
            if earlier is not None:
                deadline = min(deadline, earlier)

    def note_started_processes(self) -> None:
        """Note now what the running ranks started (a warm pool's rank that says it has children,
        after a cell): psutil reads every process on the machine to find them."""
        self._note_started_processes(now=True)

    def _note_started_processes(self, now: bool = False) -> None:
        """Remember the processes the running ranks started (and what those started). A rank ends
        them itself when it finishes, but a rank that dies by a signal or os._exit cannot, and its
        orphans are no longer anybody's children we could ask for: stop() ends the ones noted here.
        (psutil.Process knows its start time, so a PID used again later is never signalled.)
        Unless `now`, at most every LOOK_AT_CHILDREN_S."""
        if not now and time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + LOOK_AT_CHILDREN_S
        started = {p for p in self._started if p.is_running()}
        self._started = started | processes.children_of(p.pid for p in self.processes if p.exitcode is None)

    def gone(self) -> list[int]:
        """Ranks whose process has ended although its exit status has not arrived yet: under the
        forkserver start method the status comes from the fork server, a moment later, and a rank
        killed by a signal can look alive when its peers' errors ("Connection reset") are already in."""
        return [r for r, p in enumerate(self.processes) if p.exitcode is None and not processes.alive(p.pid)]

    def dump_stacks(self, ranks: Iterable[int], wait_s: float = 0.5) -> None:
        """Ask stuck ranks where they are (faulthandler on SIGUSR1) and print it."""
        for r in ranks:
            try:
                os.kill(self.processes[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            self.output.read(multiprocessing.connection.wait(self.output.fds(), timeout=0.05))

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every rank still running and every process it started, SIGKILL what is left
        after `grace_s`, reap them all, print what they wrote last."""
        running = [p for p in self.processes if p.exitcode is None]
        family = set(self._started) | processes.children_of(p.pid for p in running)
        for p in running:
            with contextlib.suppress(psutil.Error):
                family.add(psutil.Process(p.pid))
        processes.end_all(family, grace_s, pause=self._read_output)
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
            p.join()
        self.output.read(self.output.fds())

    def _read_output(self, timeout_s: float) -> None:
        """Print what the ranks write for up to `timeout_s`, returning early when a rank exits."""
        live = [p.sentinel for p in self.processes if p.exitcode is None]
        self.output.read(multiprocessing.connection.wait(self.output.fds() + live, timeout=timeout_s))

    def close(self) -> None:
        """Stop the ranks; free the port; remove pipes and result files (the logs stay)."""
        try:
            self.stop()
        finally:
            for path in getattr(self._context, "error_files", []):   # torch's, in $TMPDIR
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._resources.close()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


_said: list[str] = []


def _say_once_if_not_private(reason: str | None) -> None:
    """One line at the first launch where the ranks could not get a network of their own."""
    if reason is None or reason == f"{private_net.SWITCH}=0" or _said:
        return
    _said.append(reason)
    print(f"ddp_helpers: the ranks use this machine's network ({reason}): other local users can "
          "connect to their ports (README: For instructors)", flush=True)


def interrupted(message: str) -> KeyboardInterrupt:
    """The KeyboardInterrupt to raise after an interrupt stopped the ranks: IPython shows it as
    the one line `KeyboardInterrupt: <message>`, not as the frames of the launcher's plumbing."""
    exc = KeyboardInterrupt(message)
    exc._render_traceback_ = lambda: [f"KeyboardInterrupt: {message}"]  # type: ignore[attr-defined]
    return exc


def describe_exit(exitcode: int) -> str:
    """'was killed by signal SIGSEGV', 'exited with code 3 ...' for a worker's exit code."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (often the out-of-memory killer, or the launcher stopping it)" if name == "SIGKILL" else ""
        return f"was killed by signal {name}{hint}"
    return f"exited with code {exitcode} without a Python exception"
