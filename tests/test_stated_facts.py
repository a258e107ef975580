"""Facts the notebooks state from torch's own source, checked against the installed torch.

The notebooks prove most facts with live cells; these are the ones taught as text (they need NCCL,
GPUs or a terminal), so a torch release that changes them fails here instead of leaving the text wrong.
"""
import inspect
import os
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


def torch_version():
    return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


def c10d_header(name):
    """The text of one of c10d's C++ headers in the installed torch (the test skips without them)."""
    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "distributed",
                          "c10d", name)
    if not os.path.exists(header):
        pytest.skip("this torch ships no C++ headers")
    with open(header) as f:
        return f.read()


def test_flight_recorder_is_on_by_default_with_2000_entries():
    # Notebook 12: TORCH_FR_BUFFER_SIZE first, then TORCH_NCCL_TRACE_BUFFER_SIZE, default 2000.
    text = c10d_header("FlightRecorder.hpp")
    read = re.search(r"max_entries_ = getCvarInt\(\s*\{([^}]*)\},\s*(\d+)\)", text)
    assert read, "FlightRecorder.hpp no longer reads its buffer size the way notebook 12 says"
    names = re.findall(r'"(\w+)"', read.group(1))
    assert names == ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"]
    assert int(read.group(2)) == 2000


def test_breakpoint_reads_dev_stdin_and_lengthens_timeouts():
    # Notebook 12: dist.breakpoint opens /dev/stdin (so it needs a terminal) and sets an hour's timeout.
    assert "/dev/stdin" in inspect.getsource(dist._make_distributed_pdb)
    assert inspect.signature(dist.breakpoint).parameters["timeout_s"].default == 3600


def test_shrink_group_is_there_from_torch_2_10():
    # Notebook 12, Going further: new in torch 2.10 (torch 2.9.1's distributed_c10d.py has no shrink_group).
    if torch_version() >= (2, 10):
        assert hasattr(dist, "shrink_group")
    else:
        assert not hasattr(dist, "shrink_group")


def test_torchrun_workers_use_the_agent_store_unless_sharing_is_disabled(monkeypatch):
    # Notebook 01, Going further, "Who runs the store": the agent's store by default, else a fresh one.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    handler = object.__new__(DynamicRendezvousHandler)     # use_agent_store reads only the environment
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert handler.use_agent_store is True
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert handler.use_agent_store is False


def test_without_the_agent_store_worker_rank_0_hosts_it(monkeypatch):
    # ... and then the worker with RANK 0 starts the server (torch/distributed/rendezvous.py).
    from torch.distributed.rendezvous import _create_c10d_store
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    # world_size=1: rank 0's server does not wait for the others to join before returning
    server = _create_c10d_store("127.0.0.1", 0, rank=0, world_size=1, timeout=timedelta(seconds=10))
    client = _create_c10d_store("127.0.0.1", server.port, rank=1, world_size=1, timeout=timedelta(seconds=10))
    client.set("from rank 1", "hello")
    assert server.get("from rank 1") == b"hello"


def test_torchrun_agent_gives_workers_async_error_handling_1():
    # Notebook 12: the agent sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless it is set already.
    from torch.distributed.elastic.agent.server import local_elastic_agent
    source = inspect.getsource(local_elastic_agent)
    assert re.search(r'"TORCH_NCCL_ASYNC_ERROR_HANDLING": os\.getenv\(\s*"TORCH_NCCL_ASYNC_ERROR_HANDLING",'
                     r"\s*str\(1\)\s*\)", source)


def ddp_in_a_world_of_one(module, **options):
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return DDP(module, **options)
    finally:
        dist.destroy_process_group()


def test_ddp_sends_rank_0s_buffers_by_default_under_its_torch_2_13_name():
    # Notebook 05: DDP broadcasts rank 0's buffers before forward by default; the argument is
    # forward_sync_buffers since torch 2.13, and broadcast_buffers (2.11 has only it) warns.
    from torch.nn.parallel import DistributedDataParallel as DDP
    new = "forward_sync_buffers" in inspect.signature(DDP).parameters
    assert new == (torch_version() >= (2, 13))
    model = ddp_in_a_world_of_one(torch.nn.BatchNorm1d(2))
    assert model.broadcast_buffers is True and getattr(model, "forward_sync_buffers", True) is True
    if new:
        assert ".. deprecated:: 2.13" in inspect.getsource(DDP)
        with pytest.warns(FutureWarning, match="`broadcast_buffers` is deprecated"):
            ddp_in_a_world_of_one(torch.nn.BatchNorm1d(2), broadcast_buffers=False)


def test_nccl_async_error_handling_defaults_to_3_and_the_dump_switch_is_declared():
    # Notebook 12: TORCH_NCCL_ASYNC_ERROR_HANDLING's default is 3 (SkipCleanUp), and the
    # Flight Recorder's dump is switched by TORCH_NCCL_DUMP_ON_TIMEOUT (its default, 1, is set in
    # ProcessGroupNCCL.cpp, which the wheel does not ship: notebook 12 shows it measured on an H200).
    text = c10d_header("ProcessGroupNCCL.hpp")
    assert "default value (3 - SkipCleanUp)" in text
    assert re.search(r'TORCH_NCCL_DUMP_ON_TIMEOUT = \{\s*"TORCH_NCCL_DUMP_ON_TIMEOUT"\}', text)


def test_nccl_propagate_error_is_declared_as_notebook_12_says():
    # Notebook 12, Going further: a rank that sees an NCCL error tells the others through the store.
    text = c10d_header("ProcessGroupNCCL.hpp")
    said = re.search(r"//([^\n]*)\n(?://[^\n]*\n)*static std::vector<std::string> TORCH_NCCL_PROPAGATE_ERROR", text)
    assert said and "propagate NCCL errors to all ranks through TCPStore" in said.group(1)


def test_torchrun_agent_tells_its_workers_whether_they_use_its_store():
    # Notebook 11, Going further, "Whose store": the workers print TORCHELASTIC_USE_AGENT_STORE=True.
    from torch.distributed.elastic.agent.server import local_elastic_agent
    assert '"TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store)' in inspect.getsource(local_elastic_agent)
