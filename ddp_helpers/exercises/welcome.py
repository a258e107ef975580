"""Checker for notebook 00's exercise (re-exported by `ddp_helpers.exercises`): the slowest rank.

The learner's function runs on 2, 3 and 4 Gloo ranks with every collective noted
(`spies.noting_calls`): each rank's answer, and the collectives each rank called. After the public
cases, one drawn at random when the checker runs (`runner.unseen`): an answer that looks the public
times up fails it.
"""
from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .spies import COLLECTIVES, noting_calls
from .verdict import Verdict, close

__all__ = ["check_slowest_rank", "SLOWEST_RANK_CASES"]

# Each case: the seconds every rank measured (rank r holds entry r). The last has a tie: two ranks
# share the slowest time, and the lower rank number is the answer.
SLOWEST_RANK_CASES = [(0.25, 0.75), (0.5, 0.125, 0.375), (0.41, 0.12, 0.77, 0.35), (0.3, 0.9, 0.2, 0.9)]


def _draw_case(rng):
    """2 to 4 ranks' times, in hundredths of a second, with a tie for the slowest half the time."""
    times = [rng.randrange(1, 100) / 100 for _ in range(rng.randint(2, 4))]
    if rng.random() < 0.5:
        slowest = times.index(max(times))
        times[rng.choice([r for r in range(len(times)) if r != slowest])] = max(times)
    return tuple(times)


def _slowest_in_rank(fn, seconds_per_rank):
    """Inside a rank: fn(this rank's seconds, a 1-element float32 tensor), every collective wrapped to
    note its name (outermost calls only). Returns (what fn returned, made plain: a (float, int) pair,
    or a string saying what came back instead; the collectives' names in call order)."""
    seconds = torch.tensor([seconds_per_rank[dist.get_rank()]], dtype=torch.float32)
    with noting_calls(COLLECTIVES) as calls, contextlib.redirect_stdout(io.StringIO()):
        result = fn(seconds.clone())
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"{type(result).__name__} {result!r}"[:80], list(calls)
    try:
        time_s, rank = (float(result[0].item() if isinstance(result[0], torch.Tensor) else result[0]),
                        int(result[1].item() if isinstance(result[1], torch.Tensor) else result[1]))
    except (TypeError, ValueError, RuntimeError):
        return f"{result!r}"[:80], list(calls)
    return (time_s, rank), list(calls)


def _expected(seconds_per_rank):
    """(the slowest time as float32 holds it, the lowest rank that has it, whether ranks tie, each rank's own)."""
    times = torch.tensor(seconds_per_rank, dtype=torch.float32).tolist()
    slowest = max(times)
    return slowest, times.index(slowest), times.count(slowest) > 1, times


def check_slowest_rank(fn: Callable[[torch.Tensor], tuple[float, int]]) -> Verdict:
    """Notebook 00: `fn(seconds)` gets this rank's measured time (a 1-element float32 tensor) and
    returns `(slowest_seconds, slowest_rank)`, the same on every rank: the largest time of all ranks
    and the rank that measured it (the lowest such rank on a tie), computed with `dist.all_reduce`
    only (at most 2 calls). Checked on 2, 3 and 4 ranks, one case with a tie: each rank's answer and
    the collectives each rank called."""
    title = "slowest_rank"
    unseen = runner.unseen(_draw_case)
    wants = {seconds: _expected(seconds) for seconds in SLOWEST_RANK_CASES + unseen}
    check = runner.Checker(title, fn)
    problems = check.problems
    for seconds_per_rank in check.each(SLOWEST_RANK_CASES, unseen,
                                       lambda times: (_slowest_in_rank, len(times), (fn, times))):
        world_size = len(seconds_per_rank)
        label = check.label(f"world_size={world_size}, seconds={list(seconds_per_rank)}")
        results = check.run(
            *check.planned, label,
            never_finished="they wait in a collective that another rank never calls. Is a collective "
                           "inside an `if`? Every rank must call every collective, in the same order",
            partner_left=": its partner had left without joining the collective. Is a collective inside "
                         "an `if`? Every rank must call every collective")
        if results is None:
            continue
        calls = [names for _, names in results]
        others = sorted({name for names in calls for name in names if name != "all_reduce"})
        if others:
            problems.append(f"{label}: the ranks called dist.{', dist.'.join(others)}: use dist.all_reduce "
                            f"only, with op=dist.ReduceOp.MAX (or MIN), which moves one number per call")
            continue
        if not any(calls):
            problems.append(f"{label}: no rank called a collective, so no rank knows the others' times: "
                            f"use dist.all_reduce")
            continue
        most = max(len(names) for names in calls)
        if most > 2:
            problems.append(f"{label}: a rank called dist.all_reduce {most} times: two calls are enough "
                            f"(the largest time, then the rank that has it)")
            continue
        want_s, want_rank, tie, mine = wants[seconds_per_rank]
        for rank, (got, _) in enumerate(results):
            if isinstance(got, str):
                problems.append(f"{label}, rank {rank}: expected a pair (slowest_seconds, slowest_rank), "
                                f"got {got}")
                break
            got_s, got_rank = got
            if not close(want_s, got_s, atol=1e-6):
                why = (" (its own time: the others' never reached it)" if close(mine[rank], got_s, atol=1e-6)
                       else " (a sum? use op=dist.ReduceOp.MAX)" if close(sum(seconds_per_rank), got_s, atol=1e-5)
                       else "")
                problems.append(f"{label}, rank {rank}: expected the slowest time {want_s:g}, got {got_s:g}{why}")
                break
            if got_rank != want_rank:
                why = (" (its own rank number)" if got_rank == rank and rank != want_rank else "")
                if tie:
                    why += ("; ranks share the slowest time here: return the lowest of them "
                            "(ReduceOp.MIN over the ranks that have it)")
                problems.append(f"{label}, rank {rank}: the time is right, but the slowest rank is "
                                f"{want_rank}, not {got_rank}{why}")
                break
    return check.verdict()
