"""Checkers for notebook 09's exercises (re-exported by `ddp_helpers.exercises`).

`check_row_parallel(fn)`: the forward of a row-parallel linear layer, with tensor parallelism
(one all-reduce of the partial output, the bias added once) and with sequence parallelism (one
reduce-scatter of the partial output along the sequence dimension instead). The checker runs it on
real Gloo ranks and records every collective each rank makes, below torch.distributed's Python
functions (a dispatch mode that sees the c10d operators, however the learner reached them), with the
bytes the rank hands in: a right result from another algorithm (gathering the inputs and computing
everything on every rank, an all-reduce where a reduce-scatter does) is named, not accepted. A last
case, drawn when the checker runs (`runner.unseen`), has random sizes and data.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .plain import type_name
from .spies import CollectiveRecorder
from .verdict import Verdict, close, difference

__all__ = ["check_row_parallel", "ROW_PARALLEL_CASES"]

# (world_size, batch, tokens, in_features, out_features): tokens and in_features divide by world_size
ROW_PARALLEL_CASES = [(2, 2, 4, 6, 5), (4, 3, 8, 8, 3)]


def _row_parallel_data(batch, tokens, in_features, out_features, seed=None):
    g = torch.Generator().manual_seed(batch * 100 + tokens * 10 + in_features if seed is None else seed)
    x = torch.randn(batch, tokens, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    return x, weight, bias


def _draw_case(rng):
    """((world_size, batch, tokens, in_features, out_features), seed): tokens and in_features divide by world_size."""
    world_size = rng.choice((2, 4))
    shape = (world_size, rng.randint(1, 3), world_size * rng.randint(1, 3), world_size * rng.randint(1, 3),
             rng.randint(1, 6))
    return shape, rng.randrange(2**40)


def _row_parallel_in_rank(fn, shape, seed=None):
    """Inside a rank: fn(this rank's input-feature slice of x, its column slice of the weight, the
    whole bias, sequence_parallel) for sequence_parallel False, then True, with every collective
    recorded. Returns a dict per mode."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, weight, bias = _row_parallel_data(*shape, seed)
    results = {}
    for sequence_parallel in (False, True):
        x_shard = x.chunk(world_size, dim=-1)[rank].clone()
        w_shard = weight.chunk(world_size, dim=1)[rank].clone()
        recorder = CollectiveRecorder()
        try:
            with recorder:
                got = fn(x_shard, w_shard, bias.clone(), sequence_parallel)
            error = None
        except NotImplementedError:
            raise
        except Exception as err:
            got, error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if isinstance(got, torch.Tensor):
            got = got.detach().clone()
        results[sequence_parallel] = {"got": got, "error": error, "calls": recorder.calls}
    return results


def _expected(shape, seed=None):
    """For one case: (the whole output x @ weight.T + bias, the bias), from the checker's own data."""
    x, weight, bias = _row_parallel_data(*shape[1:], seed)
    return x @ weight.T + bias, bias


def _row_parallel_problem(result, rank, world_size, shape, sequence_parallel, expected):
    batch, tokens, _, out_features = shape[1:]
    full, bias = expected
    want = full.chunk(world_size, dim=1)[rank] if sequence_parallel else full
    wanted = "one reduce-scatter" if sequence_parallel else "one all-reduce"
    if result["error"]:
        return f"raised {result['error']}"
    got = result["got"]
    if type(got) is not torch.Tensor:
        return f"returned {type_name(got)}, expected a tensor"
    if tuple(got.shape) != tuple(want.shape):
        hint = ""
        if sequence_parallel and tuple(got.shape) == tuple(full.shape):
            hint = " (with sequence parallelism each rank keeps only its tokens: 1/world_size of dim 1)"
        elif sequence_parallel and got.shape[0] * world_size == batch:
            hint = " (that is a slice of the batch, dim 0: sequence parallelism splits the tokens, dim 1)"
        return f"expected shape {tuple(want.shape)}, got {tuple(got.shape)}{hint}"
    problem = difference(want, got, rtol=1e-4, atol=1e-4)
    if problem:
        if close(want + (world_size - 1) * bias, got, rtol=1e-4, atol=1e-4):
            return (f"the bias is in the result {world_size} times: every rank added it before the sum. "
                    f"Add it once, after the collective")
        if close(want - bias, got, rtol=1e-4, atol=1e-4):
            return "the bias is missing: add it (once, after the collective)"
        return f"{problem} (x_shard @ w_shard.T is this rank's partial sum; the output is the sum over ranks)"
    calls = result["calls"]
    partial_bytes = batch * tokens * out_features * 4
    name = "reduce_scatter" if sequence_parallel else "all_reduce"
    others = [op for op, _ in calls if not op.startswith(name)]
    if others:
        extra = (" (the all-reduce sends every rank the whole sum, then you drop most of it: a reduce-scatter "
                 "gives each rank only its tokens' sum, half the traffic of an all-reduce)"
                 if sequence_parallel and others[0].startswith("all_reduce") else
                 " (gathering the inputs or the weights moves them all and repeats the whole matmul on every "
                 "rank: the point of the row-parallel layer is a local matmul, then one collective on its "
                 "partial output)" if others[0].startswith("all_gather") else "")
        return f"called dist.{others[0]}: the row-parallel forward needs {wanted} and nothing else{extra}"
    mine = [n for op, n in calls if op.startswith(name)]
    if not mine:
        return f"made no collective call: the other ranks' partial sums can only come from {wanted}"
    if len(mine) > 1:
        return f"made {len(mine)} {name} calls: {wanted} of the whole partial output is enough"
    if mine[0] != partial_bytes:
        return (f"the {name} handed in {mine[0]} bytes; the partial output x_shard @ w_shard.T is "
                f"{partial_bytes} bytes ({batch}x{tokens}x{out_features} float32): reduce that")
    return None


def check_row_parallel(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]) -> Verdict:
    """Notebook 09: `fn(x_shard, w_shard, bias, sequence_parallel)` is a row-parallel linear layer's
    forward. x_shard is this rank's slice of the input's last dimension (features), w_shard the same
    columns of the weight, bias the whole bias. It returns x @ weight.T + bias on every rank
    (sequence_parallel=False), or this rank's block of tokens of it (sequence_parallel=True). Checked on
    2 and 4 ranks for both: the values, and the collectives each rank made with their bytes."""
    title = "my_row_parallel"
    cases, unseen = [(shape, None) for shape in ROW_PARALLEL_CASES], runner.unseen(_draw_case)
    wants = {case: _expected(*case) for case in cases + unseen}
    check = runner.Checker(title, fn)
    for shape, seed in check.each(cases, unseen,
                                  lambda case: (_row_parallel_in_rank, case[0][0], (fn, case[0][1:], case[1]))):
        world_size = shape[0]
        label = check.label(f"world_size={world_size}" + (f", shape {shape[1:]}" if check.drawn else ""))
        results = check.run(
            *check.planned, label,
            timeout=2 * runner.HANG_TIMEOUT_S,
            never_finished="they wait in a collective another rank never joined: every rank must make the "
                           "same collective calls, with tensors of the same size",
            partner_left=": another rank left without joining the collective")
        if results is None:
            continue
        for sequence_parallel in (False, True):
            for rank, result in enumerate(results):
                problem = _row_parallel_problem(result[sequence_parallel], rank, world_size, shape,
                                                sequence_parallel, wants[shape, seed])
                if problem:
                    check.problems.append(f"{label}, sequence_parallel={sequence_parallel}, rank {rank}: {problem}")
                    break
    return check.verdict()
