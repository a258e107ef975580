"""Checker for notebook 07's exercise: a DDP comm hook that averages each bucket in float16.

DDP runs the learner's hook on 2 and 3 Gloo ranks; each rank's local gradients and their true mean
in float32 (the real all_reduce) are taken before the learner's code runs. Every dist.all_reduce is
noted with its dtype and bytes and any other collective named (`spies.CallLog`); the averaged
gradients are compared with the true mean within float16's rounding (`verdict.close`), and one case
has gradients whose sum overflows float16 while their mean does not. A last case, drawn when the
checker runs (`runner.unseen`), uses data no answer can have seen.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .data_parallel import NOT_ONE_ALL_REDUCE
from .spies import CallLog
from .verdict import Verdict, close

__all__ = ["check_fp16_compress_hook"]

_FP16_MAX = 65504.0


def _hook_model():
    """The model the hook checker uses: 2 buckets' worth of gradients (bucket_cap_mb below)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _describe(name, args, kwargs):
    """An all_reduce as {"dtype", "bytes"}; any other call as its name."""
    if name != "all_reduce":
        return name
    tensor = args[0] if args else kwargs.get("tensor")
    return {"dtype": str(tensor.dtype).replace("torch.", ""), "bytes": tensor.numel() * tensor.element_size()}


def _compress_hook_in_rank(hook, scale, seed=1):
    """Inside a rank: this rank's gradients (a loss times `scale`, on data made from `seed`), their true
    mean in float32 (the real all_reduce, before the learner's code runs), then one backward of the same
    loss through DDP with `hook` registered, every dist.all_reduce noted (dtype, bytes) and any other
    collective named."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(24, 32, generator=g), torch.randn(24, 8, generator=g)
    shard = slice(rank * 24 // world_size, (rank + 1) * 24 // world_size)

    def loss_of(model):
        return scale * (model(x[shard]) - y[shard]).square().sum()

    plain = _hook_model()
    loss_of(plain).backward()
    local = [p.grad.clone() for p in plain.parameters()]
    mean = [t.clone() for t in local]
    for t in mean:
        dist.all_reduce(t)
        t /= world_size
    model = DDP(_hook_model(), bucket_cap_mb=0.004)   # 4 KB: the gradients travel in 2 buckets
    model.register_comm_hook(None, hook)
    log, error = CallLog(), None
    try:
        with log.watching(("all_reduce",) + NOT_ONE_ALL_REDUCE, describe=_describe):
            loss_of(model).backward()
    except Exception as err:            # a hook's error surfaces from backward(), often wrapped
        error = f"{type(err).__name__}: {err}"
    calls = [note for note in log.notes if isinstance(note, dict)]
    others = [note for note in log.notes if not isinstance(note, dict)]
    return {"error": error, "calls": calls, "others": others, "local": local, "mean": mean,
            "got": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
            "grad_bytes": sum(t.numel() * t.element_size() for t in local)}


def _compress_problem(result, world_size, overflow_case):
    """What is wrong on one rank, or None."""
    if result["others"]:
        used = sorted(set(result["others"]), key=result["others"].index)
        return (f"your hook called {', '.join(f'dist.{name}' for name in used)}: one all_reduce of the "
                f"compressed bucket is all it needs")
    calls = result["calls"]
    if not calls:
        return ("no dist.all_reduce was called: the hook must all-reduce the compressed bucket "
                "(dist.all_reduce(compressed, async_op=True).get_future())")
    sent, full = sum(c["bytes"] for c in calls), result["grad_bytes"]
    dtypes = sorted({c["dtype"] for c in calls})
    if dtypes != ["float16"]:
        return (f"your all_reduce(s) sent {', '.join(dtypes)} tensors ({sent} bytes for {full} bytes of float32 "
                f"gradients): compress each bucket to torch.float16 first, half the bytes")
    if sent != full // 2:
        return (f"your all_reduce(s) sent {sent} bytes; the gradients in float16 are {full // 2} bytes "
                f"(each bucket once)")
    got, mean, local = result["got"], result["mean"], result["local"]
    if any(g is None for g in got):
        return "a parameter has no .grad after backward: return a future whose value is the bucket's float32 tensor"

    def near(got, want, rtol=4e-3):   # within float16's rounding of the largest gradient of each tensor
        return all(close(y, x.float(), rtol=rtol, atol=rtol * y.abs().max().item()) for x, y in zip(got, want))

    if near(got, mean):
        return None
    if any(not torch.isfinite(g).all() for g in got):
        return ("the averaged gradients hold inf: the sum over the ranks overflowed float16 (largest value "
                f"{_FP16_MAX:g}); divide by the world size BEFORE the all-reduce, so the sum is already a mean"
                if overflow_case else "the averaged gradients hold inf or nan")
    if near(got, [t * world_size for t in mean]):
        return "the gradients are the sum over the ranks, not the mean: divide by dist.get_world_size()"
    if near(got, local):
        return ("the gradients are still this rank's own: the future's value must be the all-reduced bucket, "
                "cast back to float32")
    return "the gradients differ from the mean over the ranks by more than float16's rounding"


def check_fp16_compress_hook(hook: Callable) -> Verdict:
    """Notebook 07: `hook(state, bucket)`, a DDP comm hook that averages each bucket's gradients in
    float16. Run by DDP on real ranks (2 and 3) with dist.all_reduce wrapped: the dtype and bytes
    sent (half of float32's, each bucket once), the averaged gradients against the true mean (within
    float16's rounding), and one case whose sum overflows float16 while its mean does not."""
    title = hook.__name__ if callable(hook) else "hook"
    if not callable(hook):
        return runner.not_a_function(title, hook, "hook(state, bucket)")
    # each case: (world size, loss scale, overflow): the last case's gradients are each just inside
    # float16's range, their sum beyond it (scaled before any of the learner's code runs)
    largest_own, largest_sum = _largest_gradients(2)
    assert largest_sum * 0.95 / largest_own > 1.1, "the checker's data no longer overflows float16"
    check = runner.Checker(title, who=title)
    problems = check.problems
    unseen = runner.unseen(lambda rng: (rng.randint(2, 3), 1.0, False, rng.randrange(2, 2**40)))
    for world_size, _scale, overflow_case, _seed in check.each(((2, 1.0, False, 1), (3, 1.0, False, 1),
                                                              (2, 0.95 * _FP16_MAX / largest_own, True, 1)), unseen,
                                                             lambda case: (_compress_hook_in_rank, case[0],
                                                                           (hook, case[1], case[3]))):
        label = check.label(f"world_size={world_size}" + (", gradients near float16's limit" if overflow_case else ""))
        results = check.run(
            *check.planned, label, timeout=30,
            never_finished="every rank's hook must all-reduce each bucket once")
        if results is None:
            continue
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            if "NotImplementedError" in errors[0]:
                check.still_a_stub()
                break
            problems.append(f"{label}: backward() failed in your hook: {errors[0].splitlines()[0][:300]}")
            continue
        wrong = {rank: p for rank, r in enumerate(results) if (p := _compress_problem(r, world_size, overflow_case))}
        if wrong:
            rank, problem = next(iter(wrong.items()))
            problems.append(f"{label}, rank {rank}: {problem}")
    return check.verdict()


def _largest_gradients(world_size):
    """The largest |gradient| of any rank, and the largest |sum over the ranks| of a gradient, with
    scale 1 (the checker's data is fixed)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 32, generator=g), torch.randn(24, 8, generator=g)
    own = []
    for rank in range(world_size):
        model = _hook_model()
        shard = slice(rank * 24 // world_size, (rank + 1) * 24 // world_size)
        (model(x[shard]) - y[shard]).square().sum().backward()
        own.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return max(g.abs().max().item() for g in own), sum(own).abs().max().item()

