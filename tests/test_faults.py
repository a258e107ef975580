"""Faults in the warm pool and in a rank that must end in a clear message and leave the next cell
working: an interrupted push, a function that returns while its threads still run, a cell that
forks, and a warm cell that costs no scan of the machine's processes."""
import os
import signal
import threading
import time

import psutil
import pytest
import torch
from conftest import seconds
from test_launch import pid_alive

from ddp_helpers import WorkerError, launch
from ddp_helpers.pool import Pool


def pids(pool):
    return [row["pid"] for row in pool.status()]


def wait_until_gone(pids_, within):
    deadline = time.monotonic() + within
    while any(map(pid_alive, pids_)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids_ if pid_alive(p)]


def test_an_interrupted_push_discards_the_pool_and_the_next_cell_starts_fresh(capfd):
    with Pool(world_size=2) as pool:
        old = pids(pool)
        os.kill(old[0], signal.SIGSTOP)   # rank 0 reads nothing: the push stops half-way, as a big one does

        def interrupt():
            os.kill(os.getpid(), signal.SIGINT)   # the notebook's Interrupt button
            time.sleep(0.5)
            os.kill(old[0], signal.SIGCONT)

        timer = threading.Timer(1.0, interrupt)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                pool.push(big=torch.zeros(16 * 2**20))   # 64 MiB
        finally:
            timer.join()
        [line] = info.value._render_traceback_()   # one line, as an interrupted cell shows
        assert line.startswith("KeyboardInterrupt: ") and "variables are reset" in line, line
        assert [row["state"] for row in pool.status()] == ["stopped", "stopped"]
        assert wait_until_gone(old, seconds(2)) == []
        start = time.monotonic()
        assert list(pool.run_cell("rank", timeout=seconds(20))) == [0, 1]
        assert time.monotonic() - start < seconds(10)
        assert "started 2 new ranks" in capfd.readouterr().out


def leave_a_thread(seconds_left):
    import threading
    import time
    threading.Thread(target=time.sleep, args=(seconds_left,), name="feeder").start()
    return "returned"


KEPT = []


def leave_an_idle_executor():
    from concurrent.futures import ThreadPoolExecutor
    KEPT.append(ThreadPoolExecutor(2))   # kept, never shut down (torch.compile keeps one): Python ends it at exit
    return KEPT[0].submit(pow, 2, 10).result()


def test_a_function_that_returns_while_its_threads_run_is_named_within_seconds():
    # a thread that ends soon after the function returns is waited for, as Python would
    assert launch(leave_a_thread, 2, args=(0.3,), quiet=True) == ["returned", "returned"]
    assert launch(leave_an_idle_executor, 1, quiet=True) == [1024]
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(leave_a_thread, 2, args=(600,), timeout=seconds(20), quiet=True)
    assert time.monotonic() - start < seconds(8)
    message = str(info.value)
    assert "returned while its threads still run" in message and "'feeder'" in message, message
    assert "collective" not in message.splitlines()[0], message


FORK = ("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep({})\n"
        "'child' if pid == 0 else pid")


def test_a_forked_child_of_a_rank_cannot_answer_for_it_and_threads_do_not_hold_a_rank():
    with Pool(world_size=2) as pool:
        quick = list(pool.run_cell(FORK.format(0.2)))   # children that reach the end of the cell
        slow = list(pool.run_cell(FORK.format(600)))    # children interrupted later
        assert all(isinstance(pid, int) for pid in quick + slow), (quick, slow)
        time.sleep(0.5)
        for pid in slow:
            os.kill(pid, signal.SIGINT)   # Jupyter's Interrupt reaches the kernel's whole process group
        assert wait_until_gone(quick + slow, seconds(2)) == []
        for _ in range(3):
            assert list(pool.run_cell("'next'")) == ["next", "next"]
        assert [row["state"] for row in pool.status()] == ["idle", "idle"]
        # a thread a cell left running does not keep a rank from leaving at %ddp stop
        pool.run_cell("import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()")
        processes = list(pool._ranks.processes)
        pool.stop()
        assert [p.exitcode for p in processes] == [0, 0], "the ranks had to be terminated"


def test_a_warm_cell_scans_no_processes(monkeypatch):
    with Pool(world_size=2) as pool:
        calls = []
        real = psutil.Process.children
        monkeypatch.setattr(psutil.Process, "children", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
        for _ in range(20):
            pool.run_cell("x = 1")
        assert calls == [], f"{len(calls)} scans of the processes in 20 trivial cells"
        # a cell that starts a process is still noted, to be ended if its rank dies
        children = pool.run_cell("import subprocess\nchild = subprocess.Popen(['sleep', '300'])\nchild.pid")
        assert calls
        monkeypatch.undo()
        with pytest.raises(WorkerError, match="rank 0 was killed by signal SIGKILL"):
            pool.run_cell("import os, signal\nif rank == 0:\n    os.kill(os.getpid(), signal.SIGKILL)\n")
        assert wait_until_gone(list(children), seconds(2)) == [], "a process a pool rank started outlived it"
