"""Checker for notebook 05's exercise: average every gradient over the ranks with ONE all_reduce.

The learner's function runs on 2 and 3 Gloo ranks; each rank's local gradients and their true sum
(the real all_reduce) are taken before the learner's code runs. Every collective and p2p call is
noted (`spies.CallLog`): the number of all_reduce calls, the bytes each carried and its op, any other
collective, and the gradients written back, each wrong answer named. A last case, drawn when the
checker runs (`runner.unseen`), uses data no answer can have seen.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .spies import CallLog, op_name
from .verdict import Verdict, close, difference

__all__ = ["check_one_bucket_average"]


def _bucket_model():
    """The model the one-bucket checker uses: four gradients of different shapes (212 floats)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


NOT_ONE_ALL_REDUCE = ("reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
                       "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
                       "broadcast_object_list")


def _describe(name, args, kwargs):
    """An all_reduce as {"bytes", "op"}; any other call as its name."""
    if name != "all_reduce":
        return name
    tensor = args[0] if args else kwargs.get("tensor")
    op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
    return {"bytes": tensor.numel() * tensor.element_size(), "op": op_name(op)}


def _one_bucket_in_rank(fn, seed=1):
    """Inside a rank: local gradients from this rank's shard (of data made from `seed`), the true mean
    (computed with the real all_reduce before the learner's code runs), then fn(model) with
    dist.all_reduce wrapped to record every call's bytes and op."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _bucket_model()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g)
    shard = slice(rank * 24 // world_size, (rank + 1) * 24 // world_size)
    torch.nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    summed = [t.clone() for t in local]
    for t in summed:
        dist.all_reduce(t)
    log = CallLog()
    with log.watching(("all_reduce",) + NOT_ONE_ALL_REDUCE, describe=_describe):   # and any other call
        fn(model)
    calls = [note for note in log.notes if isinstance(note, dict)]
    others = [note for note in log.notes if not isinstance(note, dict)]
    return {"calls": calls, "others": others, "local": local, "summed": summed,
            "got": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
            "shapes": [tuple(p.shape) for p in model.parameters()]}


def _close(got, want):
    return close(want, got, rtol=1e-5, atol=1e-7)


def _one_bucket_problem(result, world_size):
    """What is wrong on one rank, or None."""
    calls, got, summed = result["calls"], result["got"], result["summed"]
    grad_bytes = sum(t.numel() * t.element_size() for t in result["local"])
    if result["others"]:
        used = sorted(set(result["others"]), key=result["others"].index)
        return (f"you called {', '.join(f'dist.{name}' for name in used)} ({len(result['others'])} call(s)) "
                f"besides {len(calls)} all_reduce(s): even when the numbers come out right, that is more "
                f"collectives (and more waiting) than needed; one all_reduce of one flat buffer gives every "
                f"rank the sum at once")
    if not calls:
        return ("you never called dist.all_reduce: each rank still has only its own gradients; "
                "all_reduce the flat buffer once")
    if len(calls) > 1:
        return (f"you called all_reduce {len(calls)} times (once per parameter?): flatten all gradients "
                f"into one buffer and all_reduce it once")
    nbytes = calls[0]["bytes"]
    if nbytes != grad_bytes:
        what = ("not all gradients are in the buffer" if nbytes < grad_bytes
                else "more than the gradients: did you flatten something else too?")
        return (f"your all_reduce carried {nbytes} bytes, but the {len(got)} gradients are {grad_bytes} bytes "
                f"({grad_bytes // 4} floats): {what}")
    if calls[0]["op"] not in ("SUM", "AVG"):
        return (f"your all_reduce used {calls[0]['op']}: use op=dist.ReduceOp.SUM (the default), "
                f"then divide by the world size")
    for i, (g, shape) in enumerate(zip(got, result["shapes"])):
        if g is None:
            return f"parameter {i} has no .grad after your function: write its slice of the buffer back"
        if tuple(g.shape) != shape:
            return (f"parameter {i}: .grad has shape {tuple(g.shape)}, the parameter {shape}: "
                    f"reshape each slice with .view_as(p.grad)")
    mean = [t / world_size for t in summed]
    if _close(got, mean):
        return None
    if _close(got, result["local"]):
        return ("the .grad tensors still hold this rank's own gradients: copy the averaged buffer back "
                "into each p.grad (the flat buffer is a copy, not a view)")
    if _close(got, summed):
        return "the gradients are the sum over the ranks, not the mean: divide the buffer by dist.get_world_size()"
    if calls[0]["op"] == "AVG" and _close(got, [t / world_size for t in mean]):
        return "ReduceOp.AVG already divides by the world size: do not divide again"
    for k in range(2, 9):
        if k != world_size and _close(got, [t / k for t in summed]):
            return f"you divided by {k}, but the world size here is {world_size}: use dist.get_world_size()"
    for i, (g, want) in enumerate(zip(got, mean)):
        problem = difference(want, g, rtol=1e-4, atol=1e-5)
        if problem:
            return (f"parameter {i} (shape {tuple(want.shape)}), {problem} (slices copied back to the wrong "
                    f"parameters? keep the order of model.parameters() when you flatten and when you copy back)")
    return "the gradients differ from the mean over the ranks"


def check_one_bucket_average(fn: Callable[[torch.nn.Module], None]) -> Verdict:
    """Notebook 05: `fn(model)` replaces every gradient by its mean over the ranks with ONE
    all_reduce of one flat buffer. Checked on real ranks (2 and 3) with dist.all_reduce
    wrapped: the number of calls, the bytes each carried, and the gradients written back."""
    title = "average_gradients_one_bucket"
    check = runner.Checker(title, fn)
    unseen = runner.unseen(lambda rng: (rng.randint(2, 3), rng.randrange(2, 2**40)))
    for world_size, _seed in check.each([(2, 1), (3, 1)], unseen,
                                       lambda case: (_one_bucket_in_rank, case[0], (fn, case[1]))):
        label = check.label(f"world_size={world_size}")
        results = check.run(
            *check.planned, label, timeout=20,
            never_finished="every rank must call all_reduce the same number of times, with buffers of the same size",
            partner_left=" (its partner had left): did every rank call all_reduce the same number of times, with "
                         "buffers of the same size?")
        if results is None:
            continue
        wrong = {rank: problem for rank, result in enumerate(results)
                 if (problem := _one_bucket_problem(result, world_size))}
        if wrong and len(wrong) < world_size:
            rank, problem = next(iter(wrong.items()))
            right = [r for r in range(world_size) if r not in wrong]
            check.problems.append(f"{label}: ranks disagree (rank(s) {right} right, rank {rank} not): {problem}")
        elif wrong:
            check.problems.append(f"{label}, rank 0: {wrong[0]}")
    return check.verdict()
