"""ddp_helpers.train, the reference trainer (and ddp_helpers.live): every option of train.Config,
DDP gradients through the trainer's own step, checkpoints and identical resume, a short run with
the live view, the CLI. The speed layer (ddp_helpers.speed) is tested in test_speed.py.

The options and where each is tested (each by a test that fails if the option is ignored):
  model, width ................ test_model_and_width_choose_the_network
  data ........................ test_data_folder_is_what_trains
  per_class, test_per_class,
  epochs, batch_size .......... test_per_class_test_per_class_epochs_and_batch_size_set_the_counts
  lr .......................... test_lr_is_the_peak_of_the_one_cycle_schedule
  seed ........................ test_same_seed_same_run_other_seed_other_run
  device ...................... test_device_cpu_and_cuda_without_a_gpu
  max_steps ................... test_max_steps_stops_there_and_the_schedule_fits_them
  eval_every .................. test_eval_every_chooses_the_evaluated_epochs
  log_every, verbose, live .... test_log_every_verbose_and_live_output (and the live view's test)
  checkpoint, resume .......... test_checkpoint_and_identical_resume_on_two_ranks (resume="auto" too),
                                test_resume_is_identical_with_the_gpu_data_loader_too; a damaged file:
                                test_resume_auto_falls_back_from_a_damaged_newest_checkpoint and the two after it
  fail_at_step, fail_rank ..... test_torchrun.py: test_killed_worker_restart_resumes_from_checkpoint_and_finishes
                                (rank 1 alone dies, at step 8, in the first attempt only; then
                                --resume auto) and test_fault_and_resume_options_are_checked
Most runs here are in this process: train.run makes a world of one (train.setup) and takes it down.
"""
import copy
import gc
import io
import json
import os
import re
import stat
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import cannot_run, launch_two_ranks_once, needs_mini, seconds
from like_torchrun import run_module_like_torchrun
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import WorkerError, data, launch, live, machine, models, progress, torchrun, train

# A few seconds of CPU work on the mini set, on 2 ranks: 500 training images, a 0.01M-parameter net.
TINY = dict(width=8, per_class=50, test_per_class=10, batch_size=25, lr=0.4, log_every=5, verbose=False)
# Less than a second in this process, on the CPU: 50 training images, 5 steps of 10 per epoch, 20 test images.
SMALL = dict(width=8, per_class=5, test_per_class=2, batch_size=10, log_every=1, verbose=False, device="cpu")


pytestmark = pytest.mark.usefixtures("own_launch_folders", "one_thread")  # tests/conftest.py


class Spy(train.Plain):
    """The plain recipe, keeping what it built and the sizes of the batches it saw."""

    def __init__(self):
        self.train_batches, self.test_batches = [], []

    def build_model(self, cfg, device):
        self.model = super().build_model(cfg, device)
        self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}
        return self.model

    def loaders(self, cfg, device):
        self.train_loader, self.test_loader = super().loaders(cfg, device)
        return self.train_loader, self.test_loader

    def forward_backward(self, model, images, labels):
        self.train_batches.append(len(images))
        return super().forward_backward(model, images, labels)

    def predict(self, model, images):
        self.test_batches.append(len(images))
        return super().predict(model, images)


def losses(record):
    return [s["loss"] for s in record["steps"]]


# ----------------------------------------------------------------- models
def test_resnet18_has_the_cifar_stem():
    model = models.build_model("resnet18")
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert 11.1e6 < models.count_parameters(model) < 11.2e6


def test_fastnet_sizes():
    assert 1.9e6 < models.count_parameters(models.FastNet(64)) < 2.1e6
    small = models.build_model("fastnet", width=16)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        models.build_model("vgg")


# ------------------------------------------------------- the options, one by one
@needs_mini
def test_the_plain_trainer_leaves_cudnn_at_its_default(monkeypatch):
    # before: train.run turned cuDNN's search on; on an H100 it took 2.4 s of the first step of 06's GPU
    # cell (the first epoch 12,949 images/s with it, 35,236 without). The speed layer turns it on.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    train.run(Spy(), **SMALL, max_steps=1)
    assert torch.backends.cudnn.benchmark is False


@needs_mini
def test_model_and_width_choose_the_network():
    spy = Spy()
    train.run(spy, **dict(SMALL, width=16), epochs=1)
    assert isinstance(spy.model, models.FastNet)
    assert models.count_parameters(spy.model) == models.count_parameters(models.FastNet(16))  # not 8, not 64
    spy = Spy()
    record = train.run(spy, **dict(SMALL, per_class=1), model="resnet18", max_steps=1)  # one step of 10 images
    assert 11.1e6 < models.count_parameters(spy.model) < 11.2e6 and record["config"]["model"] == "resnet18"
    assert len(record["steps"]) == 1 and 0 <= record["test_accuracy"] <= 1


def write_image_folder(root, per_class):
    """A class-folder copy of CIFAR-10's layout: `per_class` random 32x32 PNGs per class in train/
    and one in test/. Returns the first training image as a (3, 32, 32) uint8 tensor."""
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    first = None
    for split, count in (("train", per_class), ("test", 1)):
        for name in data.CLASSES:
            os.makedirs(root / split / name)
            for i in range(count):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / name / f"{i}.png")
                first = pixels.permute(2, 0, 1) if first is None else first
    return first


def test_data_folder_is_what_trains(tmp_path, monkeypatch):
    folder = tmp_path / "images"
    first = write_image_folder(folder, per_class=3)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))   # the decoded-tensor cache goes here
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path / "elsewhere"))  # overridden by data=
    spy = Spy()
    record = train.run(spy, **dict(SMALL, per_class=None, test_per_class=None), data=str(folder), epochs=1)
    assert len(spy.train_loader.dataset) == 30 and len(spy.test_loader.dataset) == 10
    assert torch.equal(spy.train_loader.dataset.split.images[0], first)
    assert record["total_steps"] == 3 and spy.test_batches == [10]
    with pytest.raises(ValueError, match=re.escape("data folder '/nonexistent/cifar' does not exist")):
        train.run(data="/nonexistent/cifar")


@needs_mini
def test_per_class_test_per_class_epochs_and_batch_size_set_the_counts():
    spy = Spy()
    record = train.run(spy, **dict(SMALL, per_class=6, test_per_class=3, batch_size=12), epochs=2)
    assert len(spy.train_loader.dataset) == 60 and len(spy.test_loader.dataset) == 30
    assert record["total_steps"] == 10 and spy.train_batches == [12] * 10     # 60 // 12 = 5 steps an epoch
    assert [e["epoch"] for e in record["epochs"]] == [0, 1]
    assert spy.test_batches == [30, 30]                                        # after epoch 1, and at the end
    labels = spy.train_loader.dataset.split.labels
    assert torch.equal(labels.bincount(), torch.full((10,), 6))               # 6 of each class
    with pytest.raises(WorkerError, match="batch_size=30 on each of 2 ranks is more than the training set"):
        launch(train.run, 2, "gloo", kwargs=dict(SMALL, batch_size=30, epochs=1), quiet=True)   # 60 > 50


def lrs(record):
    return [s["lr"] for s in record["steps"]]


@needs_mini
def test_lr_is_the_peak_of_the_one_cycle_schedule():
    record = train.run(**SMALL, lr=0.2, epochs=4)    # 20 steps: up for 5, then down
    steps = lrs(record)
    assert len(steps) == 20 and max(steps) == pytest.approx(0.2) and steps.index(max(steps)) == 4
    assert steps[0] == pytest.approx(0.2 / 25) and steps[-1] == pytest.approx(0.2 / 25 / 1e4)  # OneCycleLR's ends
    assert all(a < b for a, b in zip(steps[:4], steps[1:5])) and all(a > b for a, b in zip(steps[4:], steps[5:]))


@needs_mini
def test_the_momentum_is_what_the_code_says():
    # OneCycleLR cycles the momentum too (0.85 to 0.95) unless told not to: the reference trainer
    # says momentum=0.9, so the schedule must leave it there.
    class Keep(Spy):
        def optimizer(self, model, cfg, total_steps):
            self.optimizer_, schedule = super().optimizer(model, cfg, total_steps)
            return self.optimizer_, schedule
    recipe = Keep()
    train.run(recipe, **SMALL, epochs=2)
    assert [g["momentum"] for g in recipe.optimizer_.param_groups] == [0.9]


@needs_mini
def test_max_steps_stops_there_and_the_schedule_fits_them():
    record = train.run(**SMALL, lr=0.2, epochs=3, max_steps=7)   # 15 steps without max_steps
    assert record["total_steps"] == 7 and [s["step"] for s in record["steps"]] == list(range(1, 8))
    assert [e["epoch"] for e in record["epochs"]] == [0, 1] and "test_accuracy" in record["epochs"][-1]
    assert lrs(record)[-1] == pytest.approx(0.2 / 25 / 1e4)       # the schedule ends at step 7
    assert max(lrs(record)) < 0.2 * 1.001


@needs_mini
def test_eval_every_chooses_the_evaluated_epochs():
    def evaluated(**settings):
        spy = Spy()
        record = train.run(spy, **SMALL, epochs=3, **settings)
        assert len(spy.test_batches) == len([e for e in record["epochs"] if "test_accuracy" in e])
        return [e["epoch"] for e in record["epochs"] if "test_accuracy" in e]

    assert evaluated() == [0, 1, 2]
    assert evaluated(eval_every=2) == [1, 2]          # the last epoch is always evaluated
    assert evaluated(eval_every=0) == [2]


@needs_mini
def test_same_seed_same_run_other_seed_other_run():
    runs = []
    for seed in (1, 1, 2):
        spy = Spy()
        runs.append((train.run(spy, **SMALL, epochs=2, seed=seed), spy.initial))
    (a, a_start), (b, b_start), (c, c_start) = runs
    assert losses(a) == losses(b) and a["test_loss"] == b["test_loss"]
    assert all(torch.equal(a_start[k], b_start[k]) for k in a_start)
    assert losses(a) != losses(c) and not torch.equal(a_start["0.weight"], c_start["0.weight"])
    assert losses(train.run(**SMALL, epochs=2)) != losses(a)     # the default seed, 0, is another one


@needs_mini
def test_device_cpu_and_cuda_without_a_gpu():
    record = train.run(**dict(SMALL, device="cpu"), epochs=1)   # on a GPU machine "auto" would pick the GPU
    assert (record["device"], record["backend"]) == ("cpu", "gloo")
    if machine.gpu_count():
        record = train.run(**dict(SMALL, device="cuda"), epochs=1)
        assert (record["device"], record["backend"]) == ("cuda:0", "nccl")
    else:
        with pytest.raises(ValueError, match="device='cuda' but torch sees no GPU here"):
            train.run(**dict(SMALL, device="cuda"))
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda, got 'tpu'"):
        train.run(device="tpu")


def printed_steps(lines):
    return [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/10 ", line))]


@needs_mini
def test_log_every_verbose_and_live_output(capsys):
    record = train.run(**dict(SMALL, log_every=3, verbose=True), epochs=2, live=True)
    out = capsys.readouterr().out.splitlines()
    prefix = progress.METRICS_PREFIX
    messages = [json.loads(line[len(prefix):]) for line in out if line.startswith(prefix)]
    text = [line for line in out if not line.startswith(prefix)]
    # verbose: what rank 0 tells a person; log_every=3: a window ends every 3 steps and with each epoch
    assert text[0] == "fastnet on 1 rank(s), cpu, gloo: 5 steps/epoch of 10 images per rank"
    assert printed_steps(text) == [3, 5, 6, 9, 10]
    assert [line.split("  ")[0] for line in text if line.startswith("epoch")] == ["epoch 1/2", "epoch 2/2"]
    assert text[-1].startswith("done: test accuracy ") and len(text) == 1 + 5 + 2 + 1
    # live: one JSON message per window, epoch and the start and end, for ddp_helpers.live
    assert [m["kind"] for m in messages] == ["start", "steps", "steps", "epoch", "steps", "steps", "steps",
                                             "epoch", "end"]
    windows = [[s["step"] for s in m["steps"]] for m in messages if m["kind"] == "steps"]
    assert windows == [[1, 2, 3], [4, 5], [6], [7, 8, 9], [10]]
    assert [s for m in messages if m["kind"] == "steps" for s in m["steps"]] == record["steps"]  # every step
    assert messages[-1] == {"kind": "end", "test_accuracy": record["test_accuracy"], "test_loss": record["test_loss"]}

    train.run(**SMALL, epochs=1)                       # verbose=False, live=False: silent
    assert capsys.readouterr().out == ""


class GpuLoaders(Spy):
    """The trainer's data loaders for a GPU (worker processes), in a run on the CPU."""

    def loaders(self, cfg, device):
        self.train_loader, self.test_loader = train.Plain.loaders(self, cfg, torch.device("cuda", 0))
        return self.train_loader, self.test_loader


@needs_mini
@pytest.mark.filterwarnings("ignore:.*pin_memory", "ignore:This DataLoader will create")
def test_resume_is_identical_with_the_gpu_data_loader_too(tmp_path):
    # The GPU loader's workers stay up from epoch to epoch (persistent_workers), keeping their random
    # state: had they cropped and flipped, a resumed run would augment other than the uninterrupted one
    # (it did, when they did). They only gather uint8 images; prepare() draws on the device.
    settings = dict(SMALL, epochs=2, checkpoint=str(tmp_path / "{epoch}.pt"))
    recipe = GpuLoaders()
    full = train.run(recipe, **settings)
    loader = recipe.train_loader
    assert loader.persistent_workers and loader.pin_memory and 1 <= loader.num_workers <= 4
    resumed = train.run(GpuLoaders(), **settings, resume=str(tmp_path / "0.pt"))
    assert [s["step"] for s in resumed["steps"]] == list(range(6, 11))
    assert [s["loss"][0] for s in resumed["steps"]] == pytest.approx([s["loss"][0] for s in full["steps"][5:]],
                                                                     abs=1e-6)


@needs_mini
def test_batches_travel_as_uint8_and_are_augmented_and_normalised_on_the_device():
    cfg = train.make_config(**SMALL)
    recipe = train.Plain()
    train.setup(cfg)   # a world of one: the loaders take this rank's share
    try:
        train_loader, test_loader = recipe.loaders(cfg, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    images, labels = next(iter(train_loader))
    assert images.dtype == torch.uint8 and images.shape == (10, 3, 32, 32) and labels.dtype == torch.int64
    # the test set: normalised, never augmented
    test_images, test_labels = next(iter(test_loader))
    ready, same_labels = recipe.prepare(test_images, test_labels, torch.device("cpu"))
    assert torch.equal(ready, data.normalize(test_images)) and torch.equal(same_labels, test_labels)
    # training: what data.augment draws from the generator, then normalised; the same generator seed
    # gives the same batch (what identical resume needs), another seed another one
    def prepared(seed):
        return recipe.prepare(images, labels, torch.device("cpu"), torch.Generator().manual_seed(seed))[0]
    expected = data.normalize(data.augment(images, pad=4, generator=torch.Generator().manual_seed(1)))
    assert prepared(1).dtype == torch.float32 and prepared(1).is_contiguous()
    assert torch.equal(prepared(1), expected) and torch.equal(prepared(1), prepared(1))
    assert not torch.equal(prepared(1), prepared(2)) and not torch.equal(prepared(1), data.normalize(images))
    # a batch its loader already prepared (the speed layer's DeviceLoader) is left as it is
    floats = torch.randn(4, 3, 32, 32)
    assert recipe.prepare(floats, labels[:4], torch.device("cpu"), torch.Generator())[0] is floats


def noting_augmentation_seeds(seeds):
    """Wrap train.Plain.prepare so that each training batch notes its generator's seed in `seeds`;
    returns the function that undoes it."""
    real = train.Plain.prepare

    def noting(self, images, labels, device, randomness=None):
        if randomness is not None:
            seeds.append(randomness.initial_seed())
        return real(self, images, labels, device, randomness)

    train.Plain.prepare = noting
    return lambda: setattr(train.Plain, "prepare", real)


@needs_mini
def test_every_epoch_crops_and_flips_its_own_way():
    seeds = []
    undo = noting_augmentation_seeds(seeds)
    try:
        train.run(**SMALL, epochs=2, seed=3)
    finally:
        undo()
    assert seeds == [3000] * 5 + [3010] * 5   # one generator per epoch (5 steps each), from seed and epoch


# --------------------------------------------------- two ranks: DDP, checkpoints
def average_gradients_by_hand(module):
    for p in module.parameters():
        dist.all_reduce(p.grad)          # SUM over ranks ...
        p.grad /= dist.get_world_size()  # ... divided by the number of ranks: the mean


def ddp_step_vs_hand_averaged():
    """In each rank: two steps of the trainer's own DDP step (Plain.forward_backward) against a plain
    copy of the model whose gradients are all-reduced by hand."""
    t = train.build(train.make_config(**TINY), train.Plain(), torch.device("cpu"))
    plain = copy.deepcopy(t.module)
    g = torch.Generator().manual_seed(100 + t.rank)  # every rank its own batch
    diffs, changed = [], []
    for _ in range(2):  # DDP rebuilds its buckets after the first step: check the step after that too
        images, labels = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        t.recipe.forward_backward(t.model, images, labels)   # it zeroes the last step's gradients itself
        plain.zero_grad(set_to_none=True)
        F.cross_entropy(plain(images), labels, label_smoothing=0.1).backward()
        local = [p.grad.clone() for p in plain.parameters()]
        average_gradients_by_hand(plain)
        pairs = list(zip(plain.parameters(), t.module.parameters()))
        diffs += [(a.grad - b.grad).abs().max().item() for a, b in pairs]
        changed += [(a.grad - l).abs().max().item() for (a, _), l in zip(pairs, local)]
    return {"ddp": isinstance(t.model, DDP), "max_diff": max(diffs), "changed_by_averaging": max(changed),
            "checksum": sum(p.grad.double().sum().item() for p in t.module.parameters())}


def trainer_freed_without_the_garbage_collector():
    """A finished run's trainer (model, data, optimizer) must not wait for the garbage collector."""
    built = []
    real_build = train.build

    def build(cfg, recipe, device):
        t = real_build(cfg, recipe, device)
        built.append(weakref.ref(t))
        return t

    train.build = build
    gc.collect()
    gc.disable()
    try:
        train.run(**TINY, epochs=1)
        return built[0]() is None
    finally:
        gc.enable()
        train.build = real_build


def train_then_resume(folder):
    """Three epochs in one go, then again from the checkpoint written after the first, then
    resume='auto' (the newest of the first run's checkpoints: after the last epoch)."""
    full = train.run(**TINY, epochs=3, checkpoint=f"{folder}/full-{{epoch}}.pt")
    resumed = train.run(**TINY, epochs=3, resume=f"{folder}/full-0.pt", checkpoint=f"{folder}/resumed-{{epoch}}.pt")
    auto = train.run(**TINY, epochs=3, resume="auto", checkpoint=f"{folder}/full-{{epoch}}.pt")
    return full, resumed, auto


def on_two_ranks(folder):
    """What the two-rank tests below look at, from one launch (each launch costs seconds)."""
    out = {"gradients": ddp_step_vs_hand_averaged(), "augmentation_seeds": []}
    undo = noting_augmentation_seeds(out["augmentation_seeds"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            train.run(**TINY, epochs=1)   # default settings; also lets lazy imports and caches settle
        finally:
            undo()
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                       if issubclass(w.category, (DeprecationWarning, FutureWarning)) or "deprecat" in str(w.message)]
    out["freed"] = trainer_freed_without_the_garbage_collector()
    out["full"], out["resumed"], out["auto"] = train_then_resume(folder)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_two_ranks_once(on_two_ranks, tmp_path_factory)


def test_ddp_gradients_equal_hand_averaged_gradients(two_ranks):
    results = [r["gradients"] for r in two_ranks[1]]
    for r in results:
        assert r["ddp"] and r["max_diff"] < 1e-6, r
        assert r["changed_by_averaging"] > 1e-4, r  # the ranks' batches differ: averaging mattered
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-6)  # same on every rank


def test_every_rank_crops_and_flips_its_own_way(two_ranks):
    seeds = [r["augmentation_seeds"] for r in two_ranks[1]]
    assert seeds == [[0] * 10, [1] * 10]   # seed 0, epoch 0, rank 0 and 1: 10 steps of 25 images each


def test_default_settings_raise_no_deprecation_warning(two_ranks):
    # Notebooks run in strict nbval: a new torch warning on stderr would break them.
    assert [r["warnings"] for r in two_ranks[1]] == [[], []]


def test_a_finished_run_frees_its_trainer_at_once(two_ranks):
    # A trainer in a reference cycle (its log kept it) waited for the garbage collector, with its
    # data and model; on a GPU its DataLoader's workers then took 5 s each to be stopped.
    assert [r["freed"] for r in two_ranks[1]] == [True, True]


def test_checkpoint_and_identical_resume_on_two_ranks(two_ranks):
    folder, results = two_ranks
    full, resumed, auto = results[0]["full"], results[0]["resumed"], results[0]["auto"]
    assert [r["full"]["test_loss"] for r in results] == [full["test_loss"]] * 2      # every rank: one record
    assert full["total_steps"] == 30 and sorted(os.listdir(folder)) == [
        "full-0.pt", "full-1.pt", "full-2.pt", "resumed-1.pt", "resumed-2.pt"]       # one file per epoch
    assert resumed["resumed_from"].endswith("full-0.pt")
    assert [s["step"] for s in resumed["steps"]] == list(range(11, 31))             # it went on after epoch 0
    for a, b in zip(losses(resumed), losses(full)[10:]):
        assert a == pytest.approx(b, abs=1e-6)                                        # both ranks' losses
    assert resumed["test_accuracy"] == full["test_accuracy"]
    assert resumed["test_loss"] == pytest.approx(full["test_loss"], abs=1e-6)
    assert auto["resumed_from"].endswith("full-2.pt") and auto["steps"] == []        # nothing left to train

    a = torch.load(folder / "full-2.pt", map_location="cpu", weights_only=True)
    b = torch.load(folder / "resumed-2.pt", map_location="cpu", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.allclose(a["model"][k].float(), b["model"][k].float(), atol=1e-6) for k in a["model"])
    momentum = lambda s: [v["momentum_buffer"] for v in s["optimizer"]["state"].values()]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(momentum(a), momentum(b)))
    assert (a["epoch"], a["step"], a["schedule"]["last_epoch"]) == (b["epoch"], b["step"], 30) == (2, 30, 30)

    model = models.build_model("fastnet", width=TINY["width"])  # a plain model takes the weights too
    model.load_state_dict(a["model"])
    assert torch.equal(model.state_dict()["0.weight"], a["model"]["0.weight"])


def test_a_resumed_record_says_where_it_started(two_ranks):
    full, resumed = two_ranks[1][0]["full"], two_ranks[1][0]["resumed"]
    assert (full["start_step"], resumed["start_step"]) == (0, 10)


def test_the_saved_model_is_the_evaluated_one(two_ranks):
    # DDP sends rank 0's BatchNorm statistics before each forward, then each rank updates its own:
    # evaluating each rank's own would score a mix of models, not the one rank 0 saves.
    full, auto = two_ranks[1][0]["full"], two_ranks[1][0]["auto"]   # auto: the last checkpoint, evaluated
    assert auto["test_loss"] == pytest.approx(full["test_loss"], abs=1e-6)
    assert auto["test_accuracy"] == full["test_accuracy"]


# ------------------------------------------------------- a short run, live view
@needs_mini
def test_short_cpu_training_lowers_the_loss_and_shows_progress(capsys):
    settings = dict(TINY, per_class=100, epochs=3)  # 1,000 images: 20 steps per epoch on each rank
    record = live.train(world_size=2, backend="gloo", view="text", timeout=120, **settings)
    printed = capsys.readouterr().out
    steps = record["steps"]
    assert len(steps) == record["total_steps"] == 60 and all(len(s["loss"]) == 2 for s in steps)
    first = sum(sum(s["loss"]) for s in steps[:5]) / 10  # mean over 5 steps and both ranks
    last = sum(sum(s["loss"]) for s in steps[-5:]) / 10
    assert last < first - 0.25, (first, last)
    assert record["test_accuracy"] > 0.25 and all(s["images_per_s"] > 0 for s in steps)  # chance: 0.1
    assert [e["epoch"] for e in record["epochs"]] == [0, 1, 2] and "test_accuracy" in record["epochs"][0]
    assert "step 60/60 (100%)" in printed and "epoch 3: test accuracy" in printed
    assert progress.METRICS_PREFIX not in printed  # metric lines are taken out of the output
    assert "done: test accuracy" not in printed  # live.train turns the ranks' own lines off (verbose=False)
    figure = live.plot(record)
    assert len(figure.axes) == 3 and live.png(figure)[:4] == b"\x89PNG"


def test_metrics_filter_takes_out_marked_lines_only():
    out, messages = io.StringIO(), []
    tap = live.MetricsFilter(out, messages.append)
    tap.write("[rank 0] hello\n[rank 0] " + progress.METRICS_PREFIX + '{"kind": "end", ')
    tap.write('"test_accuracy": 0.5, "test_loss": 1.0}\n[rank 1] bye')
    tap.flush()
    assert out.getvalue() == "[rank 0] hello\n[rank 1] bye"
    assert messages == [{"kind": "end", "test_accuracy": 0.5, "test_loss": 1.0}]


# ---------------------------------------------------------- settings, CLI
BAD_SETTINGS = [  # (settings, error, a regular expression for its message)
    (dict(lrr=0.1), TypeError, r"unknown setting\(s\) \['lrr'\]"),
    (dict(whiten=True), TypeError, r"unknown setting\(s\) \['whiten'\]"),   # a speed option: speed.run's
    (dict(model="vgg"), ValueError, r"model must be one of \['fastnet', 'resnet18'\], got 'vgg'"),
    *[({name: 0}, ValueError, name + r"\b.* must be at least 1")
      for name in ("width", "epochs", "batch_size", "per_class", "test_per_class", "max_steps", "log_every",
                   "fail_at_step")],
    (dict(lr=0), ValueError, r"lr must be a positive, finite number, got 0"),
    (dict(lr=float("inf")), ValueError, r"lr must be a positive, finite number, got inf"),  # trained to nan
    (dict(lr=float("nan")), ValueError, r"lr must be a positive, finite number, got nan"),
    (dict(checkpoint="ck/{step}.pt"), ValueError,        # these failed after the first epoch
     r"checkpoint='ck/\{step\}.pt': the name may hold \{epoch\} \(the epoch's number\), nothing else"),
    (dict(checkpoint="ck/{}.pt"), ValueError, r"checkpoint='ck/\{\}.pt': the name may hold \{epoch\}"),
    (dict(checkpoint="ck/{epoch.pt"), ValueError, r"checkpoint='ck/\{epoch.pt': the name may hold \{epoch\}"),
    (dict(checkpoint=os.path.dirname(__file__)), ValueError,              # a folder where a file should be
     re.escape(f"checkpoint={os.path.dirname(__file__)!r} is a folder: name a file in it, e.g. ")),
    (dict(checkpoint=__file__ + "/ck.pt"), ValueError,                  # a file where a folder should be
     re.escape(f"checkpoint='{__file__}/ck.pt': cannot write in {__file__} (not a folder)")),
    *([(dict(checkpoint="/proc/no/such/ck.pt"), ValueError,   # root's os.access says yes to /proc: it was
        r"checkpoint='/proc/no/such/ck.pt': cannot write in /proc")] if os.path.isdir("/proc") else []),  # taken
    (dict(eval_every=-1), ValueError, r"eval_every .*>= 0"),
    (dict(fail_rank=-1), ValueError, r"fail_rank must be >= 0, got .* and -1"),
    (dict(device="tpu"), ValueError, r"device must be auto, cpu or cuda, got 'tpu'"),
    (dict(resume="/nonexistent/ckpt.pt"), ValueError, r"no checkpoint at resume='/nonexistent/ckpt.pt'"),
    (dict(resume="auto"), ValueError, r"resume='auto' looks for the files checkpoint names"),
    (dict(data="/nonexistent/cifar"), ValueError, r"data folder '/nonexistent/cifar' does not exist"),
    (dict(per_class=5, batch_size=64), ValueError,   # a schedule of no steps; it failed in the ranks
     r"batch_size=64 is more than the training set \(per_class=5: 50 images\): no step"),
]


@pytest.mark.parametrize("settings, error, message", BAD_SETTINGS,
                         ids=[",".join(f"{k}={v}" for k, v in s.items()) for s, _, _ in BAD_SETTINGS])
def test_bad_settings_are_clear_errors_before_any_process_starts(monkeypatch, settings, error, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(live, "launch", no_launch)
    with pytest.raises(error, match=message):
        train.make_config(**settings)
    with pytest.raises(error, match=message):
        live.train(world_size=2, view="text", **settings)
    with pytest.raises(error, match=message):
        train.run(**settings)
    assert not dist.is_initialized()  # train.run checks before it makes a process group


@pytest.mark.parametrize("kind", ["character device", "fifo"])
def test_a_checkpoint_path_that_is_a_device_or_a_pipe_is_refused_up_front(tmp_path, kind):
    # As root, --checkpoint /dev/null passed the check and the atomic save replaced the machine's /dev/null
    # with a regular file. A device made here (root: mknod, like /dev/null's 1:3) or a pipe (anyone).
    path = tmp_path / "null"
    if kind == "fifo":
        os.mkfifo(path)
    elif os.geteuid() == 0:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        cannot_run("making a character device needs root (a security check: root's save must not replace "
                   "/dev/null)")
    with pytest.raises(ValueError, match=r"it exists and is not a regular file \(a device, a pipe or a socket\)"):
        train.make_config(checkpoint=str(path))
    assert not path.is_file() and path.exists()


def test_cli_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        train.parse_args(["--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert "torchrun" in help_text
    for name in train.Config.__dataclass_fields__:       # one flag per option ...
        assert "--" + name.replace("_", "-") in help_text, name
    assert "--verbose | --no-verbose" in help_text
    assert "--tta" not in help_text and "--cuda-graph" not in help_text  # ... and no speed options
    for argv, message in [(["--batch-size", "0"], "must be at least 1"),
                          (["--model", "vgg"], "model must be one of"),
                          (["--epochs", "two"], "invalid int value: 'two'"),
                          (["--device", "tpu"], "device must be auto, cpu or cuda"),
                          (["--whiten"], "unrecognized arguments: --whiten")]:
        with pytest.raises(SystemExit) as done:
            train.parse_args(argv)
        assert done.value.code == 2 and message in capsys.readouterr().err
    cfg = train.parse_args(["--per-class", "20", "--batch-size", "20", "--no-verbose", "--live", "--lr", "0.1"])
    assert (cfg.per_class, cfg.verbose, cfg.live, cfg.lr, cfg.epochs) == (20, False, True, 0.1, 10)


CLI_ARGS = ["--width", "8", "--per-class", "20", "--test-per-class", "5", "--epochs", "1", "--batch-size", "20",
            "--log-every", "1"]


@needs_mini
def test_cli_under_torchrun_environment():
    (rc0, out0, err0), (rc1, out1, err1) = run_module_like_torchrun("ddp_helpers.train", CLI_ARGS)
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert "fastnet on 2 rank(s), cpu, gloo: 5 steps/epoch" in out0 and "step 5/5" in out0
    assert "done: test accuracy" in out0 and out1 == ""  # only rank 0 prints


@needs_mini
@pytest.mark.skipif(not torchrun.private_network_available(),
                    reason="real torchrun's store listens on every interface: run only in a private network namespace")
def test_cli_under_real_torchrun():
    done = torchrun.run_nodes(["-m", "ddp_helpers.train", *CLI_ARGS], nnodes=1, nproc_per_node=2,
                              standalone=True, timeout=180)
    assert done.ok, done.logs[0]
    assert "fastnet on 2 rank(s), cpu, gloo: 5 steps/epoch" in done.logs[0]
    assert "done: test accuracy" in done.logs[0]


def test_a_fault_for_a_rank_that_does_not_exist_is_a_clear_error():
    # fail_rank=2 in a world of 2: the injected fault would silently never fire
    with pytest.raises(WorkerError, match=r"fail_rank=2, but there are 2 rank\(s\)"):
        launch(train.run, 2, "gloo", kwargs=dict(TINY, fail_at_step=3, fail_rank=2), quiet=True)


# ------------------------------------------- faults: settings that cannot work, saves, resumes
@needs_mini
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 8])
def test_short_runs_train_with_the_whole_schedule(steps):
    # OneCycleLR divided by zero when its rise ended at step 0 (0.25 x 4 - 1 = 0): 4 steps failed
    record = train.run(**SMALL, lr=0.2, epochs=2, max_steps=steps)
    rates = lrs(record)
    assert record["total_steps"] == len(rates) == steps and all(0 < r <= 0.2 * 1.001 for r in rates)
    if steps > 1:
        assert rates[-1] == pytest.approx(0.2 / 25 / 1e4)   # it still ends at OneCycleLR's end


def fake_trainer(floats=1000, step=5):
    """What save_checkpoint reads from a trainer, with a model of `floats` weights, on the CPU."""
    from types import SimpleNamespace
    module = torch.nn.Linear(floats, 1, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return SimpleNamespace(device=torch.device("cpu"), rank=0, module=module, optimizer=optimizer,
                           schedule=schedule, step=step, total_steps=10, start_epoch=0, train_loader=[None] * 5)


def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def save_many_times(path, times):
    """In a child process: save one checkpoint path `times` times; exit code 1 if any save failed."""
    world_of_one()
    t = fake_trainer(20000)
    failed = 0
    for epoch in range(times):
        try:
            train.save_checkpoint(t, path, epoch)
        except Exception as err:
            failed += 1
            print(f"{type(err).__name__}: {err}", flush=True)
    os._exit(1 if failed else 0)


def test_two_processes_saving_one_checkpoint_path_never_fail(tmp_path):
    # Both used the same temporary name (ck.pt.tmp): 31 of 80 saves raised FileNotFoundError
    import multiprocessing
    context = multiprocessing.get_context("fork")
    path = str(tmp_path / "ck.pt")
    writers = [context.Process(target=save_many_times, args=(path, 40)) for _ in range(2)]
    for w in writers:
        w.start()
    seen = 0
    while any(w.is_alive() for w in writers):   # a reader meanwhile: never half a file
        if os.path.exists(path):
            assert torch.load(path, weights_only=True)["step"] == 5
            seen += 1
    for w in writers:
        w.join()
    assert [w.exitcode for w in writers] == [0, 0]
    assert os.listdir(tmp_path) == ["ck.pt"] and seen > 0   # no temporary file left


def test_checkpoints_are_private_unless_saved_in_a_shared_folder(tmp_path):
    # They were written 0644 in 0755 folders: any local user could read a learner's weights
    world_of_one()
    try:
        t = fake_trainer()
        train.save_checkpoint(t, str(tmp_path / "new" / "ck.pt"), 0)
        assert oct((tmp_path / "new" / "ck.pt").stat().st_mode & 0o777) == oct(0o600)
        assert oct((tmp_path / "new").stat().st_mode & 0o777) == oct(0o700)   # a folder it made
        shared = tmp_path / "class"
        shared.mkdir()
        shared.chmod(0o2775)   # a group's folder (setgid: files take its group): the learner's choice
        train.save_checkpoint(t, str(shared / "ck.pt"), 0)
        umask = os.umask(0)
        os.umask(umask)
        assert oct((shared / "ck.pt").stat().st_mode & 0o777) == oct(0o666 & ~umask)
    finally:
        dist.destroy_process_group()


FULL_DISK_AND_READ_ONLY = r"""
import json, os, subprocess, sys
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist
from ddp_helpers import train
from test_train import fake_trainer, world_of_one
root = {root!r}
for name, options in (("full", "size=64k"), ("ro", "ro,size=64k")):
    os.makedirs(os.path.join(root, name))
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", os.path.join(root, name)], check=True)
out = {{}}
try:
    train.make_config(checkpoint=os.path.join(root, "ro", "ck-{{epoch}}.pt"))
    out["read_only"] = "accepted"
except ValueError as err:
    out["read_only"] = str(err)
world_of_one()
try:
    train.save_checkpoint(fake_trainer(40000), os.path.join(root, "full", "ck.pt"), 0)   # 160 kB
    out["full"] = "saved"
except Exception as err:
    out["full"] = f"{{type(err).__name__}}: {{err}}"
out["left"] = os.listdir(os.path.join(root, "full"))
print(json.dumps(out))
"""


def test_a_read_only_folder_is_refused_up_front_and_a_full_disk_is_named(tmp_path):
    # A read-only folder failed after the first epoch; a full disk said "unexpected pos 63360 vs
    # 63256" and left ck.pt.tmp behind. Small file systems of our own: a mount namespace.
    import shutil
    if not shutil.which("unshare") or not shutil.which("mount"):
        pytest.skip("needs unshare and mount (util-linux)")
    script = FULL_DISK_AND_READ_ONLY.format(tests=os.path.dirname(__file__), root=str(tmp_path))
    done = subprocess.run(["unshare", "-rm", sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=seconds(60), env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))))
    if done.returncode and ("unshare" in done.stderr or "'mount'" in done.stderr):  # not allowed here
        pytest.skip("no user and mount namespaces here (unshare -rm, mount -t tmpfs): "
                    + done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert re.fullmatch(r"checkpoint='.*ro/ck-\{epoch\}\.pt': cannot write in .*/ro \(.*\)", out["read_only"]), out
    assert out["full"].startswith("OSError: [Errno 28] checkpoint not saved: the disk is full"), out
    assert out["left"] == [], out   # no temporary file left behind


@needs_mini
def test_resume_with_more_epochs_remakes_the_schedule(tmp_path, capsys):
    # The loaded schedule kept the old length: "Tried to step 11 times. The specified number of total
    # steps is 10". Now it is made for this run's steps and says so in one line.
    train.run(**SMALL, epochs=2, checkpoint=str(tmp_path / "{epoch}.pt"))
    capsys.readouterr()
    longer = train.run(**SMALL, epochs=4, resume=str(tmp_path / "1.pt"))    # verbose=False: said all the same
    out = capsys.readouterr().out.splitlines()
    fresh = train.run(**SMALL, epochs=4)
    assert [s["step"] for s in longer["steps"]] == list(range(11, 21))
    assert lrs(longer) == pytest.approx(lrs(fresh)[10:])
    assert out == ["resume: schedule re-made for 20 steps (5 an epoch); the checkpoint's run had 10 (5 an epoch)"]


@needs_mini
def test_resume_with_another_batch_size_remakes_the_schedule(tmp_path):
    train.run(**SMALL, epochs=2, checkpoint=str(tmp_path / "{epoch}.pt"))   # 5 steps an epoch
    resumed = train.run(**dict(SMALL, batch_size=5), epochs=2, resume=str(tmp_path / "0.pt"))
    fresh = train.run(**dict(SMALL, batch_size=5), epochs=2)                  # 10 steps an epoch
    assert [s["step"] for s in resumed["steps"]] == list(range(11, 21))       # from epoch 2 on
    assert lrs(resumed) == pytest.approx(lrs(fresh)[10:])


@needs_mini
def test_resume_with_another_world_size_remakes_the_schedule(two_ranks):
    folder = two_ranks[0]      # full-0.pt: 2 ranks, 10 steps an epoch; here 1 rank: 20 an epoch
    resumed = train.run(**TINY, epochs=3, resume=str(folder / "full-0.pt"))
    assert resumed["total_steps"] == 60 and [s["step"] for s in resumed["steps"]] == list(range(21, 61))
    schedule = train.Plain().optimizer(torch.nn.Linear(1, 1), train.make_config(**TINY, epochs=3), 60)[1]
    expected = []
    for _ in range(60):
        expected.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    assert lrs(resumed) == pytest.approx(expected[20:])


# ----------------------------------------------- damaged checkpoints: named, and resume auto falls back
def damage(path, how):
    """Damage a checkpoint as a crash, a full disk or a bad copy would."""
    whole = path.read_bytes()
    if how == "cut":       # a copy stopped half-way
        path.write_bytes(whole[:len(whole) // 2])
    elif how == "empty":   # created, never written
        path.write_bytes(b"")
    elif how == "flipped":  # one byte of the weights changed (the disk, the network)
        middle = len(whole) // 2
        path.write_bytes(whole[:middle] + bytes([whole[middle] ^ 0xFF]) + whole[middle + 1:])


@needs_mini
def test_resume_auto_falls_back_from_a_damaged_newest_checkpoint(tmp_path, capsys):
    # A newest file cut short gave the zip reader's "failed finding central directory", without the
    # file's name, and no fall-back; a flipped byte in the weights was loaded without a word.
    pattern = str(tmp_path / "{epoch}.pt")
    full = train.run(**SMALL, epochs=3, checkpoint=pattern)
    damage(tmp_path / "2.pt", "cut")
    capsys.readouterr()
    resumed = train.run(**SMALL, epochs=3, resume="auto", checkpoint=pattern)
    said = capsys.readouterr().out.splitlines()
    assert resumed["resumed_from"] == str(tmp_path / "1.pt")
    assert [s["step"] for s in resumed["steps"]] == list(range(11, 16))   # the last epoch again
    assert [x for s in losses(resumed) for x in s] == pytest.approx([x for s in losses(full)[10:] for x in s])
    assert len(said) == 1, said
    assert re.fullmatch(rf"resume auto: {re.escape(str(tmp_path / '2.pt'))} cannot be read \(cut short or not a "
                        rf"checkpoint: .*\); resuming from {re.escape(str(tmp_path / '1.pt'))} instead", said[0]), said
    assert torch.load(tmp_path / "2.pt", weights_only=True)["epoch"] == 2   # saved again, whole

    damage(tmp_path / "2.pt", "flipped")
    damage(tmp_path / "1.pt", "empty")
    resumed = train.run(**SMALL, epochs=3, resume="auto", checkpoint=pattern)
    said = capsys.readouterr().out.splitlines()
    assert resumed["resumed_from"] == str(tmp_path / "0.pt") and len(said) == 1, said
    assert "2.pt cannot be read (damaged: " in said[0] and "fails its checksum" in said[0], said
    assert "1.pt cannot be read (empty)" in said[0] and said[0].endswith("0.pt instead"), said

    for name in ("0.pt", "1.pt", "2.pt"):
        damage(tmp_path / name, "cut")
    with pytest.raises(ValueError, match=r"resume auto: no checkpoint .* can be read: .*2\.pt \(cut short.*1\.pt "
                                         r"\(cut short.*0\.pt \(cut short.*remove them to start from scratch"):
        train.run(**SMALL, epochs=3, resume="auto", checkpoint=pattern)


@needs_mini
def test_a_damaged_resume_path_is_a_clear_error_naming_the_file(tmp_path):
    train.run(**SMALL, epochs=1, checkpoint=str(tmp_path / "{epoch}.pt"))
    path = tmp_path / "0.pt"
    for how, why in (("flipped", r"damaged: .* fails its checksum"), ("cut", "cut short or not a checkpoint"),
                     ("empty", "empty")):
        damage(path, how)
        message = rf"resume={re.escape(repr(str(path)))}: this checkpoint cannot be read \({why}"
        with pytest.raises(ValueError, match=message):
            train.make_config(**SMALL, resume=str(path))   # up front, before any process starts
        train.run(**SMALL, epochs=1, checkpoint=str(path))  # whole again
    not_ours = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(2)}, not_ours)
    with pytest.raises(ValueError, match=r"weights\.pt': this checkpoint cannot be read \(not a checkpoint of this "
                                         r"trainer: it has no 'model', 'optimizer', 'schedule', 'epoch', 'step' "
                                         r"\(it has 'weight'\)\)"):
        train.run(**SMALL, resume=str(not_ours))


@needs_mini
def test_ranks_follow_rank_0s_fall_back_and_all_fail_together(tmp_path):
    pattern = str(tmp_path / "{epoch}.pt")
    train.run(**SMALL, epochs=2, checkpoint=pattern)
    damage(tmp_path / "1.pt", "cut")
    records = launch(train.run, 2, "gloo", kwargs=dict(SMALL, epochs=2, resume="auto", checkpoint=pattern),
                     timeout=seconds(60), quiet=True)
    assert [r["resumed_from"] for r in records] == [str(tmp_path / "0.pt")] * 2
    damage(tmp_path / "0.pt", "cut")
    damage(tmp_path / "1.pt", "cut")
    with pytest.raises(WorkerError, match="no checkpoint .* can be read") as info:
        launch(train.run, 2, "gloo", kwargs=dict(SMALL, epochs=2, resume="auto", checkpoint=pattern),
               timeout=seconds(60), quiet=True)
    assert info.value.exc_type == "ValueError"
