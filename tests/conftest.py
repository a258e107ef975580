"""Fixtures shared by the training tests (test_train.py, test_speed.py)."""
import tempfile

import pytest
import torch

from ddp_helpers.launcher import loopback_interface


@pytest.fixture(scope="module")
def own_launch_folders(tmp_path_factory):
    """launch's logs go to a folder of this module's own, apart from the runs of other processes (an
    older launcher pruned other processes' live run folders: another session's tests made this
    module's ranks exit with code 1)."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("launches"))
    yield
    tempfile.tempdir = saved


@pytest.fixture
def one_thread(monkeypatch):
    """For runs in this process: one thread (two threads on a busy 2-core machine made these small
    steps 20x slower), and the loopback interface that train.setup would set for good."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback_interface())
    yield
    torch.set_num_threads(threads)
