"""What the tests share: the repository's folder, skip marks, how long a test may wait, and the
training tests' fixtures.

Waiting: this suite runs on busy 2-core machines. A test waits `seconds(s)`: `s` times one
setting, DDP_HELPERS_TEST_TIME_SCALE (default 3). Raise it on a slower or busier machine; no test
compares a wall-clock time with a tight limit.

    from conftest import REPO, MINI, needs_mini, needs_gpu, needs_2_gpus, seconds

A module whose tests share one 2-rank launch: `launch_two_ranks_once` in its `two_ranks` fixture.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from ddp_helpers import data, machine
from ddp_helpers.compat import loopback_interface
from ddp_helpers.launcher import launch

# The longest files first: the test command runs on two workers, a whole file at a time
# (pytest-xdist, --dist loadfile), so a long file started last would keep one worker busy while the
# other waits. Measured in a fresh-clone CI run on the 2-core machine (each file's tests summed).
LONGEST_FIRST = ["tests/test_exercises.py", "tests/test_browser.py", "tests/test_launch.py",
                 "tests/test_benchmarks.py", "tests/test_kernel.py", "tests/test_torchrun.py",
                 "notebooks/06_ddp_cifar10.ipynb", "notebooks/11_beyond_one_machine.ipynb",
                 "tests/test_train.py", "tests/test_tutorials.py", "tests/test_rank_output.py"]


def pytest_collection_modifyitems(config, items):
    """Order the files, longest first (LONGEST_FIRST); a file's own tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), REPO), len(rank)))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME_SCALE = float(os.environ.get("DDP_HELPERS_TEST_TIME_SCALE", "3"))

MINI = os.environ.get(data.ENV_VAR)  # the offline CIFAR-10 subset, if .ci/run (or you) set it
# NCCL launches lease their GPUs (ddp_helpers.gpu_leases): the workers of one suite on one GPU, and the
# notebooks' kernels they start, take turns instead of being refused. A test of being told at once
# must clear it for its processes (as test_gpu_leases does): with it they wait up to 600 s instead.
os.environ.setdefault("DDP_HELPERS_GPU_WAIT", "600")
needs_mini = pytest.mark.skipif(
    not MINI,
    reason=f"{data.ENV_VAR} is not set: .ci/run extracts the offline CIFAR-10 subset "
           "(shared/data/cifar10-png-mini.tar.gz) and sets it")
needs_gpu = pytest.mark.skipif(machine.gpu_count() < 1, reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(machine.gpu_count() < 2 or not dist.is_nccl_available(),
                                  reason="needs 2 CUDA GPUs and NCCL")


def cannot_run(reason, whole_module=False):
    """A test this machine cannot run: skipped, with the reason. In CI (CI=true), which must run it (a
    security property or the browser tests going untested must not pass for tested), a failure with the
    reason instead. whole_module: called at a test module's top, for all its tests."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run it", pytrace=False)
    pytest.skip(reason, allow_module_level=whole_module)


def seconds(s):
    """A deadline of `s` seconds on an idle machine, stretched for a busy one (TIME_SCALE)."""
    return s * TIME_SCALE


@pytest.fixture(scope="module")
def own_launch_folders(tmp_path_factory):
    """launch's logs go to a folder of this module's own, apart from the runs of other processes (an
    older launcher pruned other processes' live run folders: another session's tests made this
    module's ranks exit with code 1)."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("launches"))
    yield
    tempfile.tempdir = saved


def launch_two_ranks_once(on_two_ranks, tmp_path_factory):
    """For a module's `two_ranks` fixture: one 2-rank Gloo launch of `on_two_ranks(folder)`, whose
    results the module's tests share (each launch costs seconds); skipped without the data."""
    if not MINI:
        pytest.skip(f"{data.ENV_VAR} is not set")
    folder = tmp_path_factory.mktemp("checkpoints")
    return folder, launch(on_two_ranks, world_size=2, backend="gloo", args=(str(folder),),
                          timeout=seconds(60), quiet=True)


@pytest.fixture
def one_thread(monkeypatch):
    """For runs in this process: one thread (two threads on a busy 2-core machine made these small
    steps 20x slower), and the loopback interface that train.setup would set for good."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback_interface())
    yield
    torch.set_num_threads(threads)
