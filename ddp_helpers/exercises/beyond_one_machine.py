"""Checker for notebook 11's exercise: the one torchrun command for every node of a 2-node job.

Pure text, no ranks: the command is split as a shell would and parsed with torchrun's own argument
parser and settings (`torch.distributed.run`), so what torchrun would refuse is refused here with its
own words, and each flag that differs from the job's is named.
"""
from __future__ import annotations

import contextlib
import io
import os
import shlex

from .verdict import Verdict

__all__ = ["check_torchrun_command"]


def _torchrun_config_problems(run, args):
    """What torchrun itself would refuse when it turns the parsed flags into its agent's settings
    (run.config_from_args), without touching this process's environment or log."""
    saved, was_disabled = dict(os.environ), run.logger.disabled
    run.logger.disabled = True   # its warnings (OMP_NUM_THREADS, ...) are not the learner's problem
    try:
        run.config_from_args(args)
    except (ValueError, AssertionError, RuntimeError) as err:
        return [f"torchrun would stop before starting anything: {err}"]
    finally:
        run.logger.disabled = was_disabled
        os.environ.clear()
        os.environ.update(saved)   # config_from_args sets OMP_NUM_THREADS
    return []


def check_torchrun_command(command: str) -> Verdict:
    """Notebook 11: the one torchrun command for every node of a job of 2 nodes x 4 GPUs that
    meets at node01:29500 through the c10d rendezvous, restarts up to 3 times, and trains with
    `-m ddp_helpers.train --checkpoint ckpt/epoch-{epoch}.pt --resume auto`.
    Parsed with torchrun's own argument parser. Pure text: no ranks needed."""
    from torch.distributed import run
    title = "torchrun command"
    if not isinstance(command, str) or not command.strip() or "..." in command:
        return Verdict(title, ["still the stub: write the whole command as one string"])
    try:
        words = shlex.split(command)
    except ValueError as err:
        return Verdict(title, [f"cannot split it like a shell would: {err}"])
    if "torch.distributed.launch" in words:
        return Verdict(title, ["python -m torch.distributed.launch is deprecated: use torchrun"])
    setting = [w for w in words if "=" in w and w.split("=")[0] in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")]
    if setting:
        return Verdict(title, [f"{setting[0]}: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and the store's "
                               f"address for every worker; do not set them yourself"])
    if words[0] == "torchrun":
        words = words[1:]
    elif words[1:3] == ["-m", "torch.distributed.run"]:
        words = words[3:]
    else:
        return Verdict(title, [f"start with torchrun (or python -m torch.distributed.run), not {words[0]!r}"])
    parser, errors = run.get_args_parser(), io.StringIO()
    parser.prog = "torchrun"
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(words)
    except SystemExit:
        refusal = errors.getvalue().strip().splitlines()[-1]
        hint = (" (options before the program are torchrun's; the program's own go after it)"
                if "unrecognized arguments" in refusal else "")
        return Verdict(title, [f"torchrun would refuse it: {refusal}{hint}"])
    if args.nproc_per_node in ("gpu", "cuda"):   # one process per GPU: 4 on these nodes. torchrun counts the GPUs
        args.nproc_per_node = "4"                 # when it starts, so it is checked as 4 (this machine may have none)
    problems = _torchrun_config_problems(run, args)
    if args.standalone:
        problems.append("--standalone is for one node only: it starts its own rendezvous on this machine")
    if args.nnodes not in ("2", "2:2"):
        problems.append(f"--nnodes should be 2 (the number of machines), got {args.nnodes}")
    if args.nproc_per_node != "4":
        hint = ": it counts the processes on each node, not in the whole job" if args.nproc_per_node == "8" else ""
        problems.append(f"--nproc-per-node should be 4 (one process per GPU), got {args.nproc_per_node}{hint}")
    if args.rdzv_backend != "c10d":
        problems.append(f"--rdzv-backend should be c10d, got {args.rdzv_backend}")
    if args.rdzv_endpoint != "node01:29500":
        problems.append(f"--rdzv-endpoint should be node01:29500 (the head node, where the agents meet), "
                        f"got {args.rdzv_endpoint or 'nothing'}")
    if any(w.split("=")[0] in ("--node-rank", "--node_rank") for w in words[:words.index(args.training_script)]):
        problems.append("leave out --node-rank: with c10d torchrun ignores it (each node's GROUP_RANK comes from "
                        "the rendezvous), and without it the command is the same on every node")
    if args.max_restarts != 3:
        problems.append(f"--max-restarts should be 3, got {args.max_restarts}")
    program = args.training_script_args
    if not (args.module and args.training_script == "ddp_helpers.train"):
        given = f"{'-m ' if args.module else ''}{args.training_script}"
        problems.append(f"run the module: -m ddp_helpers.train (got {given})")
    for flag, value in (("--checkpoint", "ckpt/epoch-{epoch}.pt"), ("--resume", "auto")):
        if flag not in program or program.index(flag) + 1 >= len(program) or program[program.index(flag) + 1] != value:
            problems.append(f"pass {flag} {value} to the training program, after the module name "
                            f"(options before it are torchrun's)")
    return Verdict(title, problems)

