"""Train CIFAR-10 with DistributedDataParallel: the course's reference trainer, to read top to bottom.

    torchrun --standalone --nproc-per-node=2 -m ddp_helpers.train --width 16 --epochs 2    # a shell
    launch(train.run, world_size=2, backend="gloo", kwargs=dict(width=16, epochs=2))       # a notebook
    python -m ddp_helpers.train --epochs 1                                                 # one process

Every rank runs the same code on its own device: join the process group, wrap the model in DDP
(which averages the gradients across ranks during backward), train on its share of each epoch,
evaluate its share of the test set and sum the counts over ranks. Rank 0 saves checkpoints;
`--resume auto` continues from the newest after torchrun restarts the group (from the one before
it, saying so, when the newest cannot be read).
The choices that a speed layer may replace (model, DDP wrapper, data loaders and batches, optimizer, the
step, prediction) are the methods of `Plain`; `ddp_helpers.speed.Speedups` is such a layer.
"""
import dataclasses
import math
import os
import signal
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision.transforms import v2

from . import data, machine, models
from . import settings as settings_
from .checkpoint_files import checkpoint_checks, load_whole, newest_readable, resume_checks, write_privately
from .compat import barrier, exit_skipping_teardown, loopback_interface, one_gpu_per_rank
from .progress import Log, restart_count, say

option = settings_.option


@dataclass
class Config:
    model: str = option("fastnet", "fastnet (small, fast) or resnet18")
    width: int = option(64, "fastnet's first block width (16 for CPU runs); resnet18 ignores it")
    data: str | None = option(None, f"folder with train/ and test/ class folders; default: "
                              f"${data.ENV_VAR}, else torchvision's CIFAR10 (downloaded once)")
    per_class: int | None = option(None, "train on the first N images of each class only")
    test_per_class: int | None = option(None, "evaluate on the first N test images of each class only")
    epochs: int = option(10, "passes over the training set")
    batch_size: int = option(256, "images per step on each rank (the global batch is this x ranks)")
    lr: float = option(0.4, "peak learning rate of the one-cycle schedule")
    seed: int = option(0, "same seed, same run: initial weights, shuffling, augmentation")
    device: str = option("auto", "auto (this rank's GPU if there is one for it), cuda or cpu")
    max_steps: int | None = option(None, "stop after this many steps (the schedule is fitted to them)")
    eval_every: int = option(1, "evaluate on the test set every N epochs (0: only at the end)")
    log_every: int = option(10, "gather every rank's loss every N steps")
    checkpoint: str | None = option(None, "after each epoch rank 0 saves the training state here "
                                    "({epoch} in the name: one file per epoch)")
    resume: str | None = option(None, "continue from a checkpoint file; auto: from the newest one "
                                "--checkpoint names, if any (for torchrun restarts)")
    fail_at_step: int | None = option(None, "fault injection: at this step rank --fail-rank kills "
                                      "itself (SIGKILL), in torchrun's first attempt only")
    fail_rank: int = option(0, "the rank that --fail-at-step kills")
    verbose: bool = option(True, "rank 0 prints progress")
    live: bool = option(False, "rank 0 prints metric lines for ddp_helpers.live")


def checks(c: Config) -> list[tuple[bool, str]]:
    """What makes a run impossible, found before any process starts: (ok, message) pairs."""
    below_1 = [f"{n}={getattr(c, n)}" for n in ("width", "epochs", "batch_size", "log_every", "per_class",
               "test_per_class", "max_steps", "fail_at_step") if getattr(c, n) is not None and getattr(c, n) < 1]
    return [(c.model in models.MODELS, f"model must be one of {list(models.MODELS)}, got {c.model!r}"),
            (not below_1, f"{', '.join(below_1)}: must be at least 1"),
            (0 < c.lr < math.inf, f"lr must be a positive, finite number, got {c.lr}"),  # nan fails too
            (c.eval_every >= 0 and c.fail_rank >= 0, f"eval_every and fail_rank must be >= 0, got "
                                                     f"{c.eval_every} and {c.fail_rank}"),
            (c.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {c.device!r}"),
            (c.device != "cuda" or torch.cuda.is_available(), "device='cuda' but torch sees no GPU here"),
            (c.resume in (None, "auto") or os.path.isfile(c.resume), f"no checkpoint at resume={c.resume!r}"),
            (c.resume != "auto" or c.checkpoint, "resume='auto' looks for the files checkpoint names: set it"),
            (c.data is None or os.path.isdir(c.data), f"data folder {c.data!r} does not exist"),
            (not c.per_class or c.batch_size <= 10 * c.per_class,  # a schedule of no steps
             f"batch_size={c.batch_size} is more than the training set (per_class={c.per_class}: "
             f"{10 * (c.per_class or 0)} images): no step"),
            *checkpoint_checks(c.checkpoint), *resume_checks(c.resume)]


def make_config(**settings) -> Config:
    """A checked Config: a clear error for an unknown name or a bad value, before any work."""
    return settings_.make(Config, checks, **settings)


# ------------------------------------------------------------------ 1. setup
def setup(cfg: Config) -> tuple[torch.device, bool]:
    """Join the process group and pick this rank's device. Returns (device, whether we made the
    group).

    Under `launch` the group already exists; under torchrun the environment says where to meet
    (env://); in a plain process we make a world of one, so the same code runs everywhere.
    One device per process: GPU number LOCAL_RANK with NCCL, else the CPU with Gloo.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    made = not dist.is_initialized()
    if made:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        gpu = cfg.device != "cpu" and one_gpu_per_rank(local_world)  # NCCL: a GPU for each rank
        if gpu:
            torch.cuda.set_device(local_rank)  # before init: NCCL binds this rank to its own GPU
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if gpu else "gloo",
                                    device_id=torch.device("cuda", local_rank) if gpu else None)
        else:  # no peers: an in-memory store, and Gloo listens on loopback only
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
            dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
    if cfg.device == "cuda" or (cfg.device == "auto" and dist.get_backend() == "nccl"):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), made
    return torch.device("cpu"), made


# ------------------------------------------------------- 2-5. the plain choices
# Per-image normalisation with torchvision's transforms, as most examples write it. This trainer normalises
# whole batches on the device instead (Plain.prepare); notebook 07 compares the two.
NORMALIZE = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(data.MEAN, data.STD)]


class Plain:
    """How this trainer builds a run. A speed layer subclasses it and replaces methods."""

    def build_model(self, cfg: Config, device: torch.device) -> nn.Module:
        torch.manual_seed(cfg.seed)  # the same initial weights on all ranks (DDP sends rank 0's)
        return models.build_model(cfg.model, cfg.width).to(device)

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """DDP: one device per process; gradients are averaged over ranks during backward."""
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def loaders(self, cfg: Config, device: torch.device) -> tuple[DataLoader, DataLoader]:
        """This rank's share of the training set (reshuffled each epoch) and of the test set:
        batches of uint8 images and their labels (`prepare` readies them on the device)."""
        train_set = data.Images(data.load_cifar10(True, cfg.data, cfg.per_class))
        test_set = data.Images(data.load_cifar10(False, cfg.data, cfg.test_per_class))
        # DistributedSampler: rank r takes every world_size-th index of one shuffled order, the same
        # on all ranks; drop_last: every rank takes the same number of steps (all-reduces pair up).
        sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
        workers = {}
        if device.type == "cuda":  # processes gather the next batches while the GPU computes
            cores = machine.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # this rank's
            workers = dict(num_workers=min(4, max(1, cores - 1)), pin_memory=True,
                           persistent_workers=True)  # workers stay up from epoch to epoch
        train_loader = DataLoader(train_set, cfg.batch_size, sampler=sampler, drop_last=True,
                                  **workers)
        # Test: rank r scores images r, r + W, r + 2W, ...: each image exactly once
        # (DistributedSampler would pad with repeats, which would be counted twice).
        mine = Subset(test_set, range(dist.get_rank(), len(test_set), dist.get_world_size()))
        return train_loader, DataLoader(mine, 1000)

    def prepare(self, images: Tensor, labels: Tensor, device: torch.device,
                randomness: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """A batch on this rank's device, ready for the model. In training (`randomness`: a random
        generator) each image is cropped at random (shifted by up to 4 pixels, edges mirrored) and
        flipped with probability 1/2; then all are scaled to mean 0 and std 1 per channel. A few
        operations on the whole batch, where per-image transforms take a dozen per image."""
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        if images.dtype != torch.uint8:  # its loader prepared it (the speed layer's DeviceLoader)
            return images, labels
        if randomness is not None:
            images = data.augment(images, pad=4, generator=randomness).contiguous()
        return data.normalize(images), labels

    def optimizer(self, model: nn.Module, cfg: Config, total_steps: int):
        """SGD with Nesterov momentum; the learning rate rises for a quarter of the steps, then
        falls."""
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True,
                                    weight_decay=5e-4)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, cfg.lr, total_steps=total_steps, pct_start=rise(0.25, total_steps),
            anneal_strategy="linear", cycle_momentum=False)
        return optimizer, schedule

    def forward_backward(self, model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
        """The loss of one batch; its gradients, averaged over ranks by DDP, land in .grad."""
        model.zero_grad(set_to_none=True)  # else backward adds to the last step's gradients
        with torch.autocast(images.device.type, torch.bfloat16, enabled=images.is_cuda):
            loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
        loss.backward()  # DDP all-reduces the gradients here, bucket by bucket, during backward
        return loss.detach()

    def predict(self, model: nn.Module, images: Tensor) -> Tensor:
        with torch.autocast(images.device.type, torch.bfloat16, enabled=images.is_cuda):
            return model(images).float()

    def close(self) -> None:
        """Free what the run holds before the process group goes (nothing here)."""


def rise(share: float, total_steps: int) -> float:
    """OneCycleLR's pct_start. Its rise ends at step share x total_steps - 1; at step 0 (4 steps of
    0.25) it divides by zero, so there the rise takes 2 steps instead of 1."""
    return 2 / total_steps if share * total_steps == 1 and total_steps >= 2 else share


@dataclass
class Trainer:
    """Everything one rank trains with."""
    cfg: Config
    recipe: Plain
    device: torch.device
    module: torch.nn.Module          # the model itself: what we evaluate and save
    model: torch.nn.Module           # what we train: the module wrapped in DDP
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader
    test_loader: DataLoader
    total_steps: int
    rank: int = field(default_factory=dist.get_rank)
    world_size: int = field(default_factory=dist.get_world_size)
    backend: str = field(default_factory=dist.get_backend)
    step: int = 0
    start_epoch: int = 0
    log: Log = None                  # the record, and what rank 0 prints (ddp_helpers.progress)


def build(cfg: Config, recipe: Plain, device: torch.device) -> Trainer:
    if cfg.fail_at_step and cfg.fail_rank >= dist.get_world_size():
        raise ValueError(f"fail_rank={cfg.fail_rank}, but there are {dist.get_world_size()} rank(s)")
    train_loader, test_loader = recipe.loaders(cfg, device)
    if len(train_loader) == 0:
        raise ValueError(f"batch_size={cfg.batch_size} on each of {dist.get_world_size()} ranks is more "
                         f"than the training set: lower batch_size or use more data")
    total_steps = min(len(train_loader) * cfg.epochs, cfg.max_steps or math.inf)
    module = recipe.build_model(cfg, device)
    model = recipe.wrap(module, device)
    optimizer, schedule = recipe.optimizer(model, cfg, total_steps)
    return Trainer(cfg, recipe, device, module, model, optimizer, schedule, train_loader, test_loader, total_steps)


# ------------------------------------------------------------- 6. training
def run(recipe: Plain | None = None, **settings) -> dict:
    """Train with the given settings (Config, or --help); every rank returns the same record
    (ddp_helpers.progress): steps (loss per rank, lr, images/s), epochs, test_loss, test_accuracy,
    train_seconds, total_seconds (first step to final accuracy), peak_memory_gb (GPU), config."""
    cfg = make_config(**settings)
    recipe = recipe or Plain()
    device, made_group = setup(cfg)
    try:
        return train(build(cfg, recipe, device))
    finally:
        recipe.close()
        if made_group:
            dist.destroy_process_group()


def train(t: Trainer) -> dict:
    speedups = dataclasses.asdict(t.recipe) if dataclasses.is_dataclass(t.recipe) else {}
    t.log = Log(t, {**dataclasses.asdict(t.cfg), **speedups}, restart_count())
    resume, state = find_resume(t)
    if resume:
        load_checkpoint(t, resume, state)
    t.log.start(t, resume)
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    barrier(t.device)  # start the clock together, nothing left queued on the GPU
    start = time.perf_counter()
    for epoch in range(t.start_epoch, t.cfg.epochs):
        if t.step >= t.total_steps:
            break
        seconds = train_one_epoch(t, epoch)
        last = t.step >= t.total_steps or epoch == t.cfg.epochs - 1
        test_now = t.cfg.eval_every and (epoch + 1) % t.cfg.eval_every == 0 and not last
        t.log.epoch(t, epoch, seconds, evaluate(t) if test_now else None)
        if t.cfg.checkpoint:
            save_checkpoint(t, t.cfg.checkpoint.format(epoch=epoch), epoch)
    eval_start = time.perf_counter()
    test_loss, accuracy = evaluate(t)
    now = time.perf_counter()
    return t.log.end(t, test_loss, accuracy, now - eval_start, now - start)  # time to accuracy: all included


def train_one_epoch(t: Trainer, epoch: int) -> float:
    """One pass over this rank's share of the training set; returns the seconds it took."""
    t.model.train()
    t.train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch (else all repeat the first)
    # Crops and flips: each rank its own, from (seed, epoch, rank): a resumed run draws the same.
    randomness = torch.Generator(t.device).manual_seed(t.cfg.seed * 1000 + epoch * 10 + t.rank)
    losses, lrs = [], []
    start = window = time.perf_counter()
    for i, (images, labels) in enumerate(t.train_loader, start=1):
        images, labels = t.recipe.prepare(images, labels, t.device, randomness)
        lrs.append(t.schedule.get_last_lr()[0])
        losses.append(t.recipe.forward_backward(t.model, images, labels))  # on the device: no wait
        t.optimizer.step()
        t.schedule.step()
        t.step += 1
        if t.step == t.cfg.fail_at_step and t.rank == t.cfg.fail_rank and restart_count() == 0:
            say(f"rank {t.rank}: injected fault at step {t.step}: SIGKILL to myself")
            os.kill(os.getpid(), signal.SIGKILL)  # as a crashed machine's process dies: no goodbye
        done = t.step == t.total_steps
        if t.step % t.cfg.log_every == 0 or i == len(t.train_loader) or done:
            log_steps(t, epoch, losses, lrs, window)
            losses, lrs, window = [], [], time.perf_counter()
        if done:
            break
    return time.perf_counter() - start


def log_steps(t: Trainer, epoch: int, losses: list, lrs: list, window_start: float) -> None:
    """Every rank's loss for the last steps, in one all_gather (its copy to the CPU waits for the
    GPU)."""
    peak = torch.cuda.max_memory_allocated(t.device) / 1e9 if t.device.type == "cuda" else 0.0
    mine = torch.cat([torch.stack(losses).float(), torch.tensor([peak], device=t.device)])
    everyone = [torch.empty_like(mine) for _ in range(t.world_size)]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu()  # (ranks, steps + 1): losses, then peak memory
    images_per_s = len(lrs) * t.cfg.batch_size * t.world_size / (time.perf_counter() - window_start)
    t.log.steps(t, epoch, table, lrs, images_per_s)


@torch.no_grad()
def evaluate(t: Trainer) -> tuple[float, float]:
    """Each rank scores its share of the test set; one all_reduce sums (loss, correct, count) over
    ranks."""
    t.module.eval()
    # BatchNorm's running statistics: DDP sends rank 0's to all ranks before each training
    # forward (its default), then each rank's forward updates its copy from its own shard: they
    # differ by the last step (by all of training with forward_sync_buffers=False). t.module runs
    # no DDP forward, so send rank 0's here: every rank evaluates the model that rank 0 saves
    for buffer in t.module.buffers():
        dist.broadcast(buffer, src=0)
    totals = torch.zeros(3, device=t.device)
    for images, labels in t.test_loader:
        images, labels = t.recipe.prepare(images, labels, t.device)
        logits = t.recipe.predict(t.module, images)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # SUM over ranks: every rank gets the same accuracy
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


# ----------------------------------------------------------- 7. checkpoints
def save_checkpoint(t: Trainer, path: str, epoch: int) -> None:
    """Rank 0 writes the training state while the others wait: the first barrier makes sure every
    rank finished the epoch, the second that nobody goes on before the file exists."""
    barrier(t.device)
    if t.rank == 0:
        state = {"model": t.module.state_dict(), "optimizer": t.optimizer.state_dict(),
                 "schedule": t.schedule.state_dict(), "epoch": epoch, "step": t.step,
                 "total_steps": t.total_steps, "steps_per_epoch": len(t.train_loader)}
        write_privately(state, path)
    barrier(t.device)


SAVED = ("model", "optimizer", "schedule", "epoch", "step")   # what save_checkpoint writes, at least


def read_checkpoint(path: str, device: torch.device) -> dict:
    """The training state saved at `path`, on this rank's device (map_location: tensors saved from cuda:0
    would otherwise all land on cuda:0). A file cut short, damaged or of another program is refused,
    saying why (checkpoint_files.load_whole)."""
    return load_whole(path, map_location=device, keys=SAVED)


def find_resume(t: Trainer) -> tuple[str | None, dict | None]:
    """The checkpoint to load and, where this rank has read it already, its state; or (None, None).
    For --resume auto rank 0 reads the newest file, or the newest it can read (saying which it passed
    over, in one line), and tells the others; when none can be read, every rank stops with that error."""
    if t.cfg.resume != "auto":
        return t.cfg.resume, None
    read = lambda p: read_checkpoint(p, t.device)
    path, state, message = newest_readable(t.cfg.checkpoint, read) if t.rank == 0 else (None, None, None)
    choice = [path, message]
    dist.broadcast_object_list(choice, src=0)
    path, message = choice
    if path is None and message:
        raise ValueError(message)
    if path is None:
        t.log.tell(None, "resume auto: no checkpoint yet, starting from scratch")
    elif message and t.rank == 0:
        say(message)
    return path, state


def load_checkpoint(t: Trainer, path: str, state: dict | None = None) -> None:
    """Continue after the checkpoint's epoch: with the settings it was saved with, exactly as if
    never stopped. With another length, batch size or world size, this run's schedule is moved on
    to the step this run would be at, and a line says so (weights and momentum come from the
    checkpoint). `state`: the file's, where this rank has read it already."""
    state = read_checkpoint(path, t.device) if state is None else state
    t.module.load_state_dict(state["model"])
    t.start_epoch = state["epoch"] + 1
    t.step = min(t.start_epoch * len(t.train_loader), t.total_steps)
    saved = state["optimizer"]
    total = state.get("total_steps", state["schedule"].get("total_steps"))
    if (state["step"], total, settings_of(saved["param_groups"])) == (
            t.step, t.total_steps, settings_of(t.optimizer.param_groups)):
        t.optimizer.load_state_dict(saved)
        t.schedule.load_state_dict(state["schedule"])
        return
    mine = t.optimizer.state_dict()["param_groups"]  # this run's settings, the saved momentum
    t.optimizer.load_state_dict({"state": saved["state"], "param_groups": [
        dict(group, params=old["params"]) for group, old in zip(mine, saved["param_groups"])]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
        for _ in range(t.step):
            t.schedule.step()
    if t.rank == 0:
        per_epoch = state.get("steps_per_epoch", state["step"] // t.start_epoch)
        say(f"resume: schedule re-made for {t.total_steps} steps ({len(t.train_loader)} an epoch); "
            f"the checkpoint's run had {total} ({per_epoch} an epoch)")


def settings_of(param_groups: list[dict]) -> list[dict]:
    """An optimizer's settings (learning rates, momentum, ...), without its parameters and current lr."""
    return [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in param_groups]


# ---------------------------------------------------------------- 10. CLI
def parse_args(argv: list[str] | None = None) -> Config:
    return settings_.parse_args(Config, checks, argv, prog="python -m ddp_helpers.train",
                                description="Train CIFAR-10 with DDP. Start it with torchrun, e.g. torchrun "
                                "--standalone --nproc-per-node=2 -m ddp_helpers.train --width 16 --epochs 2")


def main(argv: list[str] | None = None) -> int:
    record = run(**dataclasses.asdict(parse_args(argv)))  # 9: run() destroys the group it made
    return 0 if math.isfinite(record["test_loss"]) else 1


if __name__ == "__main__":
    exit_skipping_teardown(main())   # checkpoints written, group destroyed: see compat
