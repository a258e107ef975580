"""The speed layer: what made DDP training fast on H200s, kept apart from the reference trainer.

    from ddp_helpers import speed
    record = launch(speed.run, world_size=2, backend="nccl", kwargs=speed.recipes.FAST)[0]
    record = launch(speed.run, 1, "nccl", kwargs=dict(model="resnet18", cuda_graph=True, max_steps=300))[0]

`speed.run(**settings)` takes the reference trainer's settings (`train.Config`) and the options of
`Speedups` below, in one set of keywords, and runs `train.run` with a `Speedups` object: the
trainer's plug-in (a subclass of `train.Plain`), which replaces the model, the DDP wrapper, the
data loaders, the optimizer, the step and the prediction. Notebook 07 (the performance lab)
measures what each one buys; `speed.recipes` holds the measured settings.
With every option at its default, `Speedups` is the trainer as it was measured before this
split: data on the device, channels_last, SGD groups and a one-cycle schedule of its own.
"""
import contextlib
import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import data, models, settings as settings_, train
from ..settings import option
from . import recipes  # noqa: F401 (speed.recipes)
from .cuda_graph import CapturedStep, side_stream

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
                                       "(data.DeviceLoader); False: the reference trainer's DataLoader")
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

    # ---- the plug-in's methods, called by train.build and the training loop
    def loaders(self, cfg, device):
        self.close()  # a fresh start if this object ran before
        if not self.device_loader:
            return super().loaders(cfg, device)
        train_set = data.load_cifar10(True, cfg.data, cfg.per_class)
        test_set = data.load_cifar10(False, cfg.data, cfg.test_per_class)
        ranks = dict(rank=dist.get_rank(), world_size=dist.get_world_size())
        self._train_images = train_set.images
        return (data.DeviceLoader(train_set, cfg.batch_size, train=True, device=device, seed=cfg.seed,
                                  pad=self.crop_pad, flip=self.flip, **ranks),
                data.DeviceLoader(test_set, 1024, train=False, device=device, **ranks))

    def build_model(self, cfg, device):
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

    def wrap(self, model, device):
        if self.cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs this rank on a GPU, but it is on {device} "
                             f"({dist.get_backend()} backend)")
        # CUDA graphs: DDP is built on the stream the graph will be captured on (speed.cuda_graph)
        self._stream = side_stream(device) if self.cuda_graph else None
        if dist.get_world_size() > 1:  # with one process, DDP would only add work
            with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
                # gradient_as_bucket_view: gradients live inside DDP's buckets, saving a copy out of them
                model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            gradient_as_bucket_view=True, bucket_cap_mb=self.bucket_cap_mb,
                            **version_dependent_ddp_options(self))
                if COMM_HOOKS[self.comm_hook]:
                    model.register_comm_hook(None, COMM_HOOKS[self.comm_hook])
        return torch.compile(model) if self.compile else model

    def optimizer(self, model, cfg, total_steps):
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

    def forward_backward(self, model, images, labels):
        if not self.cuda_graph:
            return step(model, images, labels, self.label_smoothing)
        if getattr(self, "_captured", None) is None:
            # A captured graph must not use autocast's cache of cast weights.
            self._captured = CapturedStep(functools.partial(step, model, label_smoothing=self.label_smoothing,
                                                            autocast_cache=False), self._stream)
            if not self.device_loader:  # the DataLoader's pin-memory thread calls CUDA while we capture:
                self._captured.capture_error_mode = "thread_local"  # only this thread's calls must be capturable
        return self._captured(images, labels)

    def predict(self, model, images):
        with torch.autocast(images.device.type, torch.bfloat16, enabled=images.is_cuda,
                            cache_enabled=not self.cuda_graph):
            return predict(model, images, self.tta)

    def close(self):
        """Free the CUDA graph before destroy_process_group (which otherwise waits forever)."""
        captured = getattr(self, "_captured", None)
        if captured is not None:
            captured.release()
        self._captured = self._stream = self._train_images = None


def step(model, images, labels, label_smoothing, autocast_cache=True):
    """The loss of one batch, and its gradients (averaged over ranks by DDP) in .grad."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(images.device.type, torch.bfloat16, enabled=images.is_cuda, cache_enabled=autocast_cache):
        loss = F.cross_entropy(model(images), labels, label_smoothing=label_smoothing)
    loss.backward()
    return loss.detach()


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
        logits = (logits + (with_mirror(padded[..., :h, :w]) + with_mirror(padded[..., 2:, 2:])) / 2) / 2
    return logits


def param_groups(model, lr, weight_decay, norm_bias_lr):
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


def version_dependent_ddp_options(speedups):
    """DDP arguments whose spelling or existence depends on the installed PyTorch.

    - Broadcasting rank 0's buffers before every forward: on by default; torch 2.13 renamed the
      argument from broadcast_buffers to forward_sync_buffers (the old name warns; torch 2.11 has
      only it). One difference: broadcast_buffers=False also skips the buffers' broadcast when DDP
      wraps the model, forward_sync_buffers=False does not (here every rank builds the same
      buffers, so both start equal).
    - batched_grad_copy (torch 2.12+): DDP's autograd hooks copy each new gradient into its bucket,
      one small kernel per parameter (62 for ResNet-18). With it, the copies of a bucket wait until
      the bucket is full and run as one foreach copy and one division: fewer, larger kernels.
    """
    accepted = inspect.signature(DDP.__init__).parameters
    options = {}
    if not speedups.broadcast_buffers:
        options["forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"] = False
    if speedups.batched_grad_copy and "batched_grad_copy" in accepted:
        options["batched_grad_copy"] = True
    return options


class Lookahead:
    """A slow copy of the weights (and BatchNorm statistics) that the fast ones are pulled back to.

    Every few steps: slow <- keep * slow + (1 - keep) * fast, then fast <- slow. `keep` grows
    from 0 (no effect) to about 0.77 as training ends, so the last steps are averaged rather
    than taken one by one; at the end the weights become the slow copy. This is airbench's
    "lookahead" (github.com/KellerJordan/cifar10-airbench), a cousin of weight averaging.
    Every rank does the same arithmetic on the same weights, so DDP's ranks stay identical.
    It runs after each optimizer step (a step hook) and is saved with the optimizer's state.
    """

    def __init__(self, model, every, total_steps):
        self.every, self.total_steps, self.steps = every, total_steps, 0
        self.fast = [v for v in model.state_dict().values() if v.is_floating_point()]
        self.slow = [v.detach().clone() for v in self.fast]

    def attach(self, optimizer):
        optimizer.register_step_post_hook(self.after_step)
        optimizer.register_state_dict_post_hook(self.save)
        optimizer.register_load_state_dict_pre_hook(self.load)

    def keep(self, step):
        return 1.0 if step == self.total_steps else 0.95 ** self.every * (step / self.total_steps) ** 3

    @torch.no_grad()
    def pull(self, keep):
        torch._foreach_lerp_(self.slow, self.fast, 1 - keep)
        torch._foreach_copy_(self.fast, self.slow)

    def after_step(self, optimizer, args, kwargs):
        self.steps += 1
        if self.steps % self.every == 0 or self.steps == self.total_steps:
            self.pull(self.keep(self.steps))

    def save(self, optimizer, state_dict):
        state_dict["lookahead"] = {"slow": self.slow, "steps": self.steps}
        return state_dict

    def load(self, optimizer, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop("lookahead")
        torch._foreach_copy_(self.slow, saved["slow"])
        self.steps = saved["steps"]
        return state_dict


# ------------------------------------------------------------ settings and run
SPEED_OPTIONS = [f.name for f in dataclasses.fields(Speedups)]


def speed_checks(s, cfg):
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
            (s.flip in data.DeviceLoader.FLIPS, f"flip must be one of {data.DeviceLoader.FLIPS}, got {s.flip!r}"),
            (s.device_loader or (s.crop_pad == 4 and s.flip == "random"),
             "crop_pad and flip are options of the device loader: with device_loader=False the reference "
             "DataLoader crops by up to 4 pixels and flips at random"),
            (s.tta in (0, 1, 2), f"tta must be 0, 1 or 2, got {s.tta}"),
            (s.bucket_cap_mb > 0, f"bucket_cap_mb must be positive, got {s.bucket_cap_mb}"),
            (s.comm_hook in COMM_HOOKS, f"comm_hook must be one of {list(COMM_HOOKS)}, got {s.comm_hook!r}"),
            (not s.cuda_graph or gpu, "cuda_graph=True needs a GPU: CUDA graphs record GPU kernels")]


def check(**settings):
    """(train.Config, Speedups) from one set of keywords; a clear error for unknown names or bad values."""
    names = set(train.Config.__dataclass_fields__) | set(SPEED_OPTIONS)
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; the trainer's: {', '.join(train.Config.__dataclass_fields__)}; "
                        f"the speed layer's: {', '.join(SPEED_OPTIONS)}")
    cfg = train.make_config(**{k: v for k, v in settings.items() if k not in SPEED_OPTIONS})
    speedups = settings_.make(Speedups, lambda s: speed_checks(s, cfg),
                             **{k: v for k, v in settings.items() if k in SPEED_OPTIONS})
    return cfg, speedups


def run(**settings):
    """train.run with the speed layer: returns the record (see train.run)."""
    cfg, speedups = check(**settings)
    return train.run(recipe=speedups, **dataclasses.asdict(cfg))


def setting_type(name):
    """The plain type of a trainer or speed-layer setting: Optional[int] -> int."""
    return settings_.setting_type(Speedups if name in SPEED_OPTIONS else train.Config, name)
