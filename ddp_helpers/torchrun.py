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
"""
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

PRIVATE_PORT = 29400  # inside a fresh network namespace, nothing else can hold it


@dataclasses.dataclass
class NodesResult:
    returncodes: list   # one per agent (node)
    logs: list          # what each agent and its workers printed
    private_network: bool

    @property
    def ok(self):
        return all(code == 0 for code in self.returncodes)


def private_network_available():
    """True where `unshare -rn` can give us a network namespace with only loopback in it."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True)
    return probe.returncode == 0


def torchrun_args(nnodes, nproc_per_node, endpoint, max_restarts=0, run_id="notebook"):
    """The torchrun options for one agent of a multi-node job (the same on every node)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]


def run_nodes(program, nnodes=2, nproc_per_node=2, max_restarts=0, timeout=180, env=None):
    """Start `nnodes` torchrun agents, each running `program` (e.g. ["-m", "ddp_helpers.train", ...])
    with `nproc_per_node` workers; wait for all of them; return their exit codes and output."""
    private = private_network_available()
    port = PRIVATE_PORT if private else _free_port()
    agent = torchrun_args(nnodes, nproc_per_node, f"127.0.0.1:{port}", max_restarts) + list(program)
    logdir = tempfile.mkdtemp(prefix="ddp_helpers-nodes-")
    logs = [os.path.join(logdir, f"node{n}.log") for n in range(nnodes)]
    codes = [os.path.join(logdir, f"node{n}.code") for n in range(nnodes)]
    # One shell starts every agent (so they share the namespace) and records each exit code.
    lines = ["ip link set lo up" if private else ":"]
    for n in range(nnodes):
        lines.append(f"({shlex.join(agent)} > {shlex.quote(logs[n])} 2>&1; echo $? > {shlex.quote(codes[n])}) &")
    lines.append("wait")
    script = "\n".join(lines)
    command = ["unshare", "-rn", "sh", "-c", script] if private else ["sh", "-c", script]
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    # A session of its own: on timeout or interrupt we end the agents and their workers, and only them.
    shell = subprocess.Popen(command, env=full_env, start_new_session=True)
    try:
        shell.wait(timeout=timeout)
    except BaseException:  # timeout, KeyboardInterrupt
        _end_session(shell)
        raise
    return NodesResult(returncodes=[_read_code(c) for c in codes], logs=[_read(p) for p in logs],
                       private_network=private)


def _end_session(shell):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(shell.pid, sig)
        except ProcessLookupError:
            return
        try:
            shell.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _read_code(path):
    text = _read(path).strip()
    return int(text) if text else None
