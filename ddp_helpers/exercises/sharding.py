"""Checker for notebook 08's exercise: shard a tensor as FSDP2 does, and put it back together.

`check_shard_and_reassemble(shard_fn, reassemble_fn)` runs both on 2, 3 and 4 real ranks, with row
counts the world size divides and does not (down to fewer rows than ranks). Every rank's shard is
compared with the one FSDP2 keeps (`expected_shard`, the padded rows `torch.chunk` gives the rank,
taken before any of the learner's code runs), and the collectives of the reassembly are recorded
below torch.distributed's Python functions (`spies.CollectiveRecorder`), with their bytes: one
all-gather of the padded shards, nothing else. A last case, drawn when the checker runs
(`runner.unseen`), shards a tensor of random size and values.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import runner
from .spies import CollectiveRecorder
from .verdict import Verdict, difference

__all__ = ["check_shard_and_reassemble", "expected_shard", "full_tensor"]

# (world size, shape of the full tensor): dims the world size divides and dims it does not,
# including fewer rows than ranks (some ranks then hold nothing but padding)
_SHARD_CASES = [(2, (6, 3)), (2, (5, 2)), (3, (7,)), (4, (10, 3)), (4, (3, 5)), (4, (1, 2))]


def full_tensor(shape: tuple[int, ...], seed: int | None = None) -> torch.Tensor:
    """The tensor the checker shards: 1, 2, 3, ... (never 0, so padding is easy to tell apart); with a
    seed, whole numbers from 1 to 99 drawn at random."""
    if seed is not None:
        return torch.randint(1, 100, shape, generator=torch.Generator().manual_seed(seed)).float()
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def _draw_case(rng):
    """(world size, shape, seed): 1 to 9 rows (fewer than the ranks, sometimes), 1 or 2 dimensions."""
    shape = (rng.randint(1, 9),) + ((rng.randint(1, 4),) if rng.random() < 0.7 else ())
    return rng.randint(2, 4), shape, rng.randrange(2**40)


def expected_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """What FSDP2 keeps on `rank`: the rows torch.chunk(dim=0) gives it (torch.chunk makes chunks of
    ceil(rows / world_size) rows, and fewer chunks than ranks when rows are few), zero-padded at the
    end to that size, which every rank's shard has."""
    chunks = torch.chunk(full, world_size, dim=0)
    size = chunks[0].shape[0]
    mine = chunks[rank] if rank < len(chunks) else full[:0]
    return F.pad(mine, [0, 0] * (full.dim() - 1) + [0, size - mine.shape[0]])


def _shard_case_in_rank(shard_fn, reassemble_fn, shape, seed=None):
    """Inside a rank: the learner's shard, then the learner's reassembly of the true shard (taken
    before the learner's code runs), with every collective recorded as (name, bytes sent by this rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full = full_tensor(shape, seed)
    true_shard = expected_shard(full, rank, world_size)
    try:
        shard = shard_fn(full.clone(), rank, world_size)
    except NotImplementedError:
        raise
    except Exception as err:
        return {"shard_error": f"{type(err).__name__}: {err}"}
    recorder = CollectiveRecorder()
    try:
        with recorder:
            got = reassemble_fn(true_shard.clone(), full.shape[0])
        error = None
    except NotImplementedError:
        raise
    except Exception as err:
        got, error = None, f"{type(err).__name__}: {err}"
    return {"shard": shard, "calls": recorder.calls, "full": got, "error": error}


def _shard_problems(result, rank, world_size, full, want):
    """What is wrong on one rank, or None; `full` and `want` (this rank's shard) are the checker's."""
    if "shard_error" in result:
        return f"my_shard raised {result['shard_error']}"
    real_rows = max(0, min(want.shape[0], full.shape[0] - rank * want.shape[0]))
    problem = difference(want, result["shard"], dtype=True, zero="padding")
    if problem:
        shard = result["shard"]
        if isinstance(shard, torch.Tensor) and shard.shape[:1] == (real_rows,) != want.shape[:1]:
            problem += (f" (torch.chunk gives rank {rank} {real_rows} row(s); pad with zeros to {want.shape[0]}, "
                        f"so that every rank's shard has the same size for the all-gather)")
        return f"my_shard: {problem}"
    if result["error"]:
        return f"my_reassemble raised {result['error']}"
    problem = difference(full, result["full"], dtype=True, zero="padding")
    calls = result["calls"]
    shard_bytes = want.numel() * want.element_size()
    others = [name for name, _ in calls if not name.startswith("all_gather")]
    gathers = [(name, n) for name, n in calls if name.startswith("all_gather")]
    if others:
        return (f"my_reassemble called dist.{others[0]}: FSDP rebuilds a parameter with one all-gather, "
                f"nothing else")
    if not gathers:
        return "my_reassemble made no collective call: the other ranks' rows can only come from an all-gather"
    if len(gathers) > 1:
        return f"my_reassemble called an all-gather {len(gathers)} times: one call for the whole tensor is enough"
    name, sent = gathers[0]
    if sent != shard_bytes:
        return (f"my_reassemble's all-gather sent {sent} bytes from this rank; the padded shard is "
                f"{shard_bytes} bytes: gather the padded shards, then drop the padding")
    return f"my_reassemble: {problem}" if problem else None


def check_shard_and_reassemble(shard_fn: Callable[[torch.Tensor, int, int], torch.Tensor],
                               reassemble_fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Verdict:
    """Notebook 08: `shard_fn(full, rank, world_size)` returns this rank's padded dim-0 shard, as
    FSDP2 stores it; `reassemble_fn(shard, rows)` (inside a rank) returns the full tensor from one
    all-gather of the padded shards, padding dropped. Checked on real ranks, for world sizes and
    row counts that divide and that do not, with every collective recorded (calls and bytes)
    below torch.distributed's Python functions. Reference solution: ddp_helpers/solutions.py,
    solution_shard and solution_reassemble."""
    title = "my_shard + my_reassemble"
    cases, unseen = [case + (None,) for case in _SHARD_CASES], runner.unseen(_draw_case)
    wants = {}
    for world_size, shape, seed in cases + unseen:   # before any of the learner's code runs
        full = full_tensor(shape, seed)
        wants[world_size, shape, seed] = full, [expected_shard(full, rank, world_size) for rank in range(world_size)]
    check = runner.Checker(title, stub="still raises NotImplementedError: fill in the stubs")
    for world_size, shape, seed in check.each(
            cases, unseen, lambda case: (_shard_case_in_rank, case[0], (shard_fn, reassemble_fn, *case[1:]))):
        label = check.label(f"world_size={world_size}, shape {shape}")
        results = check.run(
            *check.planned, label, timeout=20,
            never_finished="every rank must make the same collective calls, with shards of the same size")
        if results is None:
            continue
        full, shards = wants[world_size, shape, seed]
        for rank, result in enumerate(results):
            problem = _shard_problems(result, rank, world_size, full, shards[rank])
            if problem:
                check.problems.append(f"{label}, rank {rank}: {problem}")
                break
    return check.verdict()
