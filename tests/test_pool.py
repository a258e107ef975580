"""The warm pool: state kept between cells, failures that restart it, nothing left behind."""
import os
import re
import signal
import threading
import time

import pytest
from conftest import seconds
from test_launch import listening_ports, pid_alive

from ddp_helpers import WorkerError, WorkerTimeout
from ddp_helpers.pool import Pool


@pytest.fixture
def pool():
    with Pool(world_size=3) as p:
        yield p


def pids(p):
    return [row["pid"] for row in p.status()]


def test_namespace_persists_between_cells_per_rank(pool):
    assert pool.run_cell("x = torch.tensor([float(rank)])") is None
    assert [t.item() for t in pool.run_cell("dist.all_reduce(x)\nx * 0 + x")] == [3.0, 3.0, 3.0]
    assert list(pool.run_cell("rank * 10")) == [0, 10, 20]
    assert [t.item() for t in pool.pull("x")] == [3.0, 3.0, 3.0]


def test_kernel_variables_fill_in_but_never_overwrite_rank_variables(pool):
    def helper(v):
        return v + 1
    assert list(pool.run_cell("helper(rank)", {"helper": helper})) == [1, 2, 3]
    pool.run_cell("mine = rank")
    assert list(pool.run_cell("mine", {"mine": "from the kernel"})) == [0, 1, 2]


def test_push_and_pull(pool):
    pool.push(lr=0.5, name="run1")
    assert list(pool.run_cell("(lr * rank, name)")) == [(0.0, "run1"), (0.5, "run1"), (1.0, "run1")]
    with pytest.raises(WorkerError, match="rank 0 raised NameError: rank 0 has no variable 'nope'"):
        pool.pull("nope")


def test_run_calls_a_function_on_every_rank(pool):
    import torch.distributed as dist
    assert pool.run(lambda k: dist.get_rank() * k, 5) == [0, 5, 10]


def test_output_is_prefixed_per_rank(pool, capfd):
    pool.run_cell("print('hello', rank)")
    out = capfd.readouterr().out.splitlines()
    assert sorted(out) == ["[rank 0] hello 0", "[rank 1] hello 1", "[rank 2] hello 2"]


def test_exception_shows_remote_traceback_and_keeps_the_namespace(pool):
    pool.run_cell("kept = rank + 100")
    before = pids(pool)
    with pytest.raises(WorkerError) as info:
        pool.run_cell("if rank == 2:\n    raise KeyError('only on rank 2')\nrank", filename="<cell-7>")
    assert info.value.rank == 2 and info.value.exc_type == "KeyError"
    assert "raise KeyError('only on rank 2')" in info.value.remote_traceback
    assert 'File "<cell-7>", line 2' in info.value.remote_traceback
    assert "pool.py" not in info.value.remote_traceback, "plumbing frames are trimmed"
    assert list(pool.run_cell("kept")) == [100, 101, 102]
    assert pids(pool) == before, "no restart needed: nobody was stuck"


def test_error_while_others_wait_in_a_collective_restarts_the_pool(pool):
    old = pids(pool)
    pool.run_cell("x = 1")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank\(s\) \[0, 2\] were still running"):
        pool.run_cell("if rank == 1:\n    raise ValueError('rank 1 fails')\ndist.barrier()")
    assert time.monotonic() - start < seconds(5)
    assert [pid_alive(p) for p in old] == [False, True, False], "rank 1 stays for pool.debug()"
    with pytest.raises(WorkerError, match="NameError"):
        pool.run_cell("x")  # fresh ranks: variables reset
    assert not any(pid_alive(p) for p in old)
    assert list(pool.run_cell("rank")) == [0, 1, 2]


def test_interrupt_during_a_collective_then_a_working_cell(pool, capfd):
    old = pids(pool)
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        pool.run_cell("import time\nif rank == 0:\n    time.sleep(600)\ndist.barrier()")
    assert time.monotonic() - start < 1.5 + seconds(5)
    [line] = info.value._render_traceback_()   # what IPython shows: one line, no launcher frames
    assert line.startswith("KeyboardInterrupt: ") and "variables are reset" in line
    assert not any(pid_alive(p) for p in old)
    assert list(pool.run_cell("t = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())")) == [3, 3, 3]


def test_worker_death_is_reported_and_the_pool_restarts(pool):
    old = pids(pool)
    with pytest.raises(WorkerError, match="rank 1 was killed by signal SIGKILL"):
        pool.run_cell("import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "dist.barrier()")
    assert not any(pid_alive(p) for p in old)
    assert list(pool.run_cell("rank")) == [0, 1, 2]
    assert set(pids(pool)).isdisjoint(old)


def test_processes_a_rank_started_end_when_it_is_killed(pool):
    children = pool.run_cell("import subprocess\nchild = subprocess.Popen(['sleep', '300'])\nchild.pid")
    assert all(map(pid_alive, children))
    with pytest.raises(WorkerError, match="rank 0 was killed by signal SIGKILL"):
        pool.run_cell("import os, signal, time\nif rank == 0:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(600)")
    deadline = time.monotonic() + seconds(2)
    while any(map(pid_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(pid_alive, children)), "a process a pool rank started outlived it"


def test_timeout_names_stuck_ranks_and_restarts(pool):
    with pytest.raises(WorkerTimeout) as info:
        pool.run_cell("import time\nif rank == 2:\n    time.sleep(600)", timeout=1.5)
    assert info.value.unfinished_ranks == [2]
    assert list(pool.run_cell("rank")) == [0, 1, 2]


def test_stop_leaves_no_process_and_no_port():
    pool = Pool(world_size=2)
    port = pool.port
    assert port in listening_ports()
    started = pids(pool)
    pool.stop()
    assert not any(pid_alive(p) for p in started)
    assert port not in listening_ports()
    with pytest.raises(RuntimeError, match="this pool was stopped"):
        pool.run_cell("1")


def test_bad_input_is_rejected_before_start():
    with pytest.raises(ValueError, match="world_size must be between"):
        Pool(world_size=0)
    with pytest.raises(ValueError, match="unknown backend"):
        Pool(world_size=2, backend="tcp")


def test_a_rank_dying_while_idle_is_reported_and_the_next_cell_runs_on_fresh_ranks(pool, capfd):
    pool.run_cell("x = rank")
    old = pids(pool)
    os.kill(old[1], signal.SIGKILL)
    deadline = time.monotonic() + seconds(5)
    while pool.status()[1]["state"] != "dead" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.status()[1]["state"] == "dead"
    assert list(pool.run_cell("print('hello from', rank)\nrank")) == [0, 1, 2]
    out, err = capfd.readouterr()
    assert "ddp pool" not in err, "a notice is information, not an error: stdout"
    assert re.search(r"rank 1 was killed by signal SIGKILL.* while idle", out) and "variables are empty" in out
    assert out.index("variables are empty") < out.index("[rank 0] hello from 0"), "notices come first"
    assert not any(pid_alive(p) for p in old)
    os.kill(pids(pool)[0], signal.SIGKILL)   # push and pull repair it too
    time.sleep(0.2)
    pool.push(a=1)
    assert list(pool.pull("a")) == [1, 1, 1]


def test_a_cell_that_destroys_the_process_group_leaves_a_pool_that_repairs_itself(pool, capfd):
    old = pids(pool)
    pool.run_cell("dist.destroy_process_group()")
    out, err = capfd.readouterr()
    assert "destroyed the process group" in out and "ddp pool" not in err
    assert list(pool.run_cell("t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', int(t.item()))\n"
                              "int(t.item())")) == [3, 3, 3]
    out, err = capfd.readouterr()
    assert "ddp pool" not in err
    assert out.index("ddp pool: started 3 new ranks") < out.index("[rank 0] sum 3"), "notices come first"
    assert set(pids(pool)).isdisjoint(old)
