"""Plumbing for notebook 07 (the performance lab): what the lesson's cells need but do not teach.

- `counted_throughput`: images/s of a training run's record, after a warm-up;
- the 1-GPU settings that notebook 07 runs live and `benchmarks/perf_lab_1gpu.py` stores
  (`MODES`, `LOADERS`, `MODELS`), and `one_gpu_images_per_s` / `side_by_side` to run and print them;
- `counting_bytes`: notes the bytes of every `dist.all_reduce` a block makes (comm hooks call it).
Its pictures (buckets over a link, time to accuracy) are in `speed_plots`.

The experiments themselves (the simulated link, the comm hooks, the compiled DDP model) are written
in the notebook's cells.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

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
