"""ddp_helpers.data (both sources, the error without data, augmentation) and the speed layer's
DeviceLoader (sharding, augmentation on the device)."""
import hashlib
import os
import pickle
import socket
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import MINI, needs_mini, seconds
from PIL import Image

from ddp_helpers import data
from ddp_helpers.data import DataNotFoundError, Split
from ddp_helpers.speed.device_loader import DeviceLoader


def closed_port_url():
    """A URL on 127.0.0.1 where nothing listens: connecting fails at once, nothing leaves the machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/cifar-10-python.tar.gz"


@pytest.fixture
def no_data_anywhere(monkeypatch, tmp_path):
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "url", closed_port_url())
    return tmp_path / "empty-download-root"


# ------------------------------------------------------------------- sources
@needs_mini
def test_folder_copy_gives_cifar_labels_and_original_pixels():
    split = data.load_cifar10(train=True, per_class=3)  # root from the environment variable
    assert split.images.shape == (30, 3, 32, 32) and split.images.dtype == torch.uint8
    assert split.labels.tolist() == [c for c in range(10) for _ in range(3)]
    # the first image of "cat" (label 3) is the first cat file by name, pixel for pixel
    first_cat = sorted(os.listdir(os.path.join(MINI, "train", "cat")))[0]
    pixels = np.array(Image.open(os.path.join(MINI, "train", "cat", first_cat)).convert("RGB"))
    assert torch.equal(split.images[9], torch.from_numpy(pixels).permute(2, 0, 1))


@needs_mini
def test_folder_copy_whole_test_split_and_root_argument(monkeypatch):
    monkeypatch.delenv(data.ENV_VAR)
    test = data.load_cifar10(train=False, root=MINI)
    assert len(test.labels) == 2000 and torch.equal(test.labels.bincount(), torch.full((10,), 200))
    again = data.load_cifar10(train=False, root=MINI)  # now from the tensor cache
    assert torch.equal(again.images, test.images)


@needs_mini
def test_the_tensor_cache_is_readable_by_its_owner_only(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    data.load_cifar10(train=False, root=MINI, per_class=2)
    folder = tmp_path / "ddp_helpers" / "tensors"
    files = list(folder.iterdir())
    assert len(files) == 1 and not files[0].name.startswith("."), files   # no temporary file left
    assert (folder.stat().st_mode & 0o777, files[0].stat().st_mode & 0o777) == (0o700, 0o600)


def write_fake_torchvision_cifar(root, train_n=20, test_n=10):
    """cifar-10-batches-py as torchvision writes it, with tiny random batches. Returns
    (train images NHWC, train labels, test images, test labels)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    made = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = test_n if name == "test_batch" else train_n // 5
        pixels = rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8)  # rows of R, G, B planes
        labels = rng.integers(0, 10, n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": pixels, "labels": labels}, f)
        made[name] = (pixels.reshape(n, 3, 32, 32), labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(data.CLASSES)}, f)
    train = [made[n] for n in names[:5]]
    return (np.concatenate([p for p, _ in train]), sum((l for _, l in train), []), *made["test_batch"])


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_torchvision_copy_is_read_without_network(no_data_anywhere, monkeypatch):
    root = no_data_anywhere
    train_px, train_y, test_px, test_y = write_fake_torchvision_cifar(root)
    folder = root / "cifar-10-batches-py"
    cls = torchvision.datasets.CIFAR10  # point torchvision's integrity check at our fake files
    monkeypatch.setattr(cls, "train_list", [[f"data_batch_{i}", md5(folder / f"data_batch_{i}")] for i in range(1, 6)])
    monkeypatch.setattr(cls, "test_list", [["test_batch", md5(folder / "test_batch")]])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5(folder / "batches.meta")})

    train = data.load_cifar10(train=True, download_root=str(root))
    assert train.images.dtype == torch.uint8 and train.images.shape == (20, 3, 32, 32)
    assert torch.equal(train.images, torch.from_numpy(train_px)) and train.labels.tolist() == train_y
    test = data.load_cifar10(train=False, download_root=str(root), per_class=1)
    firsts = [test_y.index(c) for c in sorted(set(test_y), key=test_y.index)]  # first of each class, in order
    assert test.labels.tolist() == [test_y[i] for i in sorted(firsts)]
    assert torch.equal(test.images, torch.from_numpy(test_px[sorted(firsts)]))


# --------------------------------------------------------- no data: a clear error
def test_no_data_and_no_network_is_a_clear_error_at_once(no_data_anywhere):
    start = time.perf_counter()
    with pytest.raises(DataNotFoundError) as error:
        data.load_cifar10(download_root=str(no_data_anywhere))
    assert time.perf_counter() - start < seconds(5)
    message = str(error.value)
    assert data.ENV_VAR in message and "torchvision.datasets.CIFAR10" in message and "train/ and test/" in message


def test_a_silent_network_does_not_hang(no_data_anywhere, monkeypatch):
    def never_answers(*args, **kwargs):
        time.sleep(seconds(3))  # far past the 0.3 s the loader waits
        raise OSError("no answer")
    monkeypatch.setattr(data.socket, "create_connection", never_answers)
    monkeypatch.setattr(data, "REACH_TIMEOUT_S", 0.3)
    start = time.perf_counter()
    with pytest.raises(DataNotFoundError):
        data.load_cifar10(download_root=str(no_data_anywhere))
    assert time.perf_counter() - start < seconds(2)   # it did not wait for the answer


def test_a_folder_without_splits_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "train").mkdir()
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path))
    with pytest.raises(DataNotFoundError, match="has no test/ folder"):
        data.load_cifar10()


# ----------------------------------------------------------------- sharding
def numbered(n):
    """A split whose labels are the example numbers, so batches say which examples they hold."""
    return Split(torch.zeros(n, 3, 32, 32, dtype=torch.uint8), torch.arange(n))


def seen(loader):
    return torch.cat([labels for _, labels in loader]).tolist()


def test_each_example_once_per_epoch_across_ranks():
    world_size, split = 4, numbered(96)
    loaders = [DeviceLoader(split, 8, train=True, rank=r, world_size=world_size, pad=0) for r in range(world_size)]
    for epoch in (0, 1):
        for loader in loaders:
            loader.set_epoch(epoch)
        shares = [seen(loader) for loader in loaders]
        assert all(len(s) == 24 for s in shares)
        assert sorted(sum(shares, [])) == list(range(96))  # all of them, none twice, no overlap


def test_set_epoch_reshuffles_and_same_epoch_repeats():
    loader = DeviceLoader(numbered(64), 8, train=True, rank=1, world_size=2)
    loader.set_epoch(0)
    first = seen(loader)
    assert seen(loader) == first                  # forgetting set_epoch: the same order every epoch
    loader.set_epoch(1)
    second = seen(loader)
    assert second != first and sorted(second) != sorted(first)  # a new order and a new share
    loader.set_epoch(0)
    assert seen(loader) == first                  # deterministic: resuming at epoch 0 replays it


def test_next_epoch_order_is_drawn_halfway_and_matches_a_fresh_draw():
    loader = DeviceLoader(numbered(64), 8, train=True, rank=1, world_size=2)   # 4 batches per epoch
    draws, draw, taken = [], loader.order_on_device, [0]   # (epoch drawn, batches taken so far)
    loader.order_on_device = lambda: draws.append((loader.sampler.epoch, taken[0])) or draw()
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        served = []
        for _, labels in loader:
            taken[0] += 1
            served += labels.tolist()
        orders.append(served)
    # epoch 0 drawn at its start; each next one after the 3rd of an epoch's 4 batches was taken
    assert draws == [(0, 0), (1, 3), (2, 7), (3, 11)]
    for epoch in range(3):   # the same orders as loaders that never drew ahead
        fresh = DeviceLoader(numbered(64), 8, train=True, rank=1, world_size=2)
        fresh.set_epoch(epoch)
        assert seen(fresh) == orders[epoch]
    loader.set_epoch(0)      # a jump (here back to epoch 0) ignores the order drawn for epoch 3
    assert seen(loader) == orders[0]


def test_test_loader_covers_every_example_once_even_when_uneven():
    split = numbered(50)
    shares = [seen(DeviceLoader(split, 4, train=False, rank=r, world_size=3)) for r in range(3)]
    assert sorted(sum(shares, [])) == list(range(50))
    assert [len(s) for s in shares] == [17, 17, 16]


def test_train_loader_drops_the_incomplete_batch_on_every_rank():
    loaders = [DeviceLoader(numbered(50), 8, train=True, rank=r, world_size=2) for r in range(2)]
    assert [len(loader) for loader in loaders] == [3, 3]  # 25 each: 3 full batches, same step count
    assert [len(seen(loader)) for loader in loaders] == [24, 24]


# ------------------------------------------------------------- augmentation
def asymmetric_images(n, seed=0):
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_augment_keeps_shape_dtype_and_gives_channels_last():
    out = data.augment(asymmetric_images(8), generator=torch.Generator().manual_seed(0))
    assert out.shape == (8, 3, 32, 32) and out.dtype == torch.uint8
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_flips_really_happen():
    images = asymmetric_images(200)
    out = data.augment(images, pad=0, flip=True, generator=torch.Generator().manual_seed(0))
    same = [torch.equal(o, i) for o, i in zip(out, images)]
    mirrored = [torch.equal(o, i.flip(-1)) for o, i in zip(out, images)]
    assert all(s != m for s, m in zip(same, mirrored))  # each image is one or the other
    assert 70 < sum(mirrored) < 130                     # about half are flipped


def test_crops_are_windows_of_the_reflection_padded_image():
    images, pad = asymmetric_images(100), 4
    out = data.augment(images, pad=pad, flip=False, generator=torch.Generator().manual_seed(1))
    padded = F.pad(images.float(), (pad,) * 4, mode="reflect")
    shifts = set()
    for o, p in zip(out.float(), padded):
        matches = [(dy, dx) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)
                   if torch.equal(o, p[:, dy:dy + 32, dx:dx + 32])]
        assert matches, "an output is not a 32x32 window of the padded image"
        shifts.add(matches[0])
    assert len(shifts) > 20  # many different shifts, not one


def test_augment_is_reproducible_with_a_seeded_generator():
    images = asymmetric_images(16)
    a = data.augment(images, generator=torch.Generator().manual_seed(5))
    b = data.augment(images, generator=torch.Generator().manual_seed(5))
    c = data.augment(images, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_loader_batches_are_normalised_floats():
    split = Split(asymmetric_images(64), torch.arange(64) % 10)
    loader = DeviceLoader(split, 32, train=True)
    loader.set_epoch(0)
    images, labels = next(iter(loader))
    assert images.dtype == torch.float32 and images.shape == (32, 3, 32, 32) and labels.shape == (32,)
    expected = (128 - 255 * torch.tensor(data.MEAN)) / (255 * torch.tensor(data.STD))  # a mid-grey pixel
    grey = data.normalize(torch.full((1, 3, 1, 1), 128, dtype=torch.uint8))
    assert torch.allclose(grey.flatten(), expected)


def left_to_right(n):
    """A split of n images that brighten from left to right (so a mirror shows), labelled 0..n-1."""
    ramp = (8 * torch.arange(32)).to(torch.uint8).expand(n, 3, 32, 32)
    return Split(ramp.clone(), torch.arange(n))


def mirrored_this_epoch(loaders, epoch):
    """{example: was it mirrored} over every rank's share of one epoch, and {example: rank}."""
    mirrored, rank_of = {}, {}
    for rank, loader in enumerate(loaders):
        loader.set_epoch(epoch)
        for images, labels in loader:
            flipped = images[:, 0, 0, 0] > images[:, 0, 0, -1]  # darker on the right: read backwards
            for example, f in zip(labels.tolist(), flipped.tolist()):
                assert example not in mirrored, "an example twice in one epoch"
                mirrored[example], rank_of[example] = f, rank
    return mirrored, rank_of


@pytest.mark.parametrize("world_size", [1, 2])
def test_alternating_flips_show_every_image_both_ways_over_two_epochs(world_size):
    loaders = [DeviceLoader(left_to_right(64), 8, train=True, rank=r, world_size=world_size, pad=0,
                            flip="alternate") for r in range(world_size)]
    (even, ranks0), (odd, ranks1), (again, _) = [mirrored_this_epoch(loaders, epoch) for epoch in (0, 1, 2)]
    assert sorted(even) == sorted(odd) == list(range(64))
    assert all(even[i] != odd[i] for i in range(64))   # each image once mirrored, once not
    assert again == even                                # epoch 2 repeats epoch 0's choice
    assert 16 < sum(even.values()) < 48                 # a random half, not all or none
    if world_size == 2:  # images that moved to the other rank kept the alternation: one draw for all ranks
        assert sum(ranks0[i] != ranks1[i] for i in range(64)) > 10


def test_no_flips_and_a_bad_flip_value():
    loader = DeviceLoader(left_to_right(32), 8, train=True, pad=0, flip="none")
    for epoch in (0, 1):
        mirrored, _ = mirrored_this_epoch([loader], epoch)
        assert len(mirrored) == 32 and not any(mirrored.values())
    with pytest.raises(ValueError, match=r"flip must be one of .*'random', 'alternate', 'none'.*'sometimes'"):
        DeviceLoader(left_to_right(32), 8, train=True, flip="sometimes")
    # The older spelling still works: True is "random", False is "none"
    assert DeviceLoader(left_to_right(32), 8, train=True, flip=True).flip == "random"
    assert DeviceLoader(left_to_right(32), 8, train=True, flip=False).flip == "none"


def test_augment_mirrors_exactly_the_images_a_mask_names():
    images = asymmetric_images(12)
    mask = torch.tensor([i % 3 == 0 for i in range(12)])
    out = data.augment(images, pad=0, flip=mask, generator=torch.Generator().manual_seed(0))
    for o, i, m in zip(out, images, mask.tolist()):
        assert torch.equal(o, i.flip(-1) if m else i)
