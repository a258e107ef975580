"""Real torchrun agents: two "nodes" meeting over c10d, a killed worker and a resumed run, clean timeouts.

Every agent runs through ddp_helpers.torchrun.run_nodes, inside a private network namespace
(torchrun's stores listen on every interface); where that namespace is not available these
tests skip rather than open ports on the machine.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import REPO, needs_mini, seconds

from ddp_helpers import files, launch, torchrun, train
from ddp_helpers.runtime.processes import alive as process_alive

needs_private_network = pytest.mark.skipif(not torchrun.private_network_available(),
                                reason="needs `unshare -rn` (a private network namespace) to run torchrun "
                                       "without opening ports on this machine")
ENV_LINE = re.compile(r"RANK=(\d+) LOCAL_RANK=(\d+) GROUP_RANK=(\d+) WORLD_SIZE=(\d+) LOCAL_WORLD_SIZE=(\d+) "
                      r"TORCHELASTIC_RESTART_COUNT=(\d+) TORCHELASTIC_USE_AGENT_STORE=True all_reduce\(ones\)=(\d+)")


@needs_private_network
def test_two_agents_are_two_nodes_of_one_job():
    out = torchrun.run_nodes(["-m", "ddp_helpers.env_report"], nnodes=2, nproc_per_node=2, timeout=seconds(90))
    assert out.ok, out.logs
    assert out.torchrun.startswith("torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:")
    nodes = [[tuple(map(int, m)) for m in ENV_LINE.findall(log)] for log in out.logs]
    assert all(len(lines) == 2 for lines in nodes), out.logs
    rows = sorted(row for lines in nodes for row in lines)
    assert [r[0] for r in rows] == [0, 1, 2, 3]                      # RANK: one job of 4
    for rank, local_rank, group_rank, world, local_world, restarts, total in rows:
        assert (world, local_world, restarts, total) == (4, 2, 0, 4)
        assert rank == group_rank * 2 + local_rank                  # node-major numbering
    for lines in nodes:                                             # each agent is one node
        assert sorted(r[1] for r in lines) == [0, 1] and len({r[2] for r in lines}) == 1
    assert sorted(lines[0][2] for lines in nodes) == [0, 1]          # GROUP_RANK 0 and 1


def test_standalone_needs_one_node():
    with pytest.raises(ValueError, match="nnodes must be 1"):
        torchrun.run_nodes(["-m", "ddp_helpers.env_report"], nnodes=2, standalone=True)


# 200 training images, 5 steps per epoch on each of 2 ranks, 15 steps in all; rank 1 dies at step 8.
FAULTY = ["--width", "16", "--per-class", "20", "--test-per-class", "10", "--batch-size", "20",
          "--epochs", "3", "--log-every", "5", "--fail-at-step", "8", "--fail-rank", "1"]
SAME_RUN = dict(width=16, per_class=20, test_per_class=10, batch_size=20, epochs=3, log_every=5, verbose=False)


@needs_private_network
@needs_mini
def test_killed_worker_restart_resumes_from_checkpoint_and_finishes(tmp_path):
    checkpoint = str(tmp_path / "epoch-{epoch}.pt")
    # One thread per worker, as torchrun sets by default (set here too, so that the uninterrupted
    # run below computes exactly the same); a fresh store for each restart (see notebook 11).
    env = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    start = time.monotonic()
    out = torchrun.run_nodes(["-m", "ddp_helpers.train", *FAULTY, "--checkpoint", checkpoint, "--resume", "auto"],
                             nnodes=1, nproc_per_node=2, max_restarts=1, standalone=True, timeout=seconds(120), env=env)
    log = out.logs[0]
    assert out.ok, log
    assert time.monotonic() - start < seconds(60)
    first, second = log.split("rank 1: injected fault at step 8: SIGKILL to myself")  # exactly once
    assert "resume auto: no checkpoint yet, starting from scratch" in first and "step 5/15" in first
    assert re.search(r"failed \(exitcode: -?\d+\) local_rank: [01]", second)  # torchrun saw a failure ...
    assert "restarted by torchrun: TORCHELASTIC_RESTART_COUNT=1" in second  # ... and restarted the group
    assert "resumed at step 5/15 (epoch 2)" in second and "step 15/15" in second
    accuracy = float(re.search(r"done: test accuracy ([\d.]+)%", second).group(1)) / 100
    assert accuracy > 0.2, log                                        # chance: 0.1

    final = torch.load(tmp_path / "epoch-2.pt", map_location="cpu", weights_only=True)
    assert (final["epoch"], final["step"]) == (2, 15)
    # The run that was never interrupted ends with exactly the same weights.
    whole = launch(train.run, world_size=2, kwargs=dict(SAME_RUN, checkpoint=str(tmp_path / "whole-{epoch}.pt")),
                   env={"OMP_NUM_THREADS": "1"}, timeout=seconds(60), quiet=True)[0]
    assert whole["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    reference = torch.load(tmp_path / "whole-2.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(final["model"][k], reference["model"][k]) for k in reference["model"])


HANGING_WORKER = textwrap.dedent("""
    import os, signal, subprocess, time
    if os.environ.get("STUBBORN") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # only SIGKILL ends it (and its child)
    child = subprocess.Popen(["sleep", "600"])          # a grandchild of the agent
    with open(os.path.join(os.environ["PID_DIR"], "rank" + os.environ["RANK"]), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()} {child.pid}")   # worker, its agent, its child
    time.sleep(600)
""")


def started_pids(folder, expected, wait_s=0.0):
    deadline = time.monotonic() + wait_s
    while len(os.listdir(folder)) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    names = os.listdir(folder)
    assert len(names) == expected, f"only {names} of {expected} workers started"
    return {int(pid) for name in names for pid in open(os.path.join(folder, name)).read().split()}


def wait_gone(pids, wait_s):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(map(process_alive, pids)):
        time.sleep(0.05)
    return sorted(pid for pid in pids if process_alive(pid))


@needs_private_network
def test_timeout_ends_every_agent_worker_and_child(tmp_path):
    script, pid_dir = tmp_path / "hang.py", tmp_path / "pids"
    script.write_text(HANGING_WORKER)
    pid_dir.mkdir()
    # long enough for every worker to start (2.7 s here: the agents import torch, the workers do not)
    start, timeout = time.monotonic(), seconds(4)
    with pytest.raises(torchrun.NodesTimeout) as timed_out:
        torchrun.run_nodes([str(script)], nnodes=2, nproc_per_node=2, timeout=timeout,
                           env={"PID_DIR": str(pid_dir), "STUBBORN": "1"})
    assert time.monotonic() - start < timeout + seconds(8)
    assert "every agent and worker was ended" in str(timed_out.value) and len(timed_out.value.logs) == 2
    pids = started_pids(pid_dir, expected=4)
    assert len(pids) == 2 + 4 + 4                       # 2 agents, 4 workers, 4 children
    assert wait_gone(pids, 0) == []                     # all gone when run_nodes returns


@needs_private_network
def test_agents_and_workers_end_when_the_caller_dies(tmp_path):
    script, pid_dir = tmp_path / "hang.py", tmp_path / "pids"
    script.write_text(HANGING_WORKER)
    pid_dir.mkdir()
    caller = subprocess.Popen([sys.executable, "-c", "from ddp_helpers import torchrun; torchrun.run_nodes("
                               f"[{str(script)!r}], nnodes=1, nproc_per_node=2, standalone=True, timeout=300)"],
                              env={**os.environ, "PID_DIR": str(pid_dir)})
    try:
        pids = started_pids(pid_dir, expected=2, wait_s=seconds(30))
    finally:
        caller.send_signal(signal.SIGKILL)   # like a notebook kernel that dies: no cleanup code runs
        caller.wait()
    assert wait_gone(pids, seconds(10)) == []         # the watchdog ended the agent, which ended its workers


# ------------------------------------------------------- no agents needed
def test_fault_and_resume_options_are_checked(capsys):
    cfg = train.parse_args(["--checkpoint", "c/e-{epoch}.pt", "--resume", "auto",
                            "--fail-at-step", "8", "--fail-rank", "1"])
    assert (cfg.resume, cfg.fail_at_step, cfg.fail_rank) == ("auto", 8, 1)
    for argv, message in [(["--resume", "auto"], "resume='auto' looks for the files checkpoint names"),
                          (["--fail-at-step", "0"], "fail_at_step=0: must be at least 1"),
                          (["--fail-rank", "-1"], "fail_rank must be >= 0")]:
        with pytest.raises(SystemExit) as done:
            train.parse_args(argv)
        assert done.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert "--fail-at-step FAIL_AT_STEP" in capsys.readouterr().out


def test_newest_file_is_the_highest_epoch(tmp_path):
    pattern = str(tmp_path / "run[1]" / "epoch-{epoch}.pt")   # glob characters in the folder name too
    assert files.newest_file(pattern) is None
    os.makedirs(tmp_path / "run[1]")
    for epoch in (2, 10, 9):
        (tmp_path / "run[1]" / f"epoch-{epoch}.pt").write_bytes(b"")
    (tmp_path / "run[1]" / "epoch-11.pt.tmp").write_bytes(b"")        # a write that never finished
    assert files.newest_file(pattern) == str(tmp_path / "run[1]" / "epoch-10.pt")
    fixed = tmp_path / "last.pt"
    assert files.newest_file(str(fixed)) is None
    fixed.write_bytes(b"")
    assert files.newest_file(str(fixed)) == str(fixed)


def test_slurm_example_is_a_valid_multi_node_torchrun_command():
    from torch.distributed import run
    text = open(os.path.join(REPO, "examples", "slurm_ddp.sbatch")).read()
    command = text[text.index("srun torchrun"):].replace("\\\n", " ")
    for name, value in [("$SLURM_NNODES", "2"), ("$head", "node01"), ("$SLURM_JOB_ID", "1234")]:
        command = command.replace(name, value)
    words = shlex.split(command)
    assert words[:2] == ["srun", "torchrun"]
    args = run.get_args_parser().parse_args(words[2:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint, args.max_restarts) == \
        ("2", "gpu", "c10d", "node01:29500", 3)
    assert "--node-rank" not in command and not args.standalone
    cfg = train.parse_args(args.training_script_args)
    assert args.module and args.training_script == "ddp_helpers.train"
    assert (cfg.resume, cfg.checkpoint) == ("auto", "checkpoints/1234/epoch-{epoch}.pt")
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text


def test_plain_takes_off_torchrun_log_prefixes():
    log = ("I1130 12:52:52.550000 3413 .venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/"
           "api.py:942] [default] Worker group FAILED. 1/1 attempts left; will restart worker group\n"
           "step 5/15  epoch 1\n")
    assert torchrun.plain(log) == ["[default] Worker group FAILED. 1/1 attempts left; will restart worker group",
                                   "step 5/15  epoch 1"]
    result = torchrun.NodesResult([0], [log], True, torchrun.torchrun_args(1, 2, "", standalone=True) + ["-m", "x"])
    assert result.ok and result.torchrun == ("torchrun --standalone --nproc-per-node=2 --max-restarts=0 "
                                             "--monitor-interval=0.5 -m x")


def test_the_agents_private_network_needs_no_ip_command(tmp_path, monkeypatch):
    # before: without `ip` (the GPU image has none) the agents ran on the machine's own network
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rn", "true"]).returncode != 0:
        pytest.skip("needs `unshare -rn` (a private network namespace)")
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("unshare", "sh", "sleep"):
        (tools / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(tools))   # everything the agents need, and no `ip`
    assert torchrun.private_network_available()
    out = torchrun.run_nodes(["-m", "ddp_helpers.env_report"], nnodes=1, nproc_per_node=1, timeout=seconds(60))
    assert out.ok and out.private_network, out.logs


def test_shell_lines_put_one_option_per_line_and_read_back_as_the_same_command():
    words = ["torchrun", "--nnodes=2", "--rdzv-endpoint=127.0.0.1:29400", "-m", "ddp_helpers.train",
             "--checkpoint", "/tmp/a b/epoch-{epoch}.pt", "--lr", "-0.1", "--resume", "auto"]
    text = torchrun.shell_lines(words)
    assert text.splitlines() == ["torchrun \\", "    --nnodes=2 \\", "    --rdzv-endpoint=127.0.0.1:29400 \\",
                                 "    -m ddp_helpers.train \\", "        --checkpoint '/tmp/a b/epoch-{epoch}.pt' \\",
                                 "        --lr -0.1 \\", "        --resume auto"]
    assert shlex.split(text.replace("\\\n", " ")) == words         # what a shell would run
    script = torchrun.shell_lines(["torchrun", "--standalone", "debug_me.py", "--steps", "3"])
    assert script.splitlines() == ["torchrun \\", "    --standalone \\", "    debug_me.py \\", "        --steps 3"]
    result = torchrun.NodesResult([0], [""], True, torchrun.torchrun_args(2, 4, "node01:29500") + ["-m", "x"])
    assert re.sub(r" \\\n +", " ", result.torchrun_lines) == result.torchrun
    assert max(map(len, result.torchrun_lines.splitlines())) < 40


@needs_private_network
def test_stdin_goes_to_node_0_and_its_workers_only(tmp_path):
    # notebook 12 types pdb commands into dist.breakpoint this way; every other agent reads /dev/null
    script = tmp_path / "echo_stdin.py"
    script.write_text("import sys\nprint('typed:', repr(sys.stdin.readline()), flush=True)\n")
    out = torchrun.run_nodes([str(script)], nnodes=2, nproc_per_node=1, stdin="p x\n", timeout=seconds(90))
    assert out.ok, out.logs
    assert "typed: 'p x\\n'" in out.logs[0] and "typed: ''" in out.logs[1], out.logs
