"""Plumbing for notebook 07 (the performance lab), and 05's simulated link: what the lessons' cells
need but do not teach.

- `counted_throughput`: images/s of a training run's record, after a warm-up;
- the 1-GPU settings that notebook 07 runs live and `benchmarks/perf_lab_1gpu.py` stores
  (`MODES`, `LOADERS`, `MODELS`), and `one_gpu_images_per_s` / `side_by_side` to run and print them;
- `counting_bytes`: notes the bytes of every `dist.all_reduce` a block makes (comm hooks call it);
- `SimulatedLink`, `over_link` and `buckets_over_link`: DDP's buckets over a simulated wire (notebooks
  05 and 07), so that the overlap of communication with backward shows on any CPU, loaded or not.
Its pictures (buckets over a link, time to accuracy) are in `speed_plots`.

What the lessons teach (the overlap model and its check, the compressing comm hooks, the compiled DDP
model) is written in the notebooks' cells; the simulated link here is the instrument they measure with.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import speed
from .launcher import WorkerError, launch


# ------------------------------------------------------------------ reading a training run
def counted_throughput(record: dict, warmup_steps: int) -> float:
    """Images per second over the steps after the warm-up, all ranks together."""
    steps = record["steps"][warmup_steps:]
    images_per_step = record["config"]["batch_size"] * record["world_size"]
    seconds = sum(images_per_step / s["images_per_s"] for s in steps)  # each step's share of its window
    return len(steps) * images_per_step / seconds


# ------------------------------------------------------------------ the 1-GPU settings
# How a step is made: CUDA graph and torch.compile, each on or off.
MODES = {"eager": dict(cuda_graph=False, compile=False),
         "cuda_graph": dict(cuda_graph=True, compile=False),
         "compile": dict(cuda_graph=False, compile=True),
         "compile_cuda_graph": dict(cuda_graph=True, compile=True)}
# Who feeds the step (ResNet-18 with CUDA graphs).
LOADERS = {"DataLoader": dict(device_loader=False), "DeviceLoader": dict(device_loader=True)}
# The recipes without their step mode (MODES sets it); epochs: enough for any number of steps; losses
# gathered (and the GPU waited for) every 25 steps.
MODELS = {name: dict({k: v for k, v in recipe.items() if k not in MODES["eager"]}, batch_size=batch,
                     epochs=100, log_every=25)
          for name, recipe, batch in [("resnet18", speed.recipes.RESNET, 256), ("fastnet", speed.recipes.FAST, 512)]}


def one_gpu_images_per_s(settings: dict, steps: int = 300, warmup_steps: int = 50) -> float | str:
    """images/s of one speed-layer run on GPU 0 (a world of one: no DDP), after the warm-up; or the
    first line of why it failed (a compiled model may refuse a CUDA graph, say)."""
    try:
        record = launch(speed.run, world_size=1, backend="nccl", timeout=900, quiet=True,
                        kwargs=dict(settings, max_steps=steps, eval_every=0, verbose=False))[0]
    except WorkerError as err:
        return "failed: " + (f"{err.exc_type}: {err.exc_message}" if err.exc_type else str(err)).splitlines()[0][:60]
    return counted_throughput(record, warmup_steps)


def side_by_side(label: str, live: float | str | None, stored: float | str | None, width: int = 28) -> None:
    """One printed line: a figure measured here, and the stored one (None: not stored)."""
    def show(x):
        return f"{x:>13,.0f}" if isinstance(x, (int, float)) else f"  {x or '-':>11}"
    print(f"{label:{width}s}{show(live)}{show(stored)}")


# ------------------------------------------------------------------ counting what is sent
@contextlib.contextmanager
def counting_bytes() -> Iterator[list[int]]:
    """Inside a rank: while the block runs, every `dist.all_reduce` (as DDP's Python comm hooks call it)
    adds its tensor's bytes to the list yielded. DDP's built-in all-reduce, without a hook, runs in C++
    and is not seen: register `default_hooks.allreduce_hook` to count it."""
    sent, real = [], dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield sent
    finally:
        dist.all_reduce = real


# ------------------------------------------------------------------ a simulated link
class SimulatedLink:
    """A simulated wire that carries one bucket at a time at `GBps` gigabytes per second.

    `over_link` (the comm hook) keeps its schedule: a bucket leaves when it is ready and the wire is
    free, and arrives `bytes / bandwidth` seconds later. Nothing waits while a bucket travels: only
    the step's last bucket SLEEPS in the hook until the last byte has arrived (DDP calls the last
    bucket's hook when backward's computation is done). Sleeping needs no CPU and no other thread,
    so the effect does not depend on free cores. The wire only delays: DDP gets each bucket back as
    it was sent (no average; `buckets_over_link` averages for real after backward, timed apart).
    `log` holds each bucket's (ready, leaves, arrives), perf_counter seconds."""

    def __init__(self, GBps: float):
        self.GBps, self.log, self.free_at = GBps, [], 0.0


def over_link(link: SimulatedLink, bucket):  # no return annotation: DDP checks it, and only as a type
    """The comm hook: puts the bucket on the link's schedule; the step's last bucket waits (sleeps)
    until the link has carried everything."""
    ready = time.perf_counter()
    leaves = max(ready, link.free_at)                        # the wire carries one bucket at a time
    link.free_at = leaves + bucket.buffer().nbytes / (link.GBps * 1e9)
    link.log.append((ready, leaves, link.free_at))
    if bucket.is_last():
        time.sleep(max(0.0, link.free_at - time.perf_counter()))   # sleeping: no CPU used
    arrived = torch.futures.Future()
    arrived.set_result(bucket.buffer())
    return arrived


def buckets_over_link(make_model: Callable[[], torch.nn.Module], x: torch.Tensor, caps=(1, 100),
                      GBps: float | None = None, steps: int = 5, warmup: int = 2) -> dict:
    """Inside a rank: backward() of `DDP(make_model(), bucket_cap_mb=cap)` for each cap, over a
    SimulatedLink, the caps' steps alternated; after each backward the gradients are averaged for
    real with one dist.all_reduce, timed apart. GBps None: the link takes as long as backward's
    computation alone at its quickest (measured first with a hook that sends nothing), i.e. L = C.
    Returns {"compute_ms": C (median), "GBps", "link_ms": L, "real_all_reduce_ms", "grad_bytes",
    "runs": {cap: {"step_ms" (median), "steps_ms" (each timed step, in the order run), "wait_ms"
    (median time from the last bucket ready, i.e. the computation's end, to backward()'s return),
    "last_ms" (the last step's backward()), "ready_ms", "link_ms" (the last step, ms since backward
    started)}}}."""
    def one_backward(model):
        loss = model(x).square().mean()
        start = time.perf_counter()
        loss.backward()
        return (time.perf_counter() - start) * 1e3, start

    def nothing_sent(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    torch.manual_seed(0)
    alone = DDP(make_model())
    alone.register_comm_hook(None, nothing_sent)
    # The link's time: backward's computation at its quickest. Other programs only ever add to a
    # step's time, and a median taken while the machine is busy can make L many times C.
    first_ms = min([one_backward(alone)[0] for _ in range(warmup + steps)][warmup:])
    grad_bytes = sum(p.numel() * p.element_size() for p in alone.parameters())
    GBps = GBps or grad_bytes / (first_ms * 1e6)
    links = {cap: SimulatedLink(GBps) for cap in caps}
    models = {cap: DDP(make_model(), bucket_cap_mb=cap) for cap in caps}
    for cap, model in models.items():
        model.register_comm_hook(links[cap], over_link)
    times, waits, starts, real_ms, compute = {c: [] for c in caps}, {c: [] for c in caps}, {}, [], []
    for _ in range(warmup + steps):        # warm-up: DDP sorts its buckets after the first step
        compute.append(one_backward(alone)[0])         # C again, at the same moments as the others
        for cap, model in models.items():              # alternated: a busy moment slows all
            links[cap].log.clear()
            ms, starts[cap] = one_backward(model)
            times[cap].append(ms)                      # and how long backward() waited for the link
            waits[cap].append(ms - (max(r for r, _, _ in links[cap].log) - starts[cap]) * 1e3)
            start = time.perf_counter()                # the real average, timed apart
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            for p, part in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
                p.grad.copy_(part.view_as(p.grad))
            real_ms.append((time.perf_counter() - start) * 1e3)
    compute_ms = statistics.median(compute[warmup:])
    runs = {}
    for cap, link in links.items():
        at = lambda t, cap=cap: (t - starts[cap]) * 1e3
        runs[cap] = {"step_ms": statistics.median(times[cap][warmup:]), "steps_ms": times[cap][warmup:],
                     "wait_ms": statistics.median(waits[cap][warmup:]), "last_ms": times[cap][-1],
                     "ready_ms": [at(r) for r, _, _ in link.log],
                     "link_ms": [(at(s), at(e)) for _, s, e in link.log]}
    return {"compute_ms": compute_ms, "GBps": GBps, "link_ms": grad_bytes / (GBps * 1e6),
            "grad_bytes": grad_bytes, "real_all_reduce_ms": statistics.median(real_ms), "runs": runs}
