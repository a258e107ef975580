"""What a rank starts with, as a process that torchrun starts would: a random state of its own (or
a reproducible one, from a seed), a Flight Recorder holding only the learner's collectives,
`display` as in the notebook, and no process that can outlive the launch."""
import os
import pickle
import random
import signal
import time

import numpy
import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import needs_gpu, seconds
from test_kernel import run_notebook, text_of

from ddp_helpers import launcher
from ddp_helpers.launcher import launch
from ddp_helpers.pool import Pool
from ddp_helpers.runtime.random_state import reseed


def draws():
    """One number from each generator a rank has: torch, NumPy, Python's random."""
    return torch.rand(1).item(), numpy.random.rand(), random.random()


def differ(a, b):
    """Each generator drew a different number in `a` than in `b`."""
    return all(x != y for x, y in zip(a, b))


@pytest.fixture(scope="module")
def pool():
    with Pool(world_size=2) as p:
        yield p


# ---- each rank its own random state ----
def test_ranks_draw_different_numbers():
    rank0, rank1 = launch(draws, 2)
    assert differ(rank0, rank1), f"rank 0 drew {rank0}, rank 1 drew {rank1}"


def test_two_launches_draw_different_numbers():
    first, second = launch(draws, 1)[0], launch(draws, 1)[0]
    assert differ(first, second), f"one launch drew {first}, the next {second}"


def test_spawned_ranks_draw_different_numbers():
    rank0, rank1 = launcher.spawn(lambda rank: draws(), nprocs=2)
    assert differ(rank0, rank1)


def test_a_pools_ranks_draw_different_numbers_and_keep_drawing(pool):
    first = pool.run(draws)
    assert differ(*first), f"the pool's ranks drew {first}"
    again = pool.run(draws)
    assert differ(first[0], again[0]), "a rank drew the same numbers in two cells"
    cell = pool.run_cell("import random, numpy\n(torch.rand(1).item(), numpy.random.rand(), random.random())")
    assert differ(cell[0], cell[1])


def cuda_seeding():
    """Whether CUDA has started in this rank, and the GPU seeds queued for when it starts
    (torch.cuda's private queue; None where this torch has none)."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    queued = None if tracker is None else [call for call in tracker.get_calls() if call]
    return torch.cuda.is_initialized(), None if queued is None else len(queued)


def test_a_rank_seeds_its_gpus_without_starting_cuda():
    [(started, queued)] = launch(cuda_seeding, 1)
    assert not started, "seeding the rank started CUDA"
    assert queued is None or queued >= 1, "no seed is waiting for the GPUs"


def cuda_seeds():
    torch.cuda.init()   # the seed waits for CUDA to start (torch 2.11 makes the generators only then)
    return [torch.cuda.default_generators[d].initial_seed() for d in range(torch.cuda.device_count())]


@needs_gpu
def test_a_ranks_gpus_get_its_seed():
    fresh = launch(cuda_seeds, 2)
    assert fresh[0][0] != fresh[1][0]
    assert launch(cuda_seeds, 2, seed=5) == [[5] * torch.cuda.device_count(), [6] * torch.cuda.device_count()]


def test_reseed_with_a_seed_repeats_and_depends_on_the_rank():
    saved = torch.get_rng_state(), numpy.random.get_state(), random.getstate()
    try:
        reseed(0, 7)
        rank0 = draws()
        assert torch.initial_seed() == 7
        reseed(1, 7)
        rank1 = draws()
        assert torch.initial_seed() == 8
        reseed(0, 7)
        assert draws() == rank0
        assert differ(rank0, rank1)
        reseed(0, None)
        fresh = draws()
        reseed(0, None)
        assert differ(fresh, draws()) and differ(fresh, rank0)
        reseed(0, 2 ** 40)   # beyond NumPy's 32-bit seeds: still accepted
    finally:
        torch.set_rng_state(saved[0])
        numpy.random.set_state(saved[1])
        random.setstate(saved[2])


def seeded_draws():
    return torch.initial_seed(), draws()


def test_a_seed_makes_a_launch_reproducible_and_rank_dependent():
    first = launch(seeded_draws, 2, seed=0)
    assert launch(seeded_draws, 2, seed=0) == first
    assert [seed for seed, _ in first] == [0, 1], "seed + rank, as Accelerate's set_seed(device_specific=True)"
    assert differ(first[0][1], first[1][1])
    assert launch(seeded_draws, 1, seed=1)[0] == first[1], "rank 0 with seed 1 draws what rank 1 with seed 0 drew"
    assert launcher.spawn(lambda rank: seeded_draws(), nprocs=2, seed=0) == first


def test_a_seeded_pool_request_is_reproducible_and_rank_dependent(pool):
    source = "import random, numpy\n(torch.rand(1).item(), numpy.random.rand(), random.random())"
    first = list(pool.run_cell(source, seed=3))
    assert list(pool.run_cell(source, seed=3)) == first == pool.run(draws, seed=3)
    assert differ(*first)
    unseeded = pool.run(draws)
    assert differ(unseeded[0], first[0]), "a request without a seed leaves the random state as it is"


def test_a_seeded_pool_starts_its_ranks_from_seed_plus_rank():
    with Pool(world_size=2, seed=5) as seeded:
        assert [seed for seed, _ in seeded.run(seeded_draws)] == [5, 6]


# ---- Flight Recorder: only the learner's own collectives ----
def flight_recorder_entries():
    """This rank's Flight Recorder entries after one all_reduce of its own: (name, sequence number);
    None where this torch has no Flight Recorder dump, or it records no Gloo collective."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    dist.all_reduce(torch.ones(1))
    entries = pickle.loads(dump()).get("entries", [])
    if not any("all_reduce" in e.get("profiling_name", "") for e in entries):
        return None
    return [(e["profiling_name"], e.get("collective_seq_id")) for e in entries]


def test_the_flight_recorder_shows_only_the_learners_collectives(pool):
    for where, entries in (("launch", launch(flight_recorder_entries, 2)),
                           ("a warm pool", pool.run(flight_recorder_entries))):
        if entries[0] is None:
            pytest.skip("this torch's Flight Recorder records no Gloo collective, or cannot be dumped")
        for rank_entries in entries:
            assert rank_entries[0] == ("gloo:all_reduce", 1), f"{where}: {rank_entries}"


# ---- display() in a launched function ----
def test_display_in_a_launched_notebook_function_shows_in_the_cell():
    cells = run_notebook([
        "from ddp_helpers import launch\nfrom IPython.display import HTML",
        "def show():\n    import torch.distributed as dist\n"
        "    display(HTML(f'<b>shown by rank {dist.get_rank()}</b>'))\n    return 'done'\n"
        "launch(show, 2)",
    ], timeout=seconds(60))
    html = [out.data["text/html"] for out in cells[1].outputs
            if out.output_type == "display_data" and "text/html" in out.data]
    assert sorted(html) == ["<b>shown by rank 0</b>", "<b>shown by rank 1</b>"], text_of(cells[1])
    assert "['done', 'done']" in text_of(cells[1])


# ---- nothing a rank starts outlives the launch ----
def daemonize():
    """The classic daemon: fork, setsid, fork again, the middle process exits. Returns the daemon's PID."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.execvp("sleep", ["sleep", "300"])
        os.write(write, str(daemon).encode())
        os._exit(0)
    os.waitpid(child, 0)
    os.close(write)
    pid = int(os.read(read, 32))
    deadline = time.monotonic() + 10
    while the_daemon(pid) is None and time.monotonic() < deadline:   # until it runs `sleep`
        time.sleep(0.01)
    return pid


def the_daemon(pid):
    """The daemon's psutil.Process while it runs; None once it is gone."""
    try:
        p = psutil.Process(pid)
        return p if p.cmdline() == ["sleep", "300"] and p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def test_a_setsid_double_forked_grandchild_ends_with_the_launch():
    pids = launch(daemonize, 2)
    try:
        deadline = time.monotonic() + seconds(2)
        while any(map(the_daemon, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in pids if the_daemon(pid)]
        assert not left, f"the daemons {left} outlived the launch"
    finally:
        for pid in pids:
            daemon = the_daemon(pid)
            if daemon is not None:
                daemon.send_signal(signal.SIGKILL)


def test_a_setsid_double_forked_grandchild_ends_with_the_pool():
    pool = Pool(world_size=1)
    pids = []
    try:
        pids = pool.run(daemonize)
        assert all(map(the_daemon, pids)), "the daemon runs while the pool does"
        pool.stop()
        deadline = time.monotonic() + seconds(2)
        while any(map(the_daemon, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(the_daemon, pids)), "the daemon outlived the pool"
    finally:
        pool.stop()
        for pid in pids:
            daemon = the_daemon(pid)
            if daemon is not None:
                daemon.send_signal(signal.SIGKILL)
