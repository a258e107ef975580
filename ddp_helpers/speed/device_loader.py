"""The speed layer's data loader: one rank's share of a data set, kept on the device, augmented an
epoch at a time there (`Speedups(device_loader=True)`, the default).

    train_set = data.load_cifar10(train=True)            # data.Split: uint8 images, int64 labels
    loader = DeviceLoader(train_set, batch_size=256, train=True, device="cuda:0",
                          rank=dist.get_rank(), world_size=dist.get_world_size())
    for epoch in range(epochs):
        loader.set_epoch(epoch)                          # a new shuffle, shared by all ranks
        for images, labels in loader: ...                # normalised float images on the device

The data themselves come from `ddp_helpers.data` (sources, and `augment` / `normalize`, which the
reference trainer uses a batch at a time); this module is how the speed layer feeds a step.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler

from ..data import Split, augment, normalize


class DeviceLoader:
    """Batches of one rank's share of a Split, from uint8 images kept on `device`.

    The whole split lives on the device (150 MB for CIFAR-10's training set); each epoch
    a DistributedSampler picks this rank's share, so shares change with `set_epoch` as
    in any DDP loop. At the start of each epoch the share is gathered, augmented and
    normalised in one go on the device (a few large operations instead of a dozen small
    ones per step, whose launch costs would add up; 300 MB of float32 for 25,000 images),
    then served in slices: no worker processes, no copies from the host, the GPU never
    waits for data. Works the same with device="cpu".

    The next epoch's order is drawn halfway through this one, while the GPU still has
    steps queued. Drawing it takes the CPU milliseconds (the sampler's shuffle is a Python
    list); at the epoch's end, where the training loop waits for the GPU to log, the GPU
    would sit idle that long (measured: notebooks/reference/recipe_sweeps.json, epoch_boundary_gap).

    train=True:  shuffled, augmented, incomplete last batch dropped (every rank must take
                 the same number of steps, or DDP's all-reduces would wait forever).
    train=False: every image exactly once across ranks (rank r takes r, r+W, r+2W, ...),
                 no augmentation, last batch kept: metrics summed over ranks are exact.
    flip: "random" (each image mirrored with probability 1/2, anew every epoch; or True), "none" (or False), or
          "alternate": a random half mirrored in even epochs, the other half in odd ones, so
          over two epochs every image is seen both ways (airbench's trick; fewer repeats).
    """
    FLIPS = ("random", "alternate", "none")

    def __init__(self, split: Split, batch_size: int, train: bool, device: str | torch.device = "cpu",
                 rank: int = 0, world_size: int = 1, seed: int = 0, pad: int = 4, flip: str | bool = "random") -> None:
        if isinstance(flip, bool):  # the older spelling
            flip = "random" if flip else "none"
        if flip not in self.FLIPS:
            raise ValueError(f"flip must be one of {self.FLIPS}, got {flip!r}")
        self.images = split.images.to(device)
        self.labels = split.labels.to(device)
        self.batch_size, self.train, self.device = batch_size, train, torch.device(device)
        self.rank, self.seed, self.pad, self.flip = rank, seed, pad, flip
        self.world_size = world_size
        self.drawn = None  # (epoch, order on the device): the next epoch's order, drawn early
        if flip == "alternate":  # one draw for all epochs, the same on every rank (seeded on the CPU)
            first = torch.rand(len(self.labels), generator=torch.Generator().manual_seed(seed)) < 0.5
            self.mirrored_in_even_epochs = first.to(device)
        if train:
            self.sampler = DistributedSampler(range(len(self.labels)), num_replicas=world_size,
                                              rank=rank, shuffle=True, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch (or loader.sampler.set_epoch, as with a DataLoader): the shuffle and
        the augmentation depend on it."""
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self.train else 0

    def indices(self) -> torch.Tensor:
        """This rank's examples for this epoch, in order."""
        if self.train:
            return torch.tensor(list(self.sampler), dtype=torch.int64)
        return torch.arange(self.rank, len(self.labels), self.world_size)

    def flips(self, order: torch.Tensor) -> bool | torch.Tensor:
        """What augment() should mirror, for the images `order` names, this epoch."""
        if self.flip != "alternate":
            return self.flip == "random"
        return self.mirrored_in_even_epochs[order] ^ (self.epoch % 2 == 1)

    def __len__(self) -> int:
        if self.train:
            return len(self.sampler) // self.batch_size
        share = len(range(self.rank, len(self.labels), self.world_size))
        return -(-share // self.batch_size)

    def order_on_device(self) -> torch.Tensor:
        """This epoch's examples for this rank, in order, whole batches only, on the device."""
        order = self.indices()[:len(self) * self.batch_size]
        if self.device.type == "cuda":  # from pinned memory the copy does not wait for the GPU to be idle
            order = order.pin_memory()
        return order.to(self.device, non_blocking=True)

    def draw_next_epoch(self) -> None:
        """Draw the next epoch's order now (see the class's docstring for why)."""
        epoch = self.epoch
        self.sampler.set_epoch(epoch + 1)
        self.drawn = (epoch + 1, self.order_on_device())
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.drawn is not None and self.drawn[0] == self.epoch:
            order = self.drawn[1]
        else:
            order = self.order_on_device()
        self.drawn = None
        images, labels = self.images[order], self.labels[order]
        if self.train:
            # One random stream per (seed, epoch, rank): a resumed run augments exactly as before.
            generator = torch.Generator(self.device).manual_seed(
                (self.seed * 1_000_003 + self.epoch) * 1009 + self.rank)
            images = augment(images, self.pad, self.flips(order), generator)
        else:
            images = images.contiguous(memory_format=torch.channels_last)
        images = normalize(images)
        for i, start in enumerate(range(0, len(order), self.batch_size)):
            yield images[start:start + self.batch_size], labels[start:start + self.batch_size]
            if self.train and i == len(self) // 2:
                self.draw_next_epoch()
