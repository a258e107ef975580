"""Checker for notebook 12's exercise: the mean loss, with the collective every rank must join.

The learner's function runs on 2 and 3 Gloo ranks with every collective noted (`spies.noting_calls`)
and its printing captured: each rank's value, who printed, and whether every rank called the same
collectives in the same order (the bug of the exercise: a collective inside `if rank == 0`). Rank r's
loss is 1 + r in the public cases; a last case, drawn when the checker runs, gives the ranks random
losses (`runner.unseen`).
"""
from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import torch.distributed as dist

from . import runner
from .spies import COLLECTIVES, noting_calls
from .verdict import Verdict, close

__all__ = ["check_mean_loss"]


def _mean_loss_in_rank(fn, losses):
    """Inside a rank: fn(loss) with this rank's loss, every collective wrapped to note its name
    (outermost calls only). Returns (fn's result, the names in call order, what fn printed)."""
    printed = io.StringIO()
    with noting_calls(COLLECTIVES) as calls, contextlib.redirect_stdout(printed):
        result = fn(losses[dist.get_rank()])
    return result, calls, printed.getvalue()


def _draw_losses(rng):
    """2 to 4 ranks' losses, in eighths (their sums are exact), whose mean is not the public cases' (n + 1) / 2."""
    while True:
        losses = tuple(rng.randrange(4, 80) / 8 for _ in range(rng.randint(2, 4)))
        if sum(losses) != len(losses) * (len(losses) + 1) / 2:
            return losses


def check_mean_loss(fn: Callable[[float], float]) -> Verdict:
    """Notebook 12: `fn(loss)` returns the mean of every rank's loss on every rank, and only rank 0
    prints it. Checked on 2 and 3 ranks: the values, who printed, and that every rank called the same
    collectives in the same order (the bug of the exercise: a collective inside `if rank == 0`)."""
    title = "mean_loss"
    public = [tuple(1.0 + r for r in range(world_size)) for world_size in (2, 3)]
    unseen = runner.unseen(_draw_losses)
    check = runner.Checker(title, fn)
    problems = check.problems
    for losses in check.each(public, unseen, lambda losses: (_mean_loss_in_rank, len(losses), (fn, losses))):
        world_size = len(losses)
        label = check.label(f"world_size={world_size}" + (f", losses={list(losses)}" if check.drawn else ""))
        want = sum(losses) / world_size
        results = check.run(
            *check.planned, label,
            never_finished="they wait in a collective that another rank never calls. Is a collective inside "
                           "`if dist.get_rank() == 0`? Every rank must call every collective; only the print "
                           "belongs in the if",
            partner_left=": its partner had left without joining the collective. Is a collective inside "
                         "`if dist.get_rank() == 0`? Every rank must call every collective")
        if results is None:
            continue
        sequences = [calls for _, calls, _ in results]
        if any(seq != sequences[0] for seq in sequences):
            rank = next(r for r, seq in enumerate(sequences) if seq != sequences[0])
            problems.append(f"{label}: rank 0 called {sequences[0] or 'no collective'}, rank {rank} called "
                            f"{sequences[rank] or 'no collective'}: every rank must call the same collectives in "
                            f"the same order (a mismatch hangs, or mixes up data)")
            continue
        for rank, (value, _, _) in enumerate(results):
            number = type(value) in (int, float)
            if not number or not close(want, value, atol=1e-6):
                problems.append(f"{label}, rank {rank}: expected the mean loss {want:g}, got {value!r}"
                                + (" (the sum: divide by dist.get_world_size())"
                                   if number and close(want * world_size, value, atol=1e-6) else ""))
                break
        printers = [rank for rank, (_, _, out) in enumerate(results) if out.strip()]
        if printers != [0]:
            problems.append(f"{label}: rank(s) {printers or 'none'} printed; only rank 0 should print the mean")
    return check.verdict()

