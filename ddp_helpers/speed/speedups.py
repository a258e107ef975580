"""`Speedups`: the speed layer's plug-in for the reference trainer (a subclass of `train.Plain`), and
the functions its methods use (the step, test-time augmentation, SGD's parameter groups).

    cfg, speedups = speed.check(model="fastnet", whiten=True)   # speed/__init__.py: check and run
    record = train.run(recipe=speedups, **dataclasses.asdict(cfg))

It replaces the model, the DDP wrapper, the data loaders (`device_loader.DeviceLoader`), the
optimizer (with `lookahead.Lookahead`), the step (with `cuda_graph.CapturedStep`) and the prediction.
With every option at its default, `Speedups` is the trainer as it was measured before the split
from the reference trainer: data on the device, channels_last, SGD groups and a one-cycle schedule.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import data, models, train
from ..compat import ddp_options
from ..settings import option
from .cuda_graph import CapturedStep, side_stream
from .device_loader import DeviceLoader
from .lookahead import Lookahead

# DDP communication hooks by name (Speedups.comm_hook): what DDP does with each bucket of gradients.
COMM_HOOKS = {"none": None,  # DDP's own all-reduce
              "bf16": default_hooks.bf16_compress_hook}


@dataclass
class Speedups(train.Plain):
    # the model (fastnet only)
    whiten: bool = option(False, "fastnet: a fixed first layer that whitens 2x2 patches, set from the training "
                                 "images before training")
    identity_init: bool = option(False, "fastnet: each 3x3 conv starts by passing its input channels through")
    bn_weights: bool = option(True, "fastnet: BatchNorm scales learn (False: fixed at 1, only the shifts learn)")
    channels_last: bool = option(True, "lay images and weights out channels-last (what GPU convolutions prefer)")
    compile: bool = option(False, "torch.compile the model (with DDP: the DDP-wrapped model)")
    # the optimizer and its schedule
    momentum: float = option(0.9, "SGD (Nesterov) momentum")
    weight_decay: float = option(5e-4, "L2 penalty on all weights")
    norm_bias_lr: float = option(1.0, "BatchNorm shifts learn this many times faster (their decay per step stays)")
    warmup: float = option(0.25, "fraction of the steps spent raising the learning rate")
    lr_start: float = option(0.1, "the learning rate starts at this fraction of lr")
    lr_end: float = option(0.001, "and ends at this fraction of lr")
    lookahead: int = option(0, "every N steps pull the weights to a slow average of their past values, weighed "
                               "more as training ends; the final weights are that average (0: off)")
    label_smoothing: float = option(0.1, "share of each target spread over the other classes")
    # the data
    device_loader: bool = option(True, "keep the data set on the device and augment whole epochs there "
                                       "(speed.device_loader); False: the reference trainer's DataLoader")
    crop_pad: int = option(4, "random crops shift images by up to this many pixels (device_loader only)")
    flip: str = option("random", "random, alternate (each image mirrored in every other epoch) or none "
                                 "(device_loader only)")
    tta: int = option(0, "test-time augmentation: 0 none; 1 average each image's logits with its mirror's; "
                         "2 also with the image shifted by a pixel up-left and down-right")
    # DDP and the step
    bucket_cap_mb: float = option(25.0, "DDP: gradients are all-reduced in buckets of about this many MB")
    broadcast_buffers: bool = option(True, "DDP: send rank 0's buffers (BatchNorm statistics) before every forward "
                                           "(DDP's forward_sync_buffers; broadcast_buffers before torch 2.13)")
    batched_grad_copy: bool = option(True, "DDP: copy a bucket's gradients in one go (PyTorch 2.12+)")
    comm_hook: str = option("none", "DDP: none, or bf16 (gradients travel as bfloat16: half the bytes)")
    cuda_graph: bool = option(False, "GPU: record a step's forward and backward once as a CUDA graph and "
                                     "replay it (speed.cuda_graph)")
    cudnn_benchmark: bool = option(True, "GPU: cuDNN times each convolution algorithm at a shape's first step "
                                         "(seconds, once) and keeps the fastest; pays in long runs")

    # ---- the plug-in's methods, called by train.build and the training loop
    def loaders(self, cfg: train.Config, device: torch.device) -> tuple[Iterable, Iterable]:
        self.close()  # a fresh start if this object ran before
        if not self.device_loader:
            return super().loaders(cfg, device)
        train_set = data.load_cifar10(True, cfg.data, cfg.per_class)
        test_set = data.load_cifar10(False, cfg.data, cfg.test_per_class)
        ranks = dict(rank=dist.get_rank(), world_size=dist.get_world_size())
        self._train_images = train_set.images
        return (DeviceLoader(train_set, cfg.batch_size, train=True, device=device, seed=cfg.seed,
                                  pad=self.crop_pad, flip=self.flip, **ranks),
                DeviceLoader(test_set, 1024, train=False, device=device, **ranks))

    def build_model(self, cfg: train.Config, device: torch.device) -> torch.nn.Module:
        torch.manual_seed(cfg.seed)
        model = models.build_model(cfg.model, cfg.width, whiten=self.whiten, identity_init=self.identity_init,
                                   bn_weights=self.bn_weights)
        model = model.to(device, memory_format=torch.channels_last if self.channels_last else torch.preserve_format)
        if self.whiten:  # a few milliseconds on a GPU
            images = getattr(self, "_train_images", None)
            if images is None:
                images = data.load_cifar10(True, cfg.data, cfg.per_class).images
            model.whiten_from(data.normalize(images[:5000].to(device)))
        return model

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if self.cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs this rank on a GPU, but it is on {device} "
                             f"({dist.get_backend()} backend)")
        self._cudnn_benchmark_was = torch.backends.cudnn.benchmark   # put back by close()
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        # CUDA graphs: DDP is built on the stream the graph will be captured on (speed.cuda_graph)
        self._stream = side_stream(device) if self.cuda_graph else None
        if dist.get_world_size() > 1:  # with one process, DDP would only add work
            with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
                # gradient_as_bucket_view: gradients live inside DDP's buckets, saving a copy out of them
                model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            gradient_as_bucket_view=True, bucket_cap_mb=self.bucket_cap_mb,
                            **ddp_options(self.broadcast_buffers, self.batched_grad_copy))
                if COMM_HOOKS[self.comm_hook]:
                    model.register_comm_hook(None, COMM_HOOKS[self.comm_hook])
        return torch.compile(model) if self.compile else model

    def optimizer(self, model: torch.nn.Module, cfg: train.Config, total_steps: int
                  ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        groups = param_groups(model, cfg.lr, self.weight_decay, self.norm_bias_lr)
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=self.momentum, nesterov=True)
        # Linear up for `warmup` of the steps from lr * lr_start, then linear down to lr * lr_end.
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[g["lr"] for g in groups], total_steps=total_steps, pct_start=self.warmup,
            anneal_strategy="linear", cycle_momentum=False, div_factor=1 / self.lr_start,
            final_div_factor=self.lr_start / self.lr_end)
        if self.lookahead:
            Lookahead(model, self.lookahead, total_steps).attach(optimizer)
        return optimizer, schedule

    def forward_backward(self, model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.cuda_graph:
            return step(model, images, labels, self.label_smoothing)
        if getattr(self, "_captured", None) is None:
            # A captured graph must not use autocast's cache of cast weights.
            self._captured = CapturedStep(functools.partial(step, model, label_smoothing=self.label_smoothing,
                                                            autocast_cache=False), self._stream)
            if not self.device_loader:  # the DataLoader's pin-memory thread calls CUDA while we capture:
                self._captured.capture_error_mode = "thread_local"  # only this thread's calls must be capturable
        return self._captured(images, labels)

    def predict(self, model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
        with torch.autocast(images.device.type, torch.bfloat16, enabled=images.is_cuda,
                            cache_enabled=not self.cuda_graph):
            return predict(model, images, self.tta)

    def close(self) -> None:
        """Free the CUDA graph before destroy_process_group (which otherwise waits forever)."""
        captured = getattr(self, "_captured", None)
        if captured is not None:
            captured.release()
        if getattr(self, "_cudnn_benchmark_was", None) is not None:
            torch.backends.cudnn.benchmark = self._cudnn_benchmark_was
        self._captured = self._stream = self._train_images = self._cudnn_benchmark_was = None


def step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, label_smoothing: float,
         autocast_cache: bool = True) -> torch.Tensor:
    """The loss of one batch, and its gradients (averaged over ranks by DDP) in .grad."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(images.device.type, torch.bfloat16, enabled=images.is_cuda, cache_enabled=autocast_cache):
        loss = F.cross_entropy(model(images), labels, label_smoothing=label_smoothing)
    loss.backward()
    return loss.detach()


def predict(model: torch.nn.Module, images: torch.Tensor, tta: int = 0) -> torch.Tensor:
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
        logits = (logits + (with_mirror(padded[..., :h, :w]) + with_mirror(padded[..., 2:, 2:])) / 2) / 2
    return logits


def param_groups(model: torch.nn.Module, lr: float, weight_decay: float, norm_bias_lr: float) -> list[dict]:
    """The trained parameters in SGD groups: BatchNorm shifts at norm_bias_lr x lr (with weight decay
    divided by as much, so that lr x decay, what decay takes per step, stays), the rest at lr.
    Frozen parameters (requires_grad=False) are left out."""
    norm_shifts = {id(m.bias) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    trained = [p for p in model.parameters() if p.requires_grad]
    shifts = [p for p in trained if id(p) in norm_shifts]
    if norm_bias_lr == 1 or not shifts:
        return [dict(params=trained, lr=lr, weight_decay=weight_decay)]
    return [dict(params=[p for p in trained if id(p) not in norm_shifts], lr=lr, weight_decay=weight_decay),
            dict(params=shifts, lr=lr * norm_bias_lr, weight_decay=weight_decay / norm_bias_lr)]


# ------------------------------------------------------------ the settings' checks
SPEED_OPTIONS = [f.name for f in dataclasses.fields(Speedups)]


def speed_checks(s: Speedups, cfg: train.Config) -> list[tuple[bool, str]]:
    fastnet = cfg.model == "fastnet"
    gpu = cfg.device != "cpu" and torch.cuda.is_available()
    return [(fastnet or not (s.whiten or s.identity_init or not s.bn_weights),
             "whiten, identity_init and bn_weights=False are for model='fastnet' only"),
            (s.lookahead >= 0, f"lookahead must be >= 0 (0: off), got {s.lookahead}"),
            (0 < s.warmup < 1, f"warmup must be between 0 and 1 (a fraction of the steps), got {s.warmup}"),
            (0 < s.lr_start <= 1 and 0 < s.lr_end <= 1, f"lr_start and lr_end are fractions of lr in (0, 1], "
                                                         f"got {s.lr_start} and {s.lr_end}"),
            (s.norm_bias_lr > 0, f"norm_bias_lr must be positive, got {s.norm_bias_lr}"),
            (0 <= s.momentum < 1, f"momentum must be in [0, 1), got {s.momentum}"),
            (s.weight_decay >= 0, f"weight_decay must be >= 0, got {s.weight_decay}"),
            (0 <= s.label_smoothing < 1, f"label_smoothing must be in [0, 1), got {s.label_smoothing}"),
            (0 <= s.crop_pad <= 16, f"crop_pad must be between 0 and 16 pixels, got {s.crop_pad}"),
            (s.flip in DeviceLoader.FLIPS, f"flip must be one of {DeviceLoader.FLIPS}, got {s.flip!r}"),
            (s.device_loader or (s.crop_pad == 4 and s.flip == "random"),
             "crop_pad and flip are options of the device loader: with device_loader=False the reference "
             "DataLoader crops by up to 4 pixels and flips at random"),
            (s.tta in (0, 1, 2), f"tta must be 0, 1 or 2, got {s.tta}"),
            (s.bucket_cap_mb > 0, f"bucket_cap_mb must be positive, got {s.bucket_cap_mb}"),
            (s.comm_hook in COMM_HOOKS, f"comm_hook must be one of {list(COMM_HOOKS)}, got {s.comm_hook!r}"),
            (not s.cuda_graph or gpu, "cuda_graph=True needs a GPU: CUDA graphs record GPU kernels")]
