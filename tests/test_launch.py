"""Every promise of ddp_helpers.launch, on CPU with Gloo."""
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import types

import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import REPO, needs_2_gpus, seconds

from ddp_helpers import WorkerError, WorkerTimeout, launch
from ddp_helpers import launcher as launch_module
from ddp_helpers.runtime import run_dirs as run_dirs_module
from ddp_helpers.runtime import store_host


# ---- worker functions (module level: cloudpickle sends them by reference) ----
def rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def torchrun_env():
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MY_FLAG"]
    return {k: os.environ.get(k) for k in keys}


def chatty(lines, width):
    rank = dist.get_rank()
    for i in range(lines):
        print(f"r{rank} line {i:04d} " + "x" * width)
    print(f"r{rank} to stderr", file=__import__("sys").stderr)


def fail_on_rank_1_while_rank_0_waits():
    if dist.get_rank() == 1:
        raise ValueError("bad value on purpose")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: only teardown ends this


def die_by_signal(signum):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signum)
    dist.barrier()


def exit_with_code():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def sleep_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(600)
    return "done"


def write_pid_then(path, then):
    with open(os.path.join(path, f"pid{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    if then == "sleep":
        time.sleep(600)


def init_myself(method, port_file=None):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if method == "env":
        dist.init_process_group("gloo")
    elif method == "tcp":
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", init_method=f"file://{port_file}", rank=rank, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def pid_alive(pid):
    from ddp_helpers.runtime.processes import alive
    return alive(pid)


def listening_ports():
    """Ports on which something listens (IPv4 and IPv6), here and in the ranks' own network: the
    fork server every rank comes from lives in it (private_net), so its /proc/PID/net shows it."""
    import multiprocessing.forkserver
    ports = set()
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    for where in ["self"] + ([str(server)] if server else []):
        for table in (f"/proc/{where}/net/tcp", f"/proc/{where}/net/tcp6"):
            with open(table) as f:
                for row in f.readlines()[1:]:
                    cols = row.split()
                    if cols[3] == "0A":  # LISTEN
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def launch_children():
    """This process's multiprocessing children, but the rendezvous stores' process, which lives as long
    as this process does, as the fork server does (each launch's store in it is closed: the ports
    checks above see that)."""
    return [p for p in multiprocessing.active_children() if p.name != "ddp-helpers-store"]


def run_dirs():
    root = os.path.join(__import__("tempfile").gettempdir(), f"ddp_helpers-{os.getuid()}")
    return set(os.listdir(root)) if os.path.isdir(root) else set()


# ---- results ----
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_by_rank(world_size):
    results = launch(rank_sum, world_size=world_size)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, total) for r in range(world_size)]


def test_args_and_kwargs_reach_every_rank():
    assert launch(lambda a, b=0: a * 10 + b + dist.get_rank(), 2, args=(4,), kwargs={"b": 2}) == [42, 43]


def test_notebook_function_with_globals_travels_by_value():
    # A function defined in __main__ (as in a notebook cell) is not importable by the
    # workers: cloudpickle must send it, and the globals it uses, by value.
    namespace = {"__name__": "__main__"}
    exec("import torch.distributed as dist\nOFFSET = 100\n"
         "def cell_fn():\n    return OFFSET + dist.get_rank()\n", namespace)
    assert launch(namespace["cell_fn"], 2) == [100, 101]


def test_tensors_come_back_on_the_cpu():
    out = launch(lambda: {"t": torch.arange(3) * (dist.get_rank() + 1)}, 2)
    assert torch.equal(out[1]["t"], torch.tensor([0, 2, 4]))


def test_workers_get_torchrun_environment():
    envs = launch(torchrun_env, 3, env={"MY_FLAG": "on"})
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MY_FLAG"] == "on"
    ports = {env["MASTER_PORT"] for env in envs}
    assert len(ports) == 1 and ports != {"29500"}


def test_each_launch_gets_its_own_port():
    ports = {launch(torchrun_env, 1)[0]["MASTER_PORT"] for _ in range(3)}
    assert len(ports) == 3


@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_init_false_lets_the_function_rendezvous_itself(method, tmp_path):
    assert launch(init_myself, 2, init=False, args=(method, str(tmp_path / "rdzv"))) == [2.0, 2.0]


# ---- output ----
def test_output_is_prefixed_whole_lines_in_order(capfd):
    launch(chatty, 3, args=(200, 300))
    out, err = capfd.readouterr()
    for rank in range(3):
        mine = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert len(mine) == 200
        numbers = [int(re.match(rf"\[rank {rank}\] r{rank} line (\d+) x+$", line).group(1)) for line in mine]
        assert numbers == list(range(200))  # whole lines (regex matched to the end), in order
    assert all(line.startswith("[rank ") for line in out.splitlines())
    for rank in range(3):
        assert f"[rank {rank}] r{rank} to stderr" in err.splitlines()


def test_quiet_keeps_output_out_of_the_cell_but_in_the_log(capfd):
    with pytest.raises(WorkerError) as info:
        launch(lambda: (print("kept in the log"), 1 / 0), 1, quiet=True)
    out, _ = capfd.readouterr()
    assert "kept in the log" not in out
    with open(os.path.join(info.value.log_dir, "rank0.log")) as f:
        assert "kept in the log" in f.read()


# ---- errors ----
def test_exception_names_rank_type_message_and_remote_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(fail_on_rank_1_while_rank_0_waits, 2, timeout=60)
    took = time.monotonic() - start
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError" and err.exc_message == "bad value on purpose"
    assert "fail_on_rank_1_while_rank_0_waits" in err.remote_traceback
    assert 'raise ValueError("bad value on purpose")' in err.remote_traceback  # source line shown
    assert "rank 1 raised ValueError: bad value on purpose" in str(err)
    assert took < seconds(5), f"rank 0, stuck in all_reduce, should be torn down at once (took {took:.1f} s)"


def test_notebook_cell_source_appears_in_remote_traceback():
    import linecache
    fake_cell = "/nonexistent/ipykernel_0/cell42.py"
    source = "def cell_fn():\n    x = 1\n    raise KeyError('from a cell')\n"
    linecache.cache[fake_cell] = (len(source), None, source.splitlines(True), fake_cell)
    namespace = {"__name__": "__main__"}
    exec(compile(source, fake_cell, "exec"), namespace)
    try:
        with pytest.raises(WorkerError) as info:
            launch(namespace["cell_fn"], 1)
    finally:
        del linecache.cache[fake_cell]
    assert "raise KeyError('from a cell')" in info.value.remote_traceback


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGKILL])
def test_rank_killed_by_signal_is_reported(signum):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(die_by_signal, 2, args=(signum,), timeout=60)
    assert info.value.rank == 1
    assert f"killed by signal {signum.name}" in str(info.value)
    assert time.monotonic() - start < seconds(5)


class _RanksWhoseExitStatusIsLate:
    """What the launcher sees under the forkserver start method when rank 0 has failed and
    rank 1 has already ended: rank 1's process is gone, but its exit status comes from the fork
    server a moment later (seen on an H200 box: a SIGKILLed rank 1 looked alive, rank 0 was blamed)."""

    def __init__(self, run_dir, rank1_exitcode):
        self.run_dir, self.world_size = str(run_dir), 2
        self.processes = [types.SimpleNamespace(exitcode=1), types.SimpleNamespace(exitcode=None)]
        self._late = rank1_exitcode

    def wait_for_exits(self, deadline, **_):
        return "failed", [0]

    def gone(self):
        return [1]

    def stop(self):   # joins every rank: now rank 1's status is in
        self.processes[1].exitcode = self._late


def _raised(run_dir, rank, exc_type, message):
    with open(run_dirs_module.rank_file(str(run_dir), rank, "error"), "wb") as f:
        pickle.dump({"type": exc_type, "message": message, "traceback": "Traceback ...\n"}, f)


def _rank_0_raised(run_dir):
    _raised(run_dir, 0, "DistBackendError", "[pair.cc:547] Connection reset by peer [127.0.0.1]:18845")


def test_a_rank_with_an_error_of_its_own_is_blamed_before_a_rank_that_lost_its_peer(tmp_path):
    # seen on an H200 box: rank 1 raised ValueError, rank 0 in all_reduce then "Connection closed
    # by peer", and both statuses were in when the launcher looked: rank 0 was blamed
    _raised(tmp_path, 0, "RuntimeError", "[pair.cc:547] Connection closed by peer [127.0.0.1]:18845")
    _raised(tmp_path, 1, "ValueError", "bad value on purpose")
    both = [types.SimpleNamespace(exitcode=1), types.SimpleNamespace(exitcode=1)]
    err = launch_module._failure_error(str(tmp_path), both, [0, 1])
    assert err.rank == 1 and err.exc_type == "ValueError", str(err)
    assert err.failures[0].startswith("raised RuntimeError")


def test_gone_names_ended_ranks_whose_exit_status_has_not_arrived():
    from ddp_helpers.runtime.supervisor import Supervisor
    ended, alive = subprocess.Popen(["true"]), subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + seconds(10)
        while psutil.Process(ended.pid).status() != psutil.STATUS_ZOMBIE:   # ended, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ranks = types.SimpleNamespace(processes=[
            types.SimpleNamespace(pid=alive.pid, exitcode=None),
            types.SimpleNamespace(pid=ended.pid, exitcode=None),    # its status not in yet
            types.SimpleNamespace(pid=ended.pid, exitcode=0)])      # its status in: not "gone"
        assert Supervisor.gone(ranks) == [1]
    finally:
        alive.kill()
        alive.wait()
        ended.wait()


def test_a_rank_killed_before_its_exit_status_arrived_is_blamed(tmp_path):
    _rank_0_raised(tmp_path)
    with pytest.raises(WorkerError) as info:
        launch_module._outcome(_RanksWhoseExitStatusIsLate(tmp_path, -signal.SIGKILL), 60, True)
    assert info.value.rank == 1, str(info.value)
    assert "killed by signal SIGKILL" in str(info.value)


def test_a_rank_that_finished_before_its_exit_status_arrived_is_not_blamed(tmp_path):
    _rank_0_raised(tmp_path)
    with open(run_dirs_module.rank_file(str(tmp_path), 1, "result"), "wb") as f:
        pickle.dump("rank 1's value", f)
    with pytest.raises(WorkerError) as info:
        launch_module._outcome(_RanksWhoseExitStatusIsLate(tmp_path, 0), 60, True)
    assert info.value.rank == 0, str(info.value)
    assert "Connection reset by peer" in str(info.value)


def test_exit_code_without_exception_is_reported():
    with pytest.raises(WorkerError, match="rank 0 exited with code 3"):
        launch(exit_with_code, 2, timeout=60)


def test_exit_code_zero_without_a_value_is_reported():
    def quit_quietly():
        if dist.get_rank() == 1:
            os._exit(0)
        return "rank 0 done"
    with pytest.raises(WorkerError, match="rank 1 exited with code 0 before returning a value"):
        launch(quit_quietly, 2, timeout=30)


def test_timeout_names_the_stuck_ranks_and_shows_their_stack(capfd):
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        launch(sleep_on_rank_1, 2, timeout=3)
    assert info.value.unfinished_ranks == [1]
    assert "rank(s) [1] had not finished" in str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - start < 3 + seconds(5)
    _, err = capfd.readouterr()
    assert re.search(r"\[rank 1\] .*sleep_on_rank_1", err), "faulthandler stack of the stuck rank"


def test_rank_stuck_in_collective_times_out():
    def only_rank_0_reduces():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        else:
            time.sleep(600)
    with pytest.raises(WorkerTimeout) as info:
        launch(only_rank_0_reduces, 2, timeout=2)
    assert info.value.unfinished_ranks == [0, 1]


# ---- bad input: a clear error, and no process started ----
@pytest.mark.parametrize("kwargs, error, text", [
    (dict(world_size=0), ValueError, "world_size must be between 1 and"),
    (dict(world_size=-2), ValueError, "world_size must be between 1 and"),
    (dict(world_size=2.0), TypeError, "world_size must be an int"),
    (dict(world_size="2"), TypeError, "world_size must be an int"),
    (dict(world_size=True), TypeError, "world_size must be an int"),
    (dict(world_size=1000), ValueError, "world_size must be between 1 and"),
    (dict(backend="mpich"), ValueError, "unknown backend 'mpich'"),
    (dict(timeout=0), ValueError, "timeout must be a positive number"),
    (dict(timeout="10"), ValueError, "timeout must be a positive number"),
    (dict(timeout=-1), ValueError, "timeout must be a positive number"),
    (dict(timeout=float("nan")), ValueError, "timeout must be a positive number"),
    (dict(timeout=float("inf")), ValueError, "timeout must be a positive number"),
    (dict(timeout=1e14), ValueError, "timeout must be a positive number"),
    (dict(kwargs={1: 2}), TypeError, "kwargs keys must be strings"),
    (dict(args=(threading.Lock(),)), TypeError, "cannot send args to the workers"),
    (dict(kwargs={"g": (i for i in range(3))}), TypeError, "cannot send kwargs to the workers"),
    (dict(args=5), TypeError, "args must be a tuple"),
    (dict(env={"X": 1}), TypeError, "env keys and values must be strings"),
])
def test_bad_input_is_rejected_before_any_process_starts(kwargs, error, text):
    before_dirs, before_children = run_dirs(), multiprocessing.active_children()
    with pytest.raises(error, match=re.escape(text)):
        launch(**{"fn": rank_sum, **kwargs})
    assert run_dirs() == before_dirs
    assert multiprocessing.active_children() == before_children


def test_unpicklable_function_is_rejected_before_any_process_starts():
    lock = threading.Lock()
    before = run_dirs()
    with pytest.raises(TypeError, match="cannot send the function to the workers"):
        launch(lambda: lock.locked(), 2)
    with pytest.raises(TypeError, match="fn must be callable"):
        launch("rank_sum", 2)
    assert run_dirs() == before


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_nccl_without_enough_gpus_is_rejected():
    with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank"):
        launch(rank_sum, 2, backend="nccl")


def test_auto_backend_picks_gloo_without_gpus():
    expected = "nccl" if torch.cuda.device_count() >= 2 and dist.is_nccl_available() else "gloo"
    assert launch_module.resolve_backend("auto", 2) == expected


# ---- nothing left behind ----
def test_store_listens_on_loopback_only():
    listeners = {}
    with store_host.Rendezvous() as rdzv:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for row in f.readlines()[1:]:
                    cols = row.split()
                    local_ip, local_port = cols[1].rsplit(":", 1)
                    if cols[3] == "0A" and int(local_port, 16) == rdzv.port:
                        listeners[table] = local_ip
    assert listeners == {"/proc/net/tcp": "0100007F"}  # 127.0.0.1 only, no IPv6 "::" listener
    assert rdzv.port not in listening_ports()  # and closed afterwards


def test_failed_launch_leaves_no_worker(tmp_path):
    with pytest.raises(WorkerTimeout):
        launch(write_pid_then, 2, args=(str(tmp_path), "sleep"), timeout=2)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not any(pid_alive(p) for p in pids)


def interrupt_when_started(folder, ranks):
    """Send SIGINT to this process, as Jupyter's Interrupt does, once every rank has written its PID."""
    def wait_then_interrupt():
        deadline = time.monotonic() + seconds(30)
        while len(list(folder.glob("pid*"))) < ranks and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=wait_then_interrupt, daemon=True).start()


def test_keyboard_interrupt_in_the_launcher_stops_every_worker(tmp_path):
    interrupt_when_started(tmp_path, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        launch(write_pid_then, 2, args=(str(tmp_path), "sleep"), timeout=seconds(60))
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not any(pid_alive(p) for p in pids)
    assert launch_children() == []
    # IPython shows one line for it, not the launcher's frames (issue 16)
    assert info.value._render_traceback_() == [
        "KeyboardInterrupt: interrupted; the ranks were stopped (nothing is left running)."]


# ---- GPUs (run on a machine with at least 2; skipped elsewhere) ----
def nccl_sum():
    t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item(), torch.cuda.current_device(), dist.get_backend()


@needs_2_gpus
def test_nccl_on_gpus_one_device_per_rank_without_cuda_in_the_launcher():
    assert launch(nccl_sum, 2, backend="nccl") == [(3.0, 0, "nccl"), (3.0, 1, "nccl")]
    assert launch(nccl_sum, 2, backend="auto")[1] == (3.0, 1, "nccl")
    assert not torch.cuda.is_initialized(), "the launcher must not initialise CUDA in the kernel"


def mismatched_collectives():
    t = torch.ones(2)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=1)


def test_env_read_by_torch_at_import_still_applies_in_workers():
    # torch is imported once in the forkserver, before a launch's env exists: the worker
    # must re-apply TORCH_DISTRIBUTED_DEBUG, or DETAIL would silently do nothing.
    with pytest.raises(WorkerError, match="Detected mismatch between collectives"):
        launch(mismatched_collectives, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=30, quiet=True)
    assert launch(lambda: torch.get_num_threads(), 2, env={"OMP_NUM_THREADS": "1"}) == [1, 1]


def test_launches_back_to_back_never_fail_to_connect_and_leave_no_port_or_process():
    # Gloo connects every pair of ranks inside init_process_group; a rank with nothing to do used to
    # finish and exit while its peer was still connecting ("connectFullMesh failed ... Connection
    # closed by peer"): 7 launches in 300 here. The worker now waits for every rank after init.
    # With that rate, these 25 launches would have failed at least once 4 times in 10 (100, the soak's
    # `python benchmarks/launch_soak.py --launches 100`, 9 times in 10).
    # The same launches, back to back, must leave no rendezvous port open and no process behind.
    results = [launch(lambda: (1, int(os.environ["MASTER_PORT"])), 2, quiet=True) for _ in range(25)]
    assert [[one for one, _ in ranks] for ranks in results] == [[1, 1]] * 25
    ports = {port for ranks in results for _, port in ranks}
    assert not (ports & listening_ports()), "a rendezvous port is still open"
    assert launch_children() == []
    assert len(ports) > 1


# ---- run folders: never another process's live run, never a folder others can write to ----
HOLD_A_RUN_DIR = """
import sys, tempfile
from ddp_helpers.runtime import run_dirs
print(run_dirs.new_run_dir(), flush=True)
sys.stdin.read()   # keeps the folder's run live until the test closes our stdin
"""

PRUNE_IN_A_LOOP = """
import os, sys, time
from ddp_helpers.runtime import run_dirs
open(sys.argv[1] + f".ready{os.getpid()}", "w").close()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.001)
for _ in range(1000):
    folder = run_dirs.new_run_dir()
    run_dirs.release_run_dir(folder)
"""


def private_root(tmp_path):
    return os.path.join(str(tmp_path), f"ddp_helpers-{os.getuid()}")


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch):
    """launch's scratch root under tmp_path, for this process and the processes it starts."""
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def test_run_folder_of_a_live_other_process_survives_later_launches(own_tempdir):
    other = subprocess.Popen([sys.executable, "-c", HOLD_A_RUN_DIR], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        theirs = other.stdout.readline().strip()
        assert os.path.isdir(theirs)
        for _ in range(run_dirs_module.KEPT_RUN_DIRS + 5):
            assert launch(lambda: 1, 1, quiet=True) == [1]
        assert os.path.isdir(theirs), "a live run of another process was deleted"
    finally:
        other.stdin.close()
        other.wait(timeout=seconds(20))
    launch(lambda: 1, 1, quiet=True)
    assert not os.path.exists(theirs), "the folder of a process that is gone is pruned like any old run"


def test_a_pools_folder_survives_later_launches(own_tempdir):
    from ddp_helpers.pool import Pool
    with Pool(world_size=1) as pool:
        for _ in range(run_dirs_module.KEPT_RUN_DIRS + 5):
            launch(lambda: 1, 1, quiet=True)
        assert os.path.isdir(pool.run_dir)
        assert list(pool.run_cell("rank + 1")) == [1]


def test_two_processes_pruning_at_once_do_not_crash(own_tempdir):
    go = own_tempdir / "go"
    # folders of a process that is gone: both processes prune them at once
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.makedirs(private_root(own_tempdir), mode=0o700)
    for i in range(40):
        os.mkdir(os.path.join(private_root(own_tempdir), f"run-000000-{dead.pid}-{i}-orphan"))
    procs = [subprocess.Popen([sys.executable, "-c", PRUNE_IN_A_LOOP, str(go)], stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    deadline = time.monotonic() + seconds(40)
    while len(list(own_tempdir.glob("go.ready*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)   # both have imported torch: they start together
    go.write_text("")
    errors = [p.communicate(timeout=seconds(100))[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(errors)


def test_a_world_writable_scratch_root_is_not_used(own_tempdir):
    planted = private_root(own_tempdir)
    os.mkdir(planted)
    os.chmod(planted, 0o777)  # as if another user had made it first
    with pytest.warns(UserWarning, match="other users can write to it"):
        assert launch(lambda: 1, 2, quiet=True) == [1, 1]
    with pytest.raises(WorkerError) as info:
        launch(lambda: 1 / 0, 1, quiet=True)
    assert os.listdir(planted) == [], "nothing may be written to (or read from) a folder others can change"
    root = os.path.dirname(info.value.log_dir)
    assert not root.startswith(planted + os.sep)
    assert os.stat(root).st_uid == os.getuid() and os.stat(root).st_mode & 0o777 == 0o700


def test_a_scratch_root_of_another_user_is_not_used(own_tempdir, monkeypatch):
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    planted = private_root(own_tempdir)   # named for "our" uid, but owned by real_uid: someone else
    os.mkdir(planted, 0o700)
    with pytest.warns(UserWarning, match=f"it belongs to user id {real_uid}"):
        folder = run_dirs_module.new_run_dir()
    run_dirs_module.release_run_dir(folder)
    assert not folder.startswith(planted + os.sep)
    assert os.listdir(planted) == []


@pytest.mark.parametrize("target", ["missing", "a folder"])
def test_a_symlink_at_the_scratch_root_is_not_followed(own_tempdir, target):
    where = own_tempdir / "elsewhere"
    if target == "a folder":
        where.mkdir(mode=0o700)
    os.symlink(where, private_root(own_tempdir))
    with pytest.warns(UserWarning, match="it is a symbolic link"):
        assert launch(lambda: 1, 2, quiet=True) == [1, 1]
    assert os.path.islink(private_root(own_tempdir))
    assert (not where.exists()) if target == "missing" else list(where.iterdir()) == []


def test_the_scratch_root_is_private(own_tempdir):
    assert launch(lambda: 1, 1, quiet=True) == [1]
    assert os.stat(private_root(own_tempdir)).st_mode & 0o777 == 0o700


def test_an_own_scratch_root_readable_by_others_is_made_private(own_tempdir):
    os.mkdir(private_root(own_tempdir))
    os.chmod(private_root(own_tempdir), 0o755)   # as older versions made it
    with pytest.raises(WorkerError) as info:
        launch(lambda: 1 / 0, 1, quiet=True)
    assert os.path.dirname(info.value.log_dir) == private_root(own_tempdir)
    assert os.stat(private_root(own_tempdir)).st_mode & 0o777 == 0o700


# ---- issue 16: each defect the adversarial probe found ----
class Recorder:
    """Stands in for sys.stdout: keeps each write, and when it came."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append((time.monotonic(), text))
        return len(text)

    def flush(self):
        pass

    def text(self):
        return "".join(text for _, text in self.writes)


def print_lines(n):
    for i in range(n):
        print(f"line {i}")


def test_a_flood_of_lines_arrives_in_few_writes_each_line_prefixed(monkeypatch):
    # 200,000 lines took 34.9 s in a kernel, one message each; plain print, 4 messages
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    launch(print_lines, 1, args=(20000,))
    assert out.text().splitlines() == [f"[rank 0] line {i}" for i in range(20000)]
    assert len(out.writes) < 20000 / 10, f"{len(out.writes)} writes for 20000 lines"


def progress_bar(pause_s):
    for percent in (25, 50, 75):
        sys.stdout.write(f"\r{percent}%")
        sys.stdout.flush()
        time.sleep(pause_s if percent == 25 else 0.05)
    sys.stdout.write("\r100%\n")


def test_a_carriage_return_progress_bar_updates_live_with_the_prefix_after_the_return(monkeypatch):
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    pause = seconds(1)
    launch(progress_bar, 1, args=(pause,))
    text = out.text()
    assert text.endswith("\r[rank 0] 100%\n") and "] \r" not in text
    assert all(piece.startswith("[rank 0] ") for piece in text.split("\r") if piece)
    shown_25 = min(t for t, w in out.writes if "25%" in w)
    shown_100 = min(t for t, w in out.writes if "100%" in w)
    assert shown_100 - shown_25 > pause / 2, "25% was shown only at the end, not while the rank paused"


@pytest.mark.parametrize("value", ["", "0", "-1", "two"])
def test_a_bad_omp_num_threads_is_named_before_anything_starts(value, monkeypatch):
    before = run_dirs()
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS={value!r}"):
        launch(lambda: 1, 2, env={"OMP_NUM_THREADS": value})
    monkeypatch.setenv("OMP_NUM_THREADS", value)   # the notebook's own environment, likewise
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS={value!r}"):
        launch(lambda: 1, 2)
    assert run_dirs() == before


def test_a_nested_omp_num_threads_uses_its_first_level():
    assert launch(lambda: torch.get_num_threads(), 2, env={"OMP_NUM_THREADS": "1,2"}) == [1, 1]


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("str() of this exception fails")


def raise_unprintable():
    raise Unprintable()


def test_errors_in_worker_setup_and_unprintable_exceptions_are_shown_leaving_no_error_file(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp_path))
    # torch rejects the value in the worker's setup, before the function runs
    with pytest.raises(WorkerError, match=r"rank \d raised ValueError: The value of TORCH_DISTRIBUTED_DEBUG") as info:
        launch(lambda: 1, 2, env={"TORCH_DISTRIBUTED_DEBUG": "bogus"}, quiet=True)
    assert "set_debug_level_from_env" in info.value.remote_traceback
    with pytest.raises(WorkerError, match=r"rank \d raised Unprintable") as info:
        launch(raise_unprintable, 2, quiet=True)
    assert "raise Unprintable()" in info.value.remote_traceback
    assert not list(tmp_path.rglob("pytorch-errorfile-*")), "torch's error files are left behind"


def test_launch_from_a_script_read_on_standard_input():
    script = ("import torch.distributed as dist\nfrom ddp_helpers import launch\n"
              "def rank_plus(k):\n    return dist.get_rank() + k\n"
              "print('result', launch(rank_plus, 2, args=(10,)))\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=REPO,
                          timeout=seconds(60))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result [10, 11]" in done.stdout


def return_early_on_rank_1():
    if int(os.environ["RANK"]) == 1:
        return "never joined"
    dist.init_process_group("gloo")
    dist.destroy_process_group()


def test_a_rank_that_returns_before_init_is_named_at_once():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(return_early_on_rank_1, 2, init=False, timeout=seconds(60), quiet=True)
    assert not isinstance(info.value, WorkerTimeout)
    assert info.value.rank == 1
    assert "rank 1 returned without joining the process group" in str(info.value)
    assert time.monotonic() - start < seconds(60) / 2


def init_alone_with_a_short_timeout():
    if int(os.environ["RANK"]) == 1:
        return "skipped"
    from datetime import timedelta
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    except Exception as err:
        return type(err).__name__


def test_a_rank_waiting_alone_may_still_time_out_by_itself():
    # notebook 01 shows this: rank 0's own short init timeout ends its wait, before launch steps in
    outcome = launch(init_alone_with_a_short_timeout, 2, init=False, quiet=True)
    assert outcome[1] == "skipped" and outcome[0].endswith("Error"), outcome   # DistStoreError in torch 2.14


def exit_during_all_reduce(code):
    if dist.get_rank() == 1:
        time.sleep(0.5)   # the others are waiting in all_reduce by now
        os._exit(code)
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("code", [0, 5])
def test_a_rank_that_exits_during_a_collective_is_the_one_blamed(code):
    for _ in range(3):
        with pytest.raises(WorkerError) as info:
            launch(exit_during_all_reduce, 3, args=(code,), timeout=seconds(60), quiet=True)
        assert info.value.rank == 1, str(info.value)
        assert str(info.value).startswith(f"rank 1 exited with code {code}")


def start_a_grandchild(folder, then):
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(folder, f"child{os.environ['RANK']}"), "w") as f:
        f.write(str(child.pid))
    if then == "hang":
        time.sleep(600)
    elif then in ("os._exit", "SIGKILL"):   # the rank cannot end its child itself
        time.sleep(seconds(1))             # (the launcher looks at what the ranks started twice a second)
        if then == "os._exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("then", ["return", "hang", "os._exit", "SIGKILL"])
def test_processes_a_rank_started_end_with_the_launch(tmp_path, then):
    try:
        launch(start_a_grandchild, 2, args=(str(tmp_path), then), timeout=seconds(3), quiet=True)
    except WorkerTimeout:
        assert then == "hang"
    except WorkerError as err:
        assert then in ("os._exit", "SIGKILL"), str(err)
    else:
        assert then == "return"
    children = [int((tmp_path / f"child{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + seconds(2)
    while any(map(pid_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(pid_alive, children)), "a rank's child outlived the launch"


def cells_in_linecache():
    import linecache
    return sorted(name for name in linecache.cache if "ipykernel_" in name)


def test_only_the_cell_sources_a_traceback_needs_are_sent():
    import linecache
    used, unused = "/nonexistent/ipykernel_0/used.py", "/nonexistent/ipykernel_0/unused.py"
    source = "def cell_fn(inner):\n    return inner()\n"
    linecache.cache[used] = (len(source), None, source.splitlines(True), used)
    linecache.cache[unused] = (10**6, None, ["x = 1\n"] * 10**5, unused)
    namespace = {"__name__": "__main__"}
    exec(compile(source, used, "exec"), namespace)
    try:
        assert launch(namespace["cell_fn"], 1, args=(cells_in_linecache,)) == [[used]]
    finally:
        del linecache.cache[used], linecache.cache[unused]


# ---- the fork server: started at import in a Jupyter kernel, what its ranks inherit ----
FORK_SERVERS = '''
import json, os, sys, types, psutil
if os.environ.get("FAKE_KERNEL"):
    sys.modules["ipykernel"] = types.ModuleType("ipykernel")   # what a Jupyter kernel has imported
import ddp_helpers

def servers():
    from ddp_helpers.runtime import store_host   # the stores' process is a fork of the server: not a server
    host = store_host._Host.process.pid if store_host._Host.process is not None else None
    family = psutil.Process().children(recursive=True)
    return [p.pid for p in family
            if "multiprocessing.forkserver import main" in " ".join(p.cmdline()) and p.pid != host]

def rank_state():
    import gc, signal
    return gc.isenabled(), gc.get_freeze_count() > 0, signal.getsignal(signal.SIGINT) is signal.default_int_handler

if __name__ == "__main__":
    at_import = servers()
    ranks = ddp_helpers.launch(rank_state, 2) if os.environ.get("THEN_LAUNCH") else None
    print(json.dumps({"at_import": len(at_import), "after": len(servers()), "ranks": ranks,
                      "same": at_import == servers()}))
'''


def fork_servers(tmp_path, kernel, early=None, then_launch=False):
    script = tmp_path / "fork_servers.py"
    script.write_text(FORK_SERVERS)
    env = {k: v for k, v in os.environ.items() if k != "DDP_HELPERS_EARLY_FORKSERVER"}
    env.update({"FAKE_KERNEL": "1"} if kernel else {}, **({"THEN_LAUNCH": "1"} if then_launch else {}))
    if early is not None:
        env["DDP_HELPERS_EARLY_FORKSERVER"] = early
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=seconds(60))
    assert done.returncode == 0, done.stderr[-3000:]
    return __import__("json").loads(done.stdout.strip().splitlines()[-1])


def test_importing_ddp_helpers_in_a_jupyter_kernel_starts_the_fork_server(tmp_path):
    assert fork_servers(tmp_path, kernel=True)["at_import"] == 1      # imports torch while the kernel does
    assert fork_servers(tmp_path, kernel=False)["at_import"] == 0     # a script: at its first launch
    assert fork_servers(tmp_path, kernel=True, early="0")["at_import"] == 0
    assert fork_servers(tmp_path, kernel=False, early="1")["at_import"] == 1


def test_the_launch_uses_the_fork_server_import_started_and_its_ranks_collect_garbage(tmp_path):
    # DDP_HELPERS_EARLY_FORKSERVER=1 reaches the server too, which imports ddp_helpers: it must not
    # start a server of its own. Its ranks: garbage collection and Ctrl-C on again (the server turned
    # both off while it imported), and torch's objects frozen (their collections skip them).
    out = fork_servers(tmp_path, kernel=False, early="1", then_launch=True)
    assert (out["at_import"], out["after"], out["same"]) == (1, 1, True)
    assert out["ranks"] == [[True, True, True]] * 2


def _start_method():
    import multiprocessing
    return multiprocessing.get_start_method()


def test_a_rank_starts_its_own_processes_as_a_torchrun_worker_would():
    """A rank comes from the forkserver, and multiprocessing hands a child the start method it was
    started with: a DataLoader's workers in the rank then started through a new forkserver, which
    imports torch anew (about 19 s before the first batch of notebook 06's GPU run on an H200 host
    without .pyc files). A rank gets the platform's default, as a worker torchrun starts does."""
    default = subprocess.run([sys.executable, "-c",
                              "import multiprocessing; print(multiprocessing.get_start_method())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert launch(_start_method, 2) == [default, default]


# ---- mp.spawn-style functions: fn(rank, world_size) ----
def demo_rank_world_size(rank, world_size):   # the tutorials' shape (ddp_tutorial.rst, dist_tuto.rst)
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return rank, world_size, dist.get_rank(), t.item()


def spawn_forms_its_own_group(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)   # env:// from launch
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_spawn_calls_fn_with_the_rank_first_as_mp_spawn_does():
    from ddp_helpers import spawn
    assert spawn(demo_rank_world_size, args=(3,), nprocs=3) == [(r, 3, r, 6.0) for r in range(3)]


def test_spawn_with_init_false_lets_fn_form_its_own_group():
    from ddp_helpers import spawn
    assert spawn(spawn_forms_its_own_group, args=(2,), nprocs=2, init=False) == [2.0, 2.0]


def test_spawn_takes_mp_spawns_signature_and_refuses_what_it_cannot_do():
    import inspect

    from ddp_helpers import spawn
    assert list(inspect.signature(spawn).parameters)[:6] == [
        "fn", "args", "nprocs", "join", "daemon", "start_method"]
    with pytest.raises(ValueError, match="join=False"):
        spawn(demo_rank_world_size, args=(2,), nprocs=2, join=False)
    with pytest.raises(TypeError, match="args must be a tuple"):
        spawn(demo_rank_world_size, args=2, nprocs=2)


def test_a_tutorial_function_launched_without_its_arguments_says_how_to_pass_them():
    with pytest.raises(WorkerError) as caught:
        launch(demo_rank_world_size, 2)
    message = str(caught.value)
    assert "missing 2 required positional arguments" in message
    hint = [line for line in message.splitlines() if "ddp_helpers.spawn(" in line]
    assert hint == [hint[0]] and len(hint[0]) <= 100, message
    assert "spawn(demo_rank_world_size, args=(2,), nprocs=2)" in hint[0] or \
        "spawn(fn, args=(2,), nprocs=2)" in hint[0]
    assert "launch(..., args=" in hint[0]


def test_a_type_error_from_inside_fn_gets_no_hint():
    def inner(a, b):
        return a + b

    def calls_inner_wrongly():
        return inner(1)

    with pytest.raises(WorkerError) as caught:
        launch(calls_inner_wrongly, 2)
    assert "missing 1 required positional argument" in str(caught.value)
    assert "ddp_helpers.spawn(" not in str(caught.value)


def test_spawn_without_the_arguments_after_rank_says_so():
    from ddp_helpers import spawn
    with pytest.raises(WorkerError) as caught:
        spawn(demo_rank_world_size, nprocs=2)
    first, hint = str(caught.value).splitlines()[:2]
    assert "missing 1 required positional argument: 'world_size'" in first
    assert hint == "spawn calls demo_rank_world_size(rank, *args): give the arguments after rank in args=(...)"
