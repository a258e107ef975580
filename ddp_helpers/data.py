"""CIFAR-10 for distributed training: where the images come from, and how a batch is augmented.

    train_set = load_cifar10(train=True)            # Split: uint8 images (N, 3, 32, 32), int64 labels
    images = normalize(augment(train_set.images[:256], pad=4))   # a random crop and flip, then mean 0, std 1

The data sources only: the reference trainer (`train`) feeds them through a DataLoader, the speed
layer through `speed.device_loader.DeviceLoader` (the data kept on the device).

Where the images come from, in this order:
1. `root=` or the environment variable DDP_HELPERS_CIFAR10: a folder with train/ and test/,
   each holding one folder per class (torchvision's ImageFolder layout);
2. torchvision's CIFAR10 in `download_root` (default ~/.cache/ddp_helpers/torchvision),
   downloaded by rank 0 alone when it is not there yet.
Without either, and without network, `DataNotFoundError` says how to get the data.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .compat import barrier
from .files import atomic_write

ENV_VAR = "DDP_HELPERS_CIFAR10"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN = (0.4914, 0.4822, 0.4465)   # CIFAR-10 training set, per channel, on a 0-1 scale
STD = (0.2470, 0.2435, 0.2616)
REACH_TIMEOUT_S = 5.0             # how long to wait for the download server before giving up


class Split(NamedTuple):
    """One split of the data set, whole, in memory: a few dozen MB for CIFAR-10."""
    images: torch.Tensor   # (N, 3, 32, 32) uint8
    labels: torch.Tensor   # (N,) int64, CIFAR-10's numbering (CLASSES[label] is the name)


class DataNotFoundError(FileNotFoundError):
    """No copy of CIFAR-10 here and no way to download one."""


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddp_helpers")


def load_cifar10(train: bool = True, root: str | None = None, per_class: int | None = None,
                 download_root: str | None = None) -> Split:
    """The training (or test) split as uint8 tensors on the CPU.

    root:      a folder with train/ and test/ class folders; default: $DDP_HELPERS_CIFAR10,
               else torchvision's copy in `download_root` (downloaded if missing).
    per_class: keep only the first `per_class` images of each class (fast CPU runs).
    Inside a process group, rank 0 does the slow part first (download, decoding) while the
    others wait at a barrier, then they read what it left: downloading in every rank at
    once races on the same files.
    """
    folder, download_root, need_download = where_to_read(root, download_root)
    with rank_zero_first():
        if folder:
            split = read_folder(folder, "train" if train else "test", per_class)
        else:
            split = read_torchvision(download_root, train, download=need_download)
    if per_class is not None and not folder:
        split = first_per_class(split, per_class)
    return split


def where_to_read(root: str | None = None, download_root: str | None = None) -> tuple[str | None, str | None, bool]:
    """(class-folder copy or None, torchvision's folder, whether to download), or DataNotFoundError."""
    folder = root or os.environ.get(ENV_VAR) or None
    need_download = False
    if folder:
        check_folder(folder)
    else:
        download_root = download_root or os.path.join(cache_dir(), "torchvision")
        need_download = not torchvision_copy_present(download_root)
        if need_download and not reachable(torchvision_url()):
            raise DataNotFoundError(how_to_get_data(download_root))
    return folder, download_root, need_download


def download_if_missing(root: str | None = None, download_root: str | None = None) -> None:
    """Download torchvision's copy now, in this process, if the ranks would have to: they live in a
    network of their own (`runtime.private_net`) with no way out. Call it before starting them."""
    folder, download_root, need_download = where_to_read(root, download_root)
    if need_download:
        import torchvision
        torchvision.datasets.CIFAR10(download_root, train=True, download=True)   # both splits: one archive


def unavailable_reason() -> str | None:
    """Why CIFAR-10 cannot be had here (no copy, no network), or None when it can."""
    try:
        where_to_read()
    except DataNotFoundError as err:
        return str(err)
    return None


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the block while the other ranks wait; then they run it too."""
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if group and dist.get_rank() != 0:
        barrier()
    yield
    if group and dist.get_rank() == 0:
        barrier()


def how_to_get_data(download_root: str) -> str:
    return (
        "CIFAR-10 was not found and cannot be downloaded (no network). Either\n"
        f"  - point the environment variable {ENV_VAR} (or the `root` argument) at a folder with\n"
        "    train/ and test/, each holding one folder per class (airplane, automobile, ...), or\n"
        f"  - download it once with internet access: python -c \"import torchvision; "
        f"torchvision.datasets.CIFAR10({download_root!r}, download=True)\"\n"
        "    (or copy an existing cifar-10-batches-py folder there).")


# ------------------------------------------------------------- a class-folder copy
def check_folder(folder: str) -> None:
    for split in ("train", "test"):
        if not os.path.isdir(os.path.join(folder, split)):
            raise DataNotFoundError(
                f"{folder!r} (from the root argument or ${ENV_VAR}) has no {split}/ folder: a local "
                f"CIFAR-10 copy needs train/ and test/, each with one folder per class "
                f"({', '.join(CLASSES)}).")


def read_folder(folder: str, split: str, per_class: int | None = None) -> Split:
    """Decode the PNG/JPEG files of `folder/split` once; later calls read a tensor cache."""
    import torchvision  # imported here: it takes a second, and only this path needs it
    dataset = torchvision.datasets.ImageFolder(os.path.join(folder, split))
    if tuple(dataset.classes) != CLASSES:
        raise DataNotFoundError(f"{folder}/{split} should hold the 10 CIFAR-10 class folders "
                                f"{list(CLASSES)}, found {dataset.classes}")
    samples = dataset.samples  # sorted by class, then by file name
    if per_class is not None:
        samples = [s for s, rank_in_class in zip(samples, _rank_in_class([y for _, y in samples]))
                   if rank_in_class < per_class]
    cache_file = _cache_file(folder, split, samples)
    with contextlib.suppress(Exception):  # missing or damaged cache: decode again
        saved = torch.load(cache_file, weights_only=True)
        return Split(saved["images"], saved["labels"])
    split_data = Split(_decode([path for path, _ in samples]),
                       torch.tensor([label for _, label in samples], dtype=torch.int64))
    _save_atomically(split_data._asdict(), cache_file)
    return split_data


def _rank_in_class(labels):
    seen = {}
    for y in labels:
        seen[y] = seen.get(y, -1) + 1
        yield seen[y]


def _decode(paths):
    from PIL import Image
    pixels = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])  # (N, 32, 32, 3)
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()


def _cache_file(folder, split, samples):
    """Cache name from the folder and every file's name and size: any change makes a new one."""
    key = hashlib.sha1(os.path.abspath(folder).encode())
    for path, _ in samples:
        key.update(f"{os.path.relpath(path, folder)}:{os.path.getsize(path)}\n".encode())
    return os.path.join(cache_dir(), "tensors", f"cifar10-{split}-{len(samples)}-{key.hexdigest()[:16]}.pt")


def _save_atomically(obj, path):
    """The cache file, written whole or not at all (`files.atomic_write`: only the owner can read it,
    as with every file ddp_helpers writes)."""
    try:
        with atomic_write(path) as f:
            torch.save(obj, f)
    except OSError:  # a read-only home or a full disk: no cache, decode every time (no half file left)
        pass


# ------------------------------------------------------------ torchvision's copy
def torchvision_url() -> str:
    import torchvision
    return torchvision.datasets.CIFAR10.url


def torchvision_copy_present(download_root: str) -> bool:
    """Are torchvision's files there? (Their checksums are checked when they are read.)"""
    import torchvision
    cifar = torchvision.datasets.CIFAR10
    folder = os.path.join(download_root, cifar.base_folder)
    return all(os.path.isfile(os.path.join(folder, name)) for name, _ in cifar.train_list + cifar.test_list)


def read_torchvision(download_root: str, train: bool, download: bool) -> Split:
    import torchvision
    dataset = torchvision.datasets.CIFAR10(download_root, train=train, download=download)
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    return Split(images, torch.tensor(dataset.targets, dtype=torch.int64))


def reachable(url: str, timeout_s: float | None = None) -> bool:
    """Can we open a connection to the server of `url`? Answers within `timeout_s`, always:
    name lookup ignores socket timeouts, so the attempt runs in a thread we stop waiting for."""
    timeout_s = REACH_TIMEOUT_S if timeout_s is None else timeout_s
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    answer = []

    def attempt():
        try:
            socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
            answer.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answer)


def first_per_class(split: Split, per_class: int) -> Split:
    """The first `per_class` images of each class, in their original order."""
    keep = torch.tensor(list(_rank_in_class(split.labels.tolist()))) < per_class
    return Split(split.images[keep], split.labels[keep])


class Images(torch.utils.data.Dataset):
    """A Split as a map-style Dataset of (transform(image), label) pairs, as torchvision's datasets give."""

    def __init__(self, split: Split, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.split, self.transform = split, transform

    def __len__(self) -> int:
        return len(self.split.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.split.images[i]
        return (self.transform(image) if self.transform else image), self.split.labels[i]


# ------------------------------------------------------- a batch: augmented, normalised
def augment(images: torch.Tensor, pad: int = 4, flip: bool | torch.Tensor = True,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop and horizontal flip of a batch of uint8 images (B, C, H, W), on their device.

    Each image gets its own window, shifted by up to `pad` pixels each way; where the window
    hangs over the edge, it sees the image mirrored (reflection padding). Flipped images read
    their columns backwards. Both are one gather, so no padded copy is ever made. The result
    is laid out channels-last (what convolutions on GPUs prefer).
    flip: True mirrors each image with probability 1/2, False none, or a bool tensor (B,)
    says which ones.
    """
    n, _, h, w = images.shape
    device = images.device
    dy = torch.randint(-pad, pad + 1, (n, 1), device=device, generator=generator)
    dx = torch.randint(-pad, pad + 1, (n, 1), device=device, generator=generator)
    rows = _reflect(dy + torch.arange(h, device=device), h)                  # (n, h)
    cols = _reflect(dx + torch.arange(w, device=device), w)                  # (n, w)
    if flip is True:
        flip = torch.rand(n, device=device, generator=generator) < 0.5
    if flip is not False:
        cols = torch.where(flip.view(n, 1), cols.flip(1), cols)
    batch = torch.arange(n, device=device)[:, None, None]
    out = images[batch, :, rows[:, :, None], cols[:, None, :]]              # (n, h, w, C)
    return out.permute(0, 3, 1, 2)


def _reflect(index, size):
    """Map indices in [-size+1, 2*size-2] into [0, size): -1 -> 1, size -> size-2."""
    index = index.abs()
    return torch.where(index >= size, 2 * (size - 1) - index, index)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32, each channel with mean 0 and std 1 over the training set."""
    mean, std = _channel_stats(images.device)
    return (images.float() - mean) / std


@functools.cache
def _channel_stats(device):
    """MEAN and STD (0-255 scale) on `device`, made once: copying them from the host at every
    batch would make the CPU wait for the GPU each time (a copy from ordinary host memory
    waits for the stream), so the GPU would sit idle while Python queues the next step."""
    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255,
            torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255)
