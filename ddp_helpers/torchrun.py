"""Run real `torchrun` agents from a notebook: several "nodes" on this one machine.

    from ddp_helpers import torchrun
    out = torchrun.run_nodes(["-m", "ddp_helpers.env_report"], nnodes=2, nproc_per_node=2)
    print(out.logs[0])        # what node 0's agent and its workers printed

Each node is one `torchrun` agent process; they meet through the c10d rendezvous
at 127.0.0.1, exactly as agents on different machines meet at HOST:PORT.

torchrun's rendezvous store listens on every network interface, not only on
127.0.0.1. So, where Linux allows it (`unshare -rn`), all the agents run in a
private network namespace of their own, in which loopback is the only
interface: nothing they open can be reached from outside, and any port is free.
Elsewhere they run on the machine itself, as torchrun normally does.

Nothing outlives the call: on timeout, error or interrupt every agent and every
worker is ended (found by PID, through the process tree: torchrun starts each
worker in a session of its own), and the agents end themselves if the process
that started them (the notebook's kernel) dies.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import psutil

from .runtime import private_net, processes

PRIVATE_PORT = 29400  # inside a fresh network namespace, nothing else can hold it


@dataclasses.dataclass
class NodesResult:
    returncodes: list[int | None]   # one per agent (node)
    logs: list[str]                 # what each agent and its workers printed
    private_network: bool
    command: list[str] = dataclasses.field(default_factory=list)  # what each agent ran

    @property
    def torchrun(self) -> str:
        """The agents' command as you would type it: `torchrun --nnodes=2 ... -m module ...`."""
        args = self.command[3:] if self.command[1:3] == ["-m", "torch.distributed.run"] else self.command
        return shlex.join(["torchrun", *args])

    @property
    def torchrun_lines(self) -> str:
        """The same command one option per line, as a shell continuation (`\\` at each line's end),
        so that it fits a notebook's width and can be copied as it is."""
        return shell_lines(shlex.split(self.torchrun))

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)


def shell_lines(words: list[str], indent: str = "    ") -> str:
    """A launcher's command as shell lines, one option per line, each but the last ending in a
    backslash; the program's own options (after `-m module` or a script) are indented once more:
    ["torchrun", "--nnodes=2", "-m", "x", "--epochs", "3"] ->
    "torchrun \\\n    --nnodes=2 \\\n    -m x \\\n        --epochs 3". Words are quoted for the shell.
    The launcher's options are taken to be flags or `--name=value` (as torchrun_args writes them);
    the program's may be `--name value`."""
    groups, program_from = [words[:1]], None
    for word in words[1:]:
        option = word.startswith("-") and not re.fullmatch(r"-[\d.]+", word)
        if program_from is None:            # still the launcher's options
            if groups[-1] == ["-m"]:
                groups[-1].append(word)
                program_from = len(groups)
            else:
                groups.append([word])
                if not option:              # a script: what follows is its arguments
                    program_from = len(groups)
        elif option or len(groups) == program_from:
            groups.append([word])
        else:
            groups[-1].append(word)
    lines = [shlex.join(group) for group in groups]

    def deeper(i):
        return program_from is not None and i >= program_from

    return " \\\n".join(lines[:1] + [indent * (1 + deeper(i)) + line
                                      for i, line in enumerate(lines[1:], start=1)])


_LOG_PREFIX = re.compile(r"^[DIWEF]\d{4} [\d:.]+ \d+ \S+:\d+\] ")


def plain(log: str) -> list[str]:
    """The lines of an agent's log, without the prefix of torchrun's own messages
    (level, date, time, PID, source file and line): "I1130 12:52:37.48 3357 api.py:553] x" -> "x"."""
    return [_LOG_PREFIX.sub("", line) for line in log.splitlines()]


def private_network_available() -> bool:
    """True where `unshare -rn` can give us a network namespace with only loopback in it."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", *loopback_up_command()], capture_output=True)
    return probe.returncode == 0


def loopback_up_command() -> list[str]:
    """`ip link set lo up` (a new namespace's loopback starts down), without needing `ip`: Python
    makes the same ioctl (`private_net.loopback_up`, a module of the standard library alone)."""
    folder = os.path.dirname(os.path.abspath(private_net.__file__))
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {folder!r}); "
                                  "import private_net; private_net.loopback_up()"]


def torchrun_args(nnodes: int, nproc_per_node: int, endpoint: str, max_restarts: int = 0, run_id: str = "notebook",
                  standalone: bool = False) -> list[str]:
    """The torchrun options for one agent of a multi-node job (the same on every node).
    standalone: one node, with its own rendezvous on a free local port (`--standalone`)."""
    where = (["--standalone"] if standalone else
             [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"])
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]


def run_nodes(program: list[str], nnodes: int = 2, nproc_per_node: int = 2, max_restarts: int = 0,
              timeout: float = 180, env: dict[str, str] | None = None, standalone: bool = False,
              stdin: str | None = None) -> NodesResult:
    """Start `nnodes` torchrun agents, each running `program` (e.g. ["-m", "ddp_helpers.train", ...])
    with `nproc_per_node` workers; wait for all of them; return their exit codes and output.

    max_restarts: how often an agent restarts its whole worker group after a worker fails.
    standalone:   `torchrun --standalone` (one node, nnodes must be 1).
    timeout:      seconds; then every agent and worker is ended and NodesTimeout raised
                  (its `logs` hold what the nodes printed until then).
    env:          extra environment variables for the agents and their workers.
    stdin:        text for node 0's standard input, which its workers inherit, as they would
                  inherit your terminal's (what you would type into, e.g., a debugger there);
                  by default every agent reads from /dev/null.
    """
    if standalone and nnodes != 1:
        raise ValueError(f"standalone means one node: nnodes must be 1, got {nnodes}")
    private = private_network_available()
    port = PRIVATE_PORT if private else _free_port()
    agent = torchrun_args(nnodes, nproc_per_node, f"127.0.0.1:{port}", max_restarts,
                          standalone=standalone) + list(program)
    logdir = tempfile.mkdtemp(prefix="ddp_helpers-nodes-")
    logs = [os.path.join(logdir, f"node{n}.log") for n in range(nnodes)]
    codes = [os.path.join(logdir, f"node{n}.code") for n in range(nnodes)]
    typed = os.path.join(logdir, "node0.stdin")
    with open(typed, "w") as f:
        f.write(stdin or "")
    # One shell starts every agent (so they share the namespace) and records each exit code.
    # A watchdog ends them all (SIGTERM: each agent then stops its workers) if we die.
    lines = [shlex.join(loopback_up_command()) if private else ":",
             f"(while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; kill -TERM 0) & watchdog=$!",
             "agents="]
    for n in range(nnodes):
        # TMPDIR: torchrun's own log folders land in ours, which we remove at the end.
        # An agent in the background reads /dev/null unless told otherwise (POSIX sh).
        given = f" < {shlex.quote(typed)}" if n == 0 and stdin is not None else ""
        lines.append(f"(TMPDIR={shlex.quote(logdir)} {shlex.join(agent)}{given} > {shlex.quote(logs[n])} 2>&1; "
                     f"echo $? > {shlex.quote(codes[n])}) &")
        lines.append('agents="$agents $!"')
    lines += ["wait $agents", "kill $watchdog 2>/dev/null", "exit 0"]
    script = "\n".join(lines)
    command = ["unshare", "-rn", "sh", "-c", script] if private else ["sh", "-c", script]
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    # A session of its own: on timeout or interrupt we end the agents and their workers, and only them.
    shell = subprocess.Popen(command, env=full_env, start_new_session=True)
    try:
        try:
            shell.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_all(shell)
            raise NodesTimeout(timeout, [_read(p) for p in logs]) from None
        except BaseException:  # KeyboardInterrupt (the notebook's Interrupt button)
            end_all(shell)
            raise
        return NodesResult(returncodes=[_read_code(c) for c in codes], logs=[_read(p) for p in logs],
                           private_network=private, command=agent)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


class NodesTimeout(TimeoutError):
    """The agents did not finish in time; all of them and their workers were ended.
    `logs`: what each node printed until then."""

    def __init__(self, timeout: float, logs: list[str]) -> None:
        tails = "".join(f"\n--- node {n}, last lines ---\n" + "\n".join(log.splitlines()[-5:])
                        for n, log in enumerate(logs))
        super().__init__(f"torchrun agents still running after {timeout:g} s: every agent and worker "
                         f"was ended.{tails}")
        self.timeout, self.logs = timeout, logs


def end_all(shell: subprocess.Popen, grace_s: float = 2.0) -> None:
    """End the shell, its agents and all their workers, and wait until they are gone.

    torchrun starts each worker in a session of its own, so signalling our session would
    miss them: we follow the process tree down from the shell instead (`processes.end_all`).
    First SIGTERM to all (an agent then stops its workers itself); after `grace_s`, whatever is
    left is frozen with SIGSTOP (a stopped agent cannot start new workers) and killed.
    """
    try:
        shell_process = psutil.Process(shell.pid)
    except psutil.NoSuchProcess:
        shell.wait()
        return
    family = {shell_process} | processes.descendants({shell_process})
    processes.end_all(family, grace_s, follow=True)
    shell.wait()   # reaped already (its status is then taken as 0): it is ended in any case


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):  # a process that ended meanwhile
        return ""


def _read_code(path):
    text = _read(path).strip()
    return int(text) if text else None
