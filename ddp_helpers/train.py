"""Train CIFAR-10 with DistributedDataParallel: one process per device, the same code everywhere.

From a notebook (the process group is already there):
    record = launch(train.run, world_size=2, backend="gloo", kwargs=dict(epochs=2, width=16))[0]
From a shell:
    torchrun --standalone --nproc-per-node=2 -m ddp_helpers.train --epochs 2 --width 16
Surviving a crash: checkpoint every epoch, and let torchrun restart the group, which resumes
    torchrun --standalone --nproc-per-node=2 --max-restarts=1 -m ddp_helpers.train \
        --checkpoint ckpt/epoch-{epoch}.pt --resume auto --fail-at-step 30 --fail-rank 1
In one plain process (a world of one): python -m ddp_helpers.train --epochs 1

What each rank does: join the process group, build the same model from the same seed,
wrap it in DDP (which all-reduces gradients during backward, so every rank takes the same
step), train on its own share of each epoch's examples, and evaluate its share of the test
set; metrics are combined across ranks with collectives. Every rank returns the same record.
"""
import argparse
import contextlib
import dataclasses
import functools
import glob
import inspect
import json
import math
import os
import re
import signal
import sys
import time
import typing
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from . import data, models
from .cuda_graph import CapturedStep, side_stream
from .launcher import loopback_interface

METRICS_PREFIX = "@@ddp_helpers.metrics "   # lines the live view (ddp_helpers.live) picks up


def option(default, help):
    return field(default=default, metadata={"help": help})


# DDP communication hooks by name (Config.comm_hook): what DDP does with each bucket of gradients.
COMM_HOOKS = {"none": None,  # DDP's own all-reduce
              "bf16": default_hooks.bf16_compress_hook}


@dataclass
class Config:
    model: str = option("fastnet", "fastnet (small, fast) or resnet18")
    width: int = option(64, "fastnet's first block width (16 for CPU runs); resnet18 ignores it")
    whiten: bool = option(False, "fastnet only: a fixed whitening stem set from the training images")
    identity_init: bool = option(False, "fastnet only: each 3x3 conv starts by passing its input channels through")
    bn_weights: bool = option(True, "fastnet only: BatchNorm scales learn (False: fixed at 1, only the shifts learn)")
    lookahead: int = option(0, "every N steps, pull the weights to a slow average of their past values, which "
                               "weighs more as training ends; the final weights are that average (0: off)")
    data: Optional[str] = option(None, f"folder with train/ and test/ class folders; default: "
                                       f"${data.ENV_VAR}, else torchvision's CIFAR10 (downloaded once)")
    per_class: Optional[int] = option(None, "train on the first N images of each class only")
    test_per_class: Optional[int] = option(None, "evaluate on the first N test images of each class only")
    epochs: int = option(10, "passes over the training set")
    batch_size: int = option(256, "images per step on each rank (the global batch is this x ranks)")
    lr: float = option(0.4, "peak learning rate of the one-cycle schedule")
    warmup: float = option(0.25, "fraction of the steps spent raising the learning rate")
    lr_start: float = option(0.1, "the learning rate starts at this fraction of lr")
    lr_end: float = option(0.001, "and ends at this fraction of lr")
    norm_bias_lr: float = option(1.0, "BatchNorm shifts learn this many times faster than the rest (their "
                                      "weight decay per step stays the same)")
    momentum: float = option(0.9, "SGD (Nesterov) momentum")
    weight_decay: float = option(5e-4, "L2 penalty on all weights")
    label_smoothing: float = option(0.1, "share of each target spread over the other classes")
    crop_pad: int = option(4, "random crops shift images by up to this many pixels (0: none)")
    flip: str = option("random", "mirror training images: random (each with probability 1/2, every epoch), "
                                 "alternate (a random half in even epochs, the other half in odd ones) or none")
    tta: int = option(0, "test-time augmentation: 0 none; 1 average the logits of each image and its mirror; "
                         "2 also of the image shifted by a pixel up-left and down-right (and their mirrors)")
    seed: int = option(0, "same seed, same run: model init, shuffling and augmentation")
    device: str = option("auto", "auto (this rank's GPU if there is one for it), cuda or cpu")
    bucket_cap_mb: float = option(25.0, "DDP: gradients are all-reduced in buckets of about this many MB")
    broadcast_buffers: bool = option(True, "DDP: send rank 0's buffers (BatchNorm statistics) to all ranks "
                                           "before every forward")
    batched_grad_copy: bool = option(True, "DDP: copy each bucket's gradients into it in one go, not one "
                                           "kernel per parameter (PyTorch 2.12+; older versions copy one by one)")
    comm_hook: str = option("none", "DDP: none, or bf16 (gradients travel as bfloat16: half the bytes); "
                                    "more in COMM_HOOKS")
    cuda_graph: bool = option(False, "GPU only: record the forward and backward of a step once as a CUDA "
                                     "graph and replay it (removes Python's per-step cost; ddp_helpers.cuda_graph)")
    max_steps: Optional[int] = option(None, "stop after this many steps (the schedule is fitted to them)")
    eval_every: int = option(1, "evaluate on the test set every N epochs (0: only at the end)")
    log_every: int = option(10, "gather per-rank losses and throughput every N steps")
    checkpoint: Optional[str] = option(None, "after each epoch, rank 0 saves the training state to this "
                                             "file ({epoch} in the name: one file per epoch)")
    resume: Optional[str] = option(None, "continue from a checkpoint written by --checkpoint; auto: from "
                                         "the newest one --checkpoint names, if any (for torchrun restarts)")
    fail_at_step: Optional[int] = option(None, "fault injection: at this step rank --fail-rank kills itself "
                                               "(SIGKILL), in the first attempt only (TORCHELASTIC_RESTART_COUNT=0)")
    fail_rank: int = option(0, "the rank that --fail-at-step kills")
    verbose: bool = option(True, "rank 0 prints progress")
    live: bool = option(False, "rank 0 prints machine-readable metric lines (for ddp_helpers.live)")


def make_config(**settings):
    """A checked Config from keyword settings; a clear error for unknown names or bad values."""
    names = [f.name for f in dataclasses.fields(Config)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; the settings are: {', '.join(names)}")
    cfg = Config(**settings)
    check_config(cfg)
    return cfg


def check_config(cfg):
    def need(ok, message):
        if not ok:
            raise ValueError(message)
    need(cfg.model in models.MODELS, f"model must be one of {list(models.MODELS)}, got {cfg.model!r}")
    need(not cfg.whiten or cfg.model == "fastnet", "whiten=True is for model='fastnet' only")
    need(not cfg.identity_init or cfg.model == "fastnet", "identity_init=True is for model='fastnet' only")
    need(cfg.bn_weights or cfg.model == "fastnet", "bn_weights=False is for model='fastnet' only")
    need(cfg.lookahead >= 0, f"lookahead must be >= 0 (0: off), got {cfg.lookahead}")
    need(cfg.width >= 1, f"width must be at least 1, got {cfg.width}")
    need(cfg.epochs >= 1, f"epochs must be at least 1, got {cfg.epochs}")
    need(cfg.batch_size >= 1, f"batch_size must be at least 1, got {cfg.batch_size}")
    need(cfg.lr > 0, f"lr must be positive, got {cfg.lr}")
    need(0 < cfg.warmup < 1, f"warmup must be between 0 and 1 (a fraction of the steps), got {cfg.warmup}")
    need(0 < cfg.lr_start <= 1 and 0 < cfg.lr_end <= 1,
         f"lr_start and lr_end are fractions of lr in (0, 1], got {cfg.lr_start} and {cfg.lr_end}")
    need(cfg.norm_bias_lr > 0, f"norm_bias_lr must be positive, got {cfg.norm_bias_lr}")
    need(0 <= cfg.momentum < 1, f"momentum must be in [0, 1), got {cfg.momentum}")
    need(cfg.weight_decay >= 0, f"weight_decay must be >= 0, got {cfg.weight_decay}")
    need(0 <= cfg.label_smoothing < 1, f"label_smoothing must be in [0, 1), got {cfg.label_smoothing}")
    need(0 <= cfg.crop_pad <= 16, f"crop_pad must be between 0 and 16 pixels, got {cfg.crop_pad}")
    need(cfg.flip in data.DeviceLoader.FLIPS, f"flip must be one of {data.DeviceLoader.FLIPS}, got {cfg.flip!r}")
    need(cfg.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {cfg.device!r}")
    need(cfg.device != "cuda" or torch.cuda.is_available(), "device='cuda' but torch sees no GPU here")
    need(not cfg.cuda_graph or (cfg.device != "cpu" and torch.cuda.is_available()),
         "cuda_graph=True needs a GPU: CUDA graphs record GPU kernels")
    need(cfg.tta in (0, 1, 2), f"tta must be 0, 1 or 2, got {cfg.tta}")
    need(cfg.bucket_cap_mb > 0, f"bucket_cap_mb must be positive, got {cfg.bucket_cap_mb}")
    need(cfg.comm_hook in COMM_HOOKS, f"comm_hook must be one of {list(COMM_HOOKS)}, got {cfg.comm_hook!r}")
    for name in ("per_class", "test_per_class", "max_steps", "fail_at_step"):
        value = getattr(cfg, name)
        need(value is None or value >= 1, f"{name} must be at least 1 (or None for all), got {value}")
    need(cfg.eval_every >= 0, f"eval_every must be >= 0, got {cfg.eval_every}")
    need(cfg.log_every >= 1, f"log_every must be at least 1, got {cfg.log_every}")
    need(cfg.resume in (None, "auto") or os.path.isfile(cfg.resume), f"no checkpoint file at resume={cfg.resume!r}")
    need(cfg.resume != "auto" or cfg.checkpoint, "resume='auto' looks for the files that checkpoint names: "
                                                 "set checkpoint too")
    need(cfg.fail_rank >= 0, f"fail_rank must be >= 0, got {cfg.fail_rank}")
    need(cfg.data is None or os.path.isdir(cfg.data), f"data folder {cfg.data!r} does not exist")


# ------------------------------------------------------------------ setup
def setup_distributed(cfg):
    """Join the process group. Returns True if we created it (and so must destroy it).

    Under `launch` the group already exists; under torchrun the environment says where
    to meet (env://); in a plain process we make a world of one, so the same code runs.
    """
    if dist.is_initialized():
        return False
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_gpu = cfg.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    backend = "nccl" if use_gpu else "gloo"
    if use_gpu:
        torch.cuda.set_device(local_rank)  # before init: NCCL binds this rank to its own GPU
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank) if use_gpu else None)
    else:  # no peers: an in-memory store, and Gloo listens on loopback only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def pick_device(cfg):
    """One device per process: GPU `LOCAL_RANK` with NCCL, else the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    gpu_for_me = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    if cfg.device == "cuda" or (cfg.device == "auto" and gpu_for_me and dist.get_backend() == "nccl"):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass
class Trainer:
    """Everything one rank trains with."""
    cfg: Config
    device: torch.device
    rank: int
    world_size: int
    model: torch.nn.Module          # the DDP wrapper (a plain module when world_size == 1)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: data.DeviceLoader
    test_loader: data.DeviceLoader
    total_steps: int
    forward_backward: typing.Callable = None   # (images, labels) -> loss; set by build()
    slow: Optional["Lookahead"] = None         # with cfg.lookahead; set when training starts
    step: int = 0
    start_epoch: int = 0

    @property
    def module(self):
        """The model inside the DDP wrapper: what we evaluate and save."""
        return self.model.module if isinstance(self.model, DDP) else self.model

    def autocast(self):
        """bf16 matrix work on GPUs (same range as fp32: no loss scaling needed); fp32 on CPU."""
        # A captured CUDA graph must not use autocast's cache of cast weights.
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda",
                              cache_enabled=not self.cfg.cuda_graph)


def build(cfg, device):
    """Data, model, optimizer and schedule for this rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_set = data.load_cifar10(train=True, root=cfg.data, per_class=cfg.per_class)
    test_set = data.load_cifar10(train=False, root=cfg.data, per_class=cfg.test_per_class)
    train_loader = data.DeviceLoader(train_set, cfg.batch_size, train=True, device=device, rank=rank,
                                     world_size=world_size, seed=cfg.seed, pad=cfg.crop_pad, flip=cfg.flip)
    test_loader = data.DeviceLoader(test_set, 1024, train=False, device=device, rank=rank,
                                    world_size=world_size)
    if len(train_loader) == 0:
        raise ValueError(f"batch_size={cfg.batch_size} on each of {world_size} ranks is more than the "
                         f"{len(train_set.labels)} training images: lower batch_size or use more data")
    total_steps = len(train_loader) * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = models.build_model(cfg.model, cfg.width, whiten=cfg.whiten, identity_init=cfg.identity_init,
                               bn_weights=cfg.bn_weights)
    model = model.to(device, memory_format=torch.channels_last)
    # CUDA graphs: DDP is built on the stream the graph will be captured on (ddp_helpers.cuda_graph)
    stream = side_stream(device) if cfg.cuda_graph else None
    if world_size > 1:  # with one process DDP would only add work
        # gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, which saves
        # copying them back out every step (each new gradient is still copied in).
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_cap_mb,
                        **version_dependent_ddp_options(cfg))
            if COMM_HOOKS[cfg.comm_hook]:
                model.register_comm_hook(None, COMM_HOOKS[cfg.comm_hook])
    groups = param_groups(model, cfg)
    optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    # Linear up for `warmup` of the steps from lr * lr_start, then linear down to lr * lr_end.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[g["lr"] for g in groups], total_steps=total_steps, pct_start=cfg.warmup,
        anneal_strategy="linear", cycle_momentum=False, div_factor=1 / cfg.lr_start,
        final_div_factor=cfg.lr_start / cfg.lr_end)
    t = Trainer(cfg, device, rank, world_size, model, optimizer, scheduler, train_loader, test_loader,
                total_steps)
    t.forward_backward = functools.partial(forward_backward, t)
    if cfg.cuda_graph:
        t.forward_backward = CapturedStep(t.forward_backward, stream)
    return t


def param_groups(model, cfg):
    """The trained parameters in SGD groups: BatchNorm shifts at norm_bias_lr x lr (with weight
    decay divided by as much, so that lr x decay, what decay takes per step, stays), the rest
    at lr. Frozen parameters (requires_grad=False) are left out."""
    norm_shifts = {id(m.bias) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    trained = [p for p in model.parameters() if p.requires_grad]
    shifts = [p for p in trained if id(p) in norm_shifts]
    if cfg.norm_bias_lr == 1 or not shifts:
        return [dict(params=trained, lr=cfg.lr, weight_decay=cfg.weight_decay)]
    return [dict(params=[p for p in trained if id(p) not in norm_shifts], lr=cfg.lr, weight_decay=cfg.weight_decay),
            dict(params=shifts, lr=cfg.lr * cfg.norm_bias_lr, weight_decay=cfg.weight_decay / cfg.norm_bias_lr)]


def version_dependent_ddp_options(cfg):
    """DDP arguments whose spelling or existence depends on the installed PyTorch.

    - Broadcasting rank 0's buffers before every forward: on by default; torch 2.14 renamed the
      argument from broadcast_buffers to forward_sync_buffers (and warns about the old name).
    - batched_grad_copy (torch 2.12+): DDP's autograd hooks copy each new gradient into its bucket,
      one small kernel per parameter (62 for ResNet-18). With it, the copies of a bucket wait until
      the bucket is full and run as one foreach copy and one division: fewer, larger kernels.
    """
    accepted = inspect.signature(DDP.__init__).parameters
    options = {}
    if not cfg.broadcast_buffers:
        options["forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"] = False
    if cfg.batched_grad_copy and "batched_grad_copy" in accepted:
        options["batched_grad_copy"] = True
    return options


# --------------------------------------------------------------- training
def train_one_epoch(t, epoch, record):
    """One pass over this rank's share of the training set. Returns the seconds it took."""
    t.model.train()
    t.train_loader.set_epoch(epoch)  # without it every epoch would repeat the first one's order
    losses, lrs = [], []             # since the last log; losses stay on the device (no waiting)
    epoch_start = window_start = time.perf_counter()
    for i, (images, labels) in enumerate(t.train_loader, start=1):
        lrs.append(t.scheduler.get_last_lr()[0])
        loss = t.forward_backward(images, labels)
        t.optimizer.step()
        t.scheduler.step()
        t.step += 1
        if t.slow and (t.step % t.cfg.lookahead == 0 or t.step == t.total_steps):
            t.slow.step(keep=1.0 if t.step == t.total_steps else t.slow.keep(t.step, t.total_steps))
        if t.step == t.cfg.fail_at_step:
            inject_fault(t)
        losses.append(loss)
        finished = t.step == t.total_steps
        if t.step % t.cfg.log_every == 0 or i == len(t.train_loader) or finished:
            log_steps(t, epoch, losses, lrs, window_start, record)
            losses, lrs, window_start = [], [], time.perf_counter()
        if finished:
            break
    return time.perf_counter() - epoch_start


class Lookahead:
    """A slow copy of the weights (and BatchNorm statistics) that the fast ones are pulled back to.

    Every few steps: slow <- keep * slow + (1 - keep) * fast, then fast <- slow. `keep` grows
    from 0 (no effect) to about 0.77 as training ends, so the last steps are averaged rather
    than taken one by one; at the end the weights become the slow copy. This is airbench's
    "lookahead" (github.com/KellerJordan/cifar10-airbench), a cousin of weight averaging.
    Every rank does the same arithmetic on the same weights, so DDP's ranks stay identical.
    """

    def __init__(self, module, every):
        self.every = every
        self.fast = [v for v in module.state_dict().values() if v.is_floating_point()]
        self.slow = [v.detach().clone() for v in self.fast]

    def keep(self, step, total_steps):
        return 0.95 ** self.every * (step / total_steps) ** 3

    @torch.no_grad()
    def step(self, keep):
        torch._foreach_lerp_(self.slow, self.fast, 1 - keep)
        torch._foreach_copy_(self.fast, self.slow)


def forward_backward(t, images, labels):
    """The loss of one batch, and its gradients (averaged over ranks by DDP) in .grad."""
    t.optimizer.zero_grad(set_to_none=True)
    with t.autocast():
        loss = F.cross_entropy(t.model(images), labels, label_smoothing=t.cfg.label_smoothing)
    loss.backward()  # DDP all-reduces the gradients here, bucket by bucket, during backward
    return loss.detach()


def inject_fault(t):
    """--fail-at-step: rank --fail-rank dies here as a crashed machine's process would: SIGKILL,
    no exception, no cleanup, no goodbye to its peers. Only in the first attempt, so that the
    group torchrun restarts (TORCHELASTIC_RESTART_COUNT=1, 2, ...) can finish the run."""
    if t.rank == t.cfg.fail_rank and restart_count() == 0:
        say(f"rank {t.rank}: injected fault at step {t.step}: SIGKILL to myself")
        os.kill(os.getpid(), signal.SIGKILL)


def restart_count():
    """How many times torchrun has restarted the worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def log_steps(t, epoch, losses, lrs, window_start, record):
    """Add the last steps to the record, with every rank's loss: one all_gather.

    Copying the gathered table to the CPU waits for the GPU to finish those steps,
    so the clock read after it measures real time.
    """
    peak = torch.cuda.max_memory_allocated(t.device) / 1e9 if t.device.type == "cuda" else 0.0
    mine = torch.cat([torch.stack(losses).float(), torch.tensor([peak], device=t.device)])
    everyone = [torch.empty_like(mine) for _ in range(t.world_size)]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu()  # (ranks, steps + 1): losses, then peak memory
    images_per_s = len(losses) * t.cfg.batch_size * t.world_size / (time.perf_counter() - window_start)
    first = t.step - len(losses) + 1
    steps = [{"step": first + i, "epoch": epoch, "loss": table[:, i].tolist(), "lr": lr,
              "images_per_s": images_per_s} for i, lr in enumerate(lrs)]
    if t.device.type == "cuda":
        for s in steps:
            s["peak_memory_gb"] = table[:, -1].tolist()
    record["steps"] += steps
    if t.rank == 0 and t.cfg.live:
        emit({"kind": "steps", "steps": steps})
    if t.rank == 0 and t.cfg.verbose:
        last = table[:, -2]
        say(f"step {t.step}/{t.total_steps}  epoch {epoch + 1}  loss {last.mean():.3f} "
            f"(per rank: {', '.join(f'{x:.3f}' for x in last.tolist())})  {images_per_s:,.0f} images/s")


@torch.no_grad()
def evaluate(t):
    """Test loss and accuracy over the whole test set: each rank scores its share, then one
    all_reduce sums (loss, correct, count) over ranks."""
    model = t.module
    model.eval()
    loss_sum, correct = torch.zeros((), device=t.device), torch.zeros((), device=t.device)
    for images, labels in t.test_loader:
        with t.autocast():
            logits = predict(model, images, t.cfg.tta)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum")  # sums stay on the device: no waiting
        correct += (logits.argmax(1) == labels).sum()
    count = torch.tensor(float(len(t.test_loader.indices())), device=t.device)
    totals = torch.stack([loss_sum, correct, count])
    dist.all_reduce(totals)  # SUM over ranks
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


def predict(model, images, tta=0):
    """Logits, averaged over test-time augmentations: a mirrored image is as much a cat as the
    original, so averaging both views cancels some of each one's mistakes.
    tta=1: the image and its mirror; tta=2: half that, half the same for the image moved
    one pixel up-left and one pixel down-right (edges mirrored, as in training's crops)."""
    def with_mirror(x):
        return (model(x).float() + model(x.flip(-1)).float()) / 2 if tta else model(x).float()

    logits = with_mirror(images)
    if tta == 2:
        padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
        h, w = images.shape[-2:]
        shifted = (with_mirror(padded[..., :h, :w]) + with_mirror(padded[..., 2:, 2:])) / 2
        logits = (logits + shifted) / 2
    return logits


# ------------------------------------------------------------- checkpoints
def save_checkpoint(t, path, epoch):
    """Rank 0 writes the whole training state; the others wait until the file is complete.

    The first barrier makes sure every rank finished the epoch; the second that nobody
    goes on (and maybe reads the file) before it exists. Written under a temporary name
    and renamed, so a crash mid-write never leaves half a checkpoint.
    """
    barrier(t)
    if t.rank == 0:
        state = {"model": t.module.state_dict(), "optimizer": t.optimizer.state_dict(),
                 "scheduler": t.scheduler.state_dict(), "epoch": epoch, "step": t.step,
                 "config": dataclasses.asdict(t.cfg)}
        if t.slow:
            state["lookahead"] = t.slow.slow
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    barrier(t)


def newest_checkpoint(pattern):
    """What --resume auto continues from: of the files `pattern` names ({epoch} in it, or one
    fixed name), the one with the highest epoch; None when there is none yet."""
    parts = re.split(r"\{epoch(?::[^}]*)?\}", pattern)
    if len(parts) == 1:
        return pattern if os.path.isfile(pattern) else None
    number = re.compile(r"(\d+)".join(map(re.escape, parts)) + "$")
    found = {}
    for path in glob.glob("*".join(map(glob.escape, parts))):
        match = number.match(path)
        if match:
            found[int(match.group(1))] = path
    return found[max(found)] if found else None


def find_resume(t):
    """The checkpoint to load, or None. For --resume auto, rank 0 looks and tells the others,
    so every rank loads the same file (or none)."""
    path = t.cfg.resume
    if path == "auto":
        choice = [newest_checkpoint(t.cfg.checkpoint) if t.rank == 0 else None]
        dist.broadcast_object_list(choice, src=0)
        path = choice[0]
        if t.rank == 0 and t.cfg.verbose and path is None:
            say("resume auto: no checkpoint yet, starting from scratch")
    return path


def load_checkpoint(t, path):
    """Every rank reads the checkpoint onto its own device (map_location: tensors saved
    from cuda:0 would otherwise all land on cuda:0) and continues after its epoch.
    Returns what was saved."""
    state = torch.load(path, map_location=t.device, weights_only=True)
    t.module.load_state_dict(state["model"])
    t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    t.step, t.start_epoch = state["step"], state["epoch"] + 1
    return state


# ------------------------------------------------------------------- run
def run(**settings):
    """Train with the given settings (see Config, or `--help`); return the record.

    record["steps"]:  per step: step, epoch, loss (one per rank), images_per_s (over the
                      last log_every steps, all ranks), lr, peak_memory_gb (per rank, GPU only)
    record["epochs"]: per epoch: train_loss (mean over ranks), test_loss, test_accuracy,
                      seconds (training only), images_per_s
    and the final test_loss, test_accuracy, train_seconds (training only), eval_seconds
    (final evaluation), total_seconds (from the first step to the final accuracy, all
    included), peak_memory_gb (per rank, GPU only), device, world_size, backend, config.
    """
    cfg = make_config(**settings)
    created = setup_distributed(cfg)
    try:
        return train(cfg)
    finally:
        if created:
            dist.destroy_process_group()


def train(cfg):
    """The training loop proper, inside a process group."""
    device = pick_device(cfg)
    if cfg.cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs this rank on a GPU, but it is on {device} "
                         f"({dist.get_backend()} backend)")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # pick the fastest conv algorithms for these shapes
        torch.cuda.reset_peak_memory_stats(device)
    t = build(cfg, device)
    try:
        return train_with(t)
    finally:
        if isinstance(t.forward_backward, CapturedStep):
            t.forward_backward.release()
        # forward_backward refers back to t: without breaking that cycle the whole trainer (its data
        # on the device included) would stay in memory until Python's garbage collector runs.
        t.forward_backward = None


def train_with(t):
    """Train and evaluate with everything built."""
    cfg, device = t.cfg, t.device
    if cfg.fail_at_step is not None and cfg.fail_rank >= t.world_size:
        raise ValueError(f"fail_rank={cfg.fail_rank} but there are only {t.world_size} rank(s)")
    resume = find_resume(t)
    saved = load_checkpoint(t, resume) if resume else None
    record = {"config": dataclasses.asdict(cfg), "device": str(device), "world_size": t.world_size,
              "backend": dist.get_backend(), "total_steps": t.total_steps, "steps": [], "epochs": [],
              "train_seconds": 0.0, "resumed_from": resume, "start_step": t.step,
              "restart_count": restart_count()}
    announce(t)

    synchronize(t)  # start the clock together, with nothing left queued on the GPU
    start = time.perf_counter()
    if cfg.whiten and t.step == 0:  # a start from data is part of the time to accuracy
        t.module.whiten_from(data.normalize(t.train_loader.images[:5000]))
    if cfg.lookahead:
        t.slow = Lookahead(t.module, cfg.lookahead)
        if saved and "lookahead" in saved:
            torch._foreach_copy_(t.slow.slow, saved["lookahead"])
    for epoch in range(t.start_epoch, cfg.epochs):
        if t.step >= t.total_steps:
            break
        first_step = len(record["steps"])
        seconds = train_one_epoch(t, epoch, record)
        record["train_seconds"] += seconds
        summary = epoch_summary(t, epoch, seconds, record["steps"][first_step:])
        last_epoch = t.step >= t.total_steps or epoch == cfg.epochs - 1
        if cfg.eval_every and (epoch + 1) % cfg.eval_every == 0 and not last_epoch:
            summary["test_loss"], summary["test_accuracy"] = evaluate(t)
            report_epoch(t, summary)
        if cfg.checkpoint:
            save_checkpoint(t, cfg.checkpoint.format(epoch=epoch), epoch)
        record["epochs"].append(summary)

    eval_start = time.perf_counter()
    record["test_loss"], record["test_accuracy"] = evaluate(t)  # its all_reduce result waits for the GPU
    record["eval_seconds"] = time.perf_counter() - eval_start
    record["total_seconds"] = time.perf_counter() - start  # time to accuracy: training + evaluations
    if record["epochs"]:
        record["epochs"][-1].update(test_loss=record["test_loss"], test_accuracy=record["test_accuracy"])
        report_epoch(t, record["epochs"][-1])
    if device.type == "cuda":
        record["peak_memory_gb"] = gather_floats(torch.cuda.max_memory_allocated(device) / 1e9, device)
    if t.rank == 0 and cfg.live:
        emit({"kind": "end", "test_accuracy": record["test_accuracy"], "test_loss": record["test_loss"]})
    if t.rank == 0 and cfg.verbose:
        say(f"done: test accuracy {record['test_accuracy']:.2%}, test loss {record['test_loss']:.3f}, "
            f"{record['train_seconds']:.1f} s of training")
    return record


def synchronize(t):
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    barrier(t)


def barrier(t):
    """dist.barrier, naming this rank's GPU under NCCL (else NCCL guesses it, and warns)."""
    dist.barrier(device_ids=[t.device.index] if dist.get_backend() == "nccl" else None)


def epoch_summary(t, epoch, seconds, steps):
    loss = sum(sum(s["loss"]) for s in steps) / (len(steps) * t.world_size)  # mean over steps and ranks
    return {"epoch": epoch, "seconds": seconds, "train_loss": loss,
            "images_per_s": len(steps) * t.cfg.batch_size * t.world_size / seconds}


def announce(t):
    if t.rank == 0 and t.cfg.live:
        emit({"kind": "start", "total_steps": t.total_steps, "start_step": t.step, "epochs": t.cfg.epochs,
              "world_size": t.world_size, "model": t.cfg.model, "device": t.device.type})
    if t.rank == 0 and t.cfg.verbose:
        say(f"{t.cfg.model} on {t.world_size} rank(s), {t.device.type}, {dist.get_backend()}: "
            f"{len(t.train_loader)} steps/epoch of {t.cfg.batch_size} images per rank")
        if restart_count():
            say(f"restarted by torchrun: TORCHELASTIC_RESTART_COUNT={restart_count()}")
        if t.step:
            where = f"epoch {t.start_epoch + 1}" if t.step < t.total_steps else "nothing left to train"
            say(f"resumed at step {t.step}/{t.total_steps} ({where})")


def report_epoch(t, summary):
    if t.rank == 0 and t.cfg.live:
        emit({"kind": "epoch", **summary})
    if t.rank == 0 and t.cfg.verbose:
        say(f"epoch {summary['epoch'] + 1}/{t.cfg.epochs}  train loss {summary['train_loss']:.3f}  "
            f"test loss {summary['test_loss']:.3f}  test accuracy {summary['test_accuracy']:.2%}  "
            f"{summary['images_per_s']:,.0f} images/s")


def gather_floats(value, device):
    """One number from each rank, as a list in rank order."""
    mine = torch.tensor([float(value)], device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [x.item() for x in everyone]


def emit(message):
    say(METRICS_PREFIX + json.dumps(message))


def say(line):
    """Print one line with a single write. torchrun runs workers unbuffered (python -u), where print()
    writes the text and the newline separately, and lines of ranks sharing a log could merge."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# -------------------------------------------------------------------- CLI
def setting_type(name):
    """The plain type of a Config field: Optional[int] -> int."""
    kind = typing.get_type_hints(Config)[name]
    return next((a for a in typing.get_args(kind) if a is not type(None)), kind)


def parse_args(argv=None):
    """Command-line flags, one per Config field, with its default and help."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp_helpers.train",
        description="Train CIFAR-10 with DDP. Start with torchrun, e.g. torchrun --standalone "
                    "--nproc-per-node=2 -m ddp_helpers.train --width 16 --epochs 2",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kind = setting_type(f.name)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"],
                                metavar=f.name.upper())
    args = parser.parse_args(argv)
    try:
        return make_config(**vars(args))
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and the usage line, like argparse's own errors


def main(argv=None):
    cfg = parse_args(argv)
    record = run(**dataclasses.asdict(cfg))
    return 0 if math.isfinite(record["test_loss"]) else 1


if __name__ == "__main__":
    code = main()
    # The process group is destroyed and the checkpoints are written. Skip the interpreter's
    # teardown: after a torchrun restart we saw it abort the finished workers in C++ thread
    # destructors ("terminate called without an active exception"), failing a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
