"""What notebooks 11 (torchrun, several nodes) and 12 (debugging) show, checked outside the notebooks:
py-spy as an optional tool that reads a stuck rank's C++ frames, dist.breakpoint under torchrun with
typed input, and why torch's own, which reads /dev/stdin, finds no terminal in a notebook's rank (there the
course's replaces it); what 12 reads from the installed
torch about a dead peer, and where its sources are cited."""
import os
import re
import shutil
import subprocess
import sys
import time

import nbformat
import pytest
import torch

try:
    import tomllib
except ImportError:   # Python 3.10
    tomllib = None

from conftest import REPO, seconds

from ddp_helpers import launch, torchrun
from ddp_helpers.compat import loopback_interface

NB11 = os.path.join(REPO, "notebooks", "11_beyond_one_machine.ipynb")
NB12 = os.path.join(REPO, "notebooks", "12_debugging.ipynb")

needs_private_network = pytest.mark.skipif(not torchrun.private_network_available(),
                                           reason="needs `unshare -rn` (a private network namespace)")


@pytest.mark.skipif(tomllib is None, reason="needs tomllib (Python 3.11)")
def test_py_spy_is_the_optional_debug_extra_that_notebook_12_names():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["optional-dependencies"]["debug"] == ["py-spy"]
    assert not any(d.startswith("py-spy") for d in project["dependencies"])      # optional: not required
    with open(os.path.join(REPO, "notebooks", "12_debugging.ipynb")) as f:
        assert 'pip install -e \\".[debug]\\"' in f.read()


def py_spy():
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed (pip install -e '.[debug]')")
def test_py_spy_shows_where_a_rank_waits_for_a_peer_that_never_comes(tmp_path):
    # Notebook 12, "A hung process": rank 0 of 2 in init_process_group; the C++ frames name the wait.
    waiter = ("import sys, torch.distributed as dist\nprint('waiting', flush=True)\n"
              "dist.init_process_group('gloo', init_method='file://' + sys.argv[1], rank=0, world_size=2)\n")
    stuck = subprocess.Popen([sys.executable, "-c", waiter, str(tmp_path / "rendezvous")], text=True,
                             stdout=subprocess.PIPE, env={**os.environ, "GLOO_SOCKET_IFNAME": loopback_interface()})
    try:
        assert stuck.stdout.readline().strip() == "waiting"
        deadline = time.monotonic() + seconds(10)
        while True:   # until it is inside init_process_group's C++ part
            seen = subprocess.run([py_spy(), "dump", "--native", "--pid", str(stuck.pid)], capture_output=True,
                                  text=True, timeout=seconds(20))
            if seen.returncode != 0:
                pytest.skip(f"py-spy may not trace here: {seen.stderr.strip()[-200:]}")
            if "connectFullMesh" in seen.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        dump = re.sub(r"\x1b\[[0-9;]*m", "", seen.stdout)
        for frame in ("c10d::FileStore::wait", "gloo::rendezvous::Context::connectFullMesh", "init_process_group"):
            assert frame in dump, dump
    finally:
        stuck.kill()
        stuck.wait()


def notebook_rank_stdin():
    return os.isatty(0)


def test_a_launched_rank_has_no_terminal_to_read():
    # Notebook 12: dist.breakpoint reads /dev/stdin, and a notebook's ranks have no terminal behind it.
    assert launch(notebook_rank_stdin, 1) == [False]


@needs_private_network
def test_dist_breakpoint_under_torchrun_reads_the_typed_commands(tmp_path):
    # Notebook 12, "A debugger on one rank": rank 0 stops in pdb, rank 1 waits in the barrier.
    script = tmp_path / "debug_me.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "x = torch.full((2,), float(dist.get_rank()))\n"
                      "dist.breakpoint(rank=0)\n"
                      "dist.all_reduce(x)\n"
                      "print(f'rank {dist.get_rank()}: {x.tolist()}', flush=True)\n"
                      "dist.destroy_process_group()\n")
    out = torchrun.run_nodes([str(script)], nnodes=1, nproc_per_node=2, standalone=True,
                             stdin="up\np x\nc\n", timeout=seconds(60))
    log = out.logs[0]
    assert out.ok, log
    assert "debug_me.py(4)<module>()" in log and "tensor([0., 0.])" in log          # rank 0's own x
    assert log.count("(Pdb) ") == 3                                                 # one prompt per command
    assert sorted(re.findall(r"rank \d: \[.*?\]", log)) == ["rank 0: [1.0, 1.0]", "rank 1: [1.0, 1.0]"]


def _cells(path):
    """The notebook's cells, and the index of its Summary cell (the end of the core)."""
    cells = nbformat.read(path, as_version=4).cells
    summary = next(i for i, c in enumerate(cells)
                   if c.cell_type == "markdown" and c.source.lstrip().startswith("## Summary"))
    return cells, summary


def test_12_reads_the_nccl_failure_defaults_from_the_installed_torch():
    # Notebook 12, "When a peer dies": the group timeouts and torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING.
    cells, summary = _cells(NB12)
    cell = next(c for c in cells[:summary] if c.cell_type == "code" and "local_elastic_agent" in c.source)
    namespace = {"torch": torch, "os": os, "re": re}
    exec(cell.source, namespace)   # its own assert: torchrun's agent sets 1
    assert namespace["agent"].group(1) == "1"
    from torch.distributed import constants
    assert constants.default_pg_timeout.total_seconds() == 30 * 60                     # Gloo: "30 minutes"
    assert constants.default_pg_nccl_timeout is None or constants.default_pg_nccl_timeout.seconds == 600


def test_12_shows_the_gloo_survivor_live_with_a_short_timeout():
    # The core runs the survivor with timeout=2 s and asserts "at once" vs "at the timeout".
    cells, summary = _cells(NB12)
    cell = next(c for c in cells[:summary] if c.cell_type == "code" and "def survivor" in c.source)
    assert "timeout=timedelta(seconds=2)" in cell.source
    assert '"Timed out" in said and 1.9 < waited' in cell.source and '"by peer" in said' in cell.source
    assert 'assert again == "raised again"' in cell.source                  # and the group stays broken


def test_12_cites_the_flight_recorder_defaults_in_going_further_only():
    cells, summary = _cells(NB12)
    core = "\n".join(c.source for c in cells[:summary + 1] if c.cell_type == "markdown")
    rest = "\n".join(c.source for c in cells[summary + 1:] if c.cell_type == "markdown")
    for pr in ("https://github.com/pytorch/pytorch/pull/142260", "https://github.com/pytorch/pytorch/pull/143446"):
        assert pr in rest and pr not in core
    for issue in ("NVIDIA/nccl/issues/795", "deepseek-ai/DeepEP/issues/106"):
        assert issue in rest
    assert "TORCH_NCCL_PROPAGATE_ERROR" in rest and "ncclRemoteError" in core


def test_12_reads_proc_only_where_it_exists():
    # macOS has no /proc: the cell that reads a rank's standard input checks first.
    cells, _ = _cells(NB12)
    cell = next(c for c in cells if c.cell_type == "code" and "/proc/self/fd/0" in c.source)
    assert "os.path.exists(fd0)" in cell.source


def _header_time_line(cells):
    return next(line for line in cells[0].source.splitlines() if line.startswith("**Time**"))


@pytest.mark.parametrize("path", [NB11, NB12], ids=os.path.basename)
def test_the_header_states_minutes_and_no_machine_timings(path):
    # How long Run All takes is measured by the lead on each machine, not stated in the lesson.
    cells, _ = _cells(path)
    assert re.fullmatch(r"\*\*Time\*\*: about \d+ minutes\.", _header_time_line(cells))


def test_11_leaves_what_a_dead_peer_does_to_12():
    cells, summary = _cells(NB11)
    core = "\n".join(c.source for c in cells[:summary + 1] if c.cell_type == "markdown")
    for detail in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "watchdog", "ncclRemoteError", "TORCH_NCCL_PROPAGATE_ERROR",
                   "Connection closed by peer"):
        assert detail not in core, detail
    assert "(12_debugging.ipynb)" in core


def test_11_glosses_p2p_as_direct_over_nvlink_or_pcie():
    cells, _ = _cells(NB11)
    cell = next(c for c in cells if c.cell_type == "code" and '"via P2P"' in c.source)
    assert "NVLink or PCIe" in cell.source and "P2P (NVLink)" not in cell.source
    assert "meta['interconnect']" in cell.source          # the stored machine's link, printed beside it
