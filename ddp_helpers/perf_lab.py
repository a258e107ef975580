"""Plumbing for notebook 07 (the performance lab): what the lesson's cells need but do not teach.

- `counted_throughput`: images/s of a training run's record, after a warm-up;
- the 1-GPU settings that notebook 07 runs live and `benchmarks/perf_lab_1gpu.py` stores
  (`MODES`, `LOADERS`, `MODELS`), and `one_gpu_images_per_s` / `side_by_side` to run and print them;
- `counting_bytes`: notes the bytes of every `dist.all_reduce` a block makes (comm hooks call it);
- `overlap_timeline` / `overlap_sweep`: the pictures of section 2 (buckets over a link).

The experiments themselves (the simulated link, the comm hooks, the compiled DDP model) are written
in the notebook's cells.
"""
import contextlib

import torch.distributed as dist

from . import speed
from .launcher import WorkerError, launch

# ------------------------------------------------------------------ reading a training run
def counted_throughput(record, warmup_steps):
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


def one_gpu_images_per_s(settings, steps=300, warmup_steps=50):
    """images/s of one speed-layer run on GPU 0 (a world of one: no DDP), after the warm-up; or the
    first line of why it failed (a compiled model may refuse a CUDA graph, say)."""
    try:
        record = launch(speed.run, world_size=1, backend="nccl", timeout=900, quiet=True,
                        kwargs=dict(settings, max_steps=steps, eval_every=0, verbose=False))[0]
    except WorkerError as err:
        return "failed: " + (f"{err.exc_type}: {err.exc_message}" if err.exc_type else str(err)).splitlines()[0][:60]
    return counted_throughput(record, warmup_steps)


def side_by_side(label, live, stored, width=28):
    """One printed line: a figure measured here, and the stored one (None: not stored)."""
    def show(x):
        return f"{x:>13,.0f}" if isinstance(x, (int, float)) else f"  {x or '-':>11}"
    print(f"{label:{width}s}{show(live)}{show(stored)}")


# ------------------------------------------------------------------ counting what is sent
@contextlib.contextmanager
def counting_bytes():
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


# ------------------------------------------------------------------ pictures of section 2
def overlap_timeline(runs, title):
    """One row per run (label -> {"step_ms", "ready_ms", "link_ms"}): a blue bar for backward's
    computation (until the last bucket is ready), a tick when each bucket is ready, an orange bar for
    each bucket on the link, a black line at the end of the step. Returns the figure."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.7 * len(runs)))
    for row, (label, run) in enumerate(runs.items()):
        y = len(runs) - 1 - row
        ax.barh(y + 0.15, max(run["ready_ms"]), height=0.25, color="tab:blue",
                label="backward computing" if row == 0 else None)
        ax.vlines(run["ready_ms"], y + 0.02, y + 0.28, colors="k", linewidth=1)
        for i, (start, end) in enumerate(run["link_ms"]):
            ax.barh(y - 0.15, end - start, left=start, height=0.25, color="tab:orange", edgecolor="white",
                    label="a bucket on the link" if row == 0 and i == 0 else None)
        ax.vlines(run["step_ms"], y - 0.35, y + 0.35, colors="k", linewidth=2.5,
                  label="backward() returns" if row == 0 else None)
    ax.set_yticks(range(len(runs)), list(runs)[::-1])
    ax.set_xlabel("ms since backward() started (ticks: a bucket's gradients are all ready)")
    ax.set_title(title, fontsize=10)
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def overlap_sweep(sweep, title):
    """Step time against the link's bandwidth: one line per bucket setting (label -> {GB/s: ms}).
    Returns the figure."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for label, by_bandwidth in sweep.items():
        xs = sorted(by_bandwidth)
        ax.plot(xs, [by_bandwidth[x] for x in xs], "o-", label=label)
    ax.set(xscale="log", xlabel="simulated link bandwidth (GB/s)", ylabel="backward() (ms, median)")
    ax.set_xticks(xs, [f"{x:.3g}" for x in xs])
    ax.minorticks_off()
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
