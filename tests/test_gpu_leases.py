"""Machine-wide GPU leases (`gpu_leases`): one GPU server, many learners.

On this CPU machine the GPUs are a fake list (DDP_HELPERS_FAKE_GPUS, the module's seam: "these GPU
UUIDs exist"). The holders are other processes (as another learner's kernel would be), a real
`launch` whose rank is started with init=False (so no CUDA call is made: the rank reports the
CUDA_VISIBLE_DEVICES it was given), and a child that switched to another user with os.setuid.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch.distributed
from conftest import REPO, seconds

from ddp_helpers import gpu_leases, launch
from ddp_helpers.gpu_leases import GpusBusy

A, B, C = "GPU-aaaaaaaa-0000", "GPU-bbbbbbbb-1111", "GPU-cccccccc-2222"
OTHER_UID = 65534   # nobody
# backend="nccl" is refused before any lease is taken where torch has no NCCL (the CPU wheels)
needs_nccl_build = pytest.mark.skipif(not torch.distributed.is_nccl_available(),
                                      reason="this torch is built without NCCL (a CPU wheel)")


@pytest.fixture
def shared(monkeypatch):
    """A lease folder in a folder like /tmp, and two fake GPUs; no CUDA_VISIBLE_DEVICES."""
    top = tempfile.mkdtemp(prefix="leases-test-", dir="/tmp")
    os.chmod(top, 0o1777)   # as /tmp: every user may add to it
    where = os.path.join(top, "ddp_helpers-gpu-leases")
    monkeypatch.setenv(gpu_leases.FOLDER_VAR, where)
    monkeypatch.setenv(gpu_leases.FAKE_VAR, f"{A},{B}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(gpu_leases.WAIT_VAR, raising=False)
    yield where
    shutil.rmtree(top, ignore_errors=True)


HOLDER = """
import sys
from ddp_helpers import gpu_leases
lease = gpu_leases.take(int(sys.argv[1]), what="a warm pool")
print("holding", lease.env["CUDA_VISIBLE_DEVICES"], flush=True)
sys.stdin.read()   # until the test closes stdin (or kills us)
"""


class Holder:
    """Another learner's process holding `n` GPUs until `end()` (or SIGKILL)."""

    def __init__(self, n=1, env=None):
        self.p = subprocess.Popen([sys.executable, "-c", HOLDER, str(n)], cwd=REPO, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
        line = self.p.stdout.readline()
        assert line.startswith("holding"), line + self.p.stderr.read()
        self.gpus = line.split()[1]
        self.pid = self.p.pid

    def end(self):
        self.p.stdin.close()
        self.p.wait(timeout=seconds(20))


@needs_nccl_build
def test_a_second_process_is_told_at_once_naming_the_first(shared):
    first = Holder(2)
    try:
        assert first.gpus == f"{A},{B}"
        start = time.monotonic()
        with pytest.raises(GpusBusy) as busy:
            launch(print, 1, backend="nccl", quiet=True)
        assert time.monotonic() - start < seconds(2)   # told at once, before any rank starts
        message = str(busy.value)
        assert (f"2 of 2 GPUs are held: GPU 0 by root (pid {first.pid}, a warm pool), "
                f"GPU 1 by root (pid {first.pid}, a warm pool)") in message
        assert "gpu_wait=" in message and "backend='gloo'" in message
    finally:
        first.end()


def wait_with_the_gpu(ready, go):
    """A rank that holds its launch's GPU lease until `go` exists; says which GPU it was given."""
    import os
    import time
    with open(ready, "w") as f:
        f.write(os.environ["CUDA_VISIBLE_DEVICES"])
    while not os.path.exists(go):
        time.sleep(0.05)
    return os.environ["CUDA_VISIBLE_DEVICES"]


LAUNCHER = f"""
import sys
from ddp_helpers import launch
sys.path.insert(0, {os.path.join(REPO, "tests")!r})
from test_gpu_leases import wait_with_the_gpu
print(launch(wait_with_the_gpu, 1, backend="nccl", init=False, args=tuple(sys.argv[1:]), quiet=True)[0])
"""


@needs_nccl_build
def test_launches_in_two_processes_get_different_gpus_and_auto_falls_back_to_gloo(shared, tmp_path, capsys):
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    other = subprocess.Popen([sys.executable, "-c", LAUNCHER, ready, go], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO})
    try:
        deadline = time.monotonic() + seconds(60)
        while not os.path.exists(ready) and other.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open(ready).read() == A, other.stderr.read() if other.poll() is not None else "no rank"
        mine = tmp_path / "mine"   # this launch's rank is told to go on at once (its go file is its ready file)
        assert launch(wait_with_the_gpu, 1, backend="nccl", init=False, args=(str(mine), str(mine)), quiet=True) == [B]
        with gpu_leases.take(1, what="a test") as lease:     # GPU 1 while the other launch holds GPU 0
            assert lease.env == {"CUDA_VISIBLE_DEVICES": B}
            assert launch(lambda: __import__("torch.distributed").distributed.get_backend(), 1,
                          backend="auto", quiet=True) == ["gloo"]
            assert (f"backend='auto' chose gloo: 2 of 2 GPUs are held: GPU 0 by root (pid {other.pid}, a launch), "
                    f"GPU 1 by you (pid {os.getpid()}, a test)") in capsys.readouterr().out
        open(go, "w").close()
        out, err = other.communicate(timeout=seconds(60))
        assert other.returncode == 0 and out.strip() == A, err
    finally:
        open(go, "w").close()
        if other.poll() is None:
            other.kill()
            other.wait()
    with gpu_leases.take(2, what="a test") as lease:   # both free again: the launch released its GPU
        assert lease.env == {"CUDA_VISIBLE_DEVICES": f"{A},{B}"}
    assert [f for f in os.listdir(shared) if f.endswith(".lease")] == []


def test_a_holder_killed_with_sigkill_releases_its_lease(shared, monkeypatch):
    monkeypatch.setenv(gpu_leases.FAKE_VAR, A)
    holder = Holder(1)
    with pytest.raises(GpusBusy, match=f"GPU 0 by root \\(pid {holder.pid}, a warm pool\\)"):
        gpu_leases.take(1)
    os.kill(holder.pid, signal.SIGKILL)
    holder.p.wait(timeout=seconds(20))
    with gpu_leases.take(1, what="a test") as lease:
        assert lease.indices == [0]
        assert len(os.listdir(shared)) == 1   # the dead holder's file was tidied away
    assert os.listdir(shared) == []


@needs_nccl_build
def test_cuda_visible_devices_restricts_the_choice(shared, monkeypatch):
    monkeypatch.setenv(gpu_leases.FAKE_VAR, f"{A},{B},{C}")
    holder = Holder(1, env={"CUDA_VISIBLE_DEVICES": "2"})   # someone else's JupyterHub gave them GPU 2
    try:
        assert holder.gpus == C
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
        assert gpu_leases.visible_gpus() == [(C, C), (A, A)]
        with pytest.raises(GpusBusy, match=f"1 of 2 GPUs are held: GPU 0 by root \\(pid {holder.pid}"):
            gpu_leases.take(2)
        with gpu_leases.take(1) as lease:
            assert lease.env == {"CUDA_VISIBLE_DEVICES": A} and lease.indices == [1]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc")   # a UUID's prefix, as CUDA takes it
        with pytest.raises(GpusBusy, match="1 of 1 GPUs are held"):
            launch(print, 1, backend="nccl")
        with pytest.raises(ValueError, match="needs one CUDA GPU per rank: world_size=2"):
            launch(print, 2, backend="nccl", env={"CUDA_VISIBLE_DEVICES": "1"})   # env= counts too
    finally:
        holder.end()


def as_other_user(fn, *args):
    """Run fn(*args) in a forked child as OTHER_UID; return (what it returned or raised as text,
    a function that ends the child). The child keeps running (holding what it took) until ended."""
    read, write = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        try:
            os.close(read)
            os.close(done_w)
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            try:
                result = repr(fn(*args))
            except Exception as exc:
                result = f"{type(exc).__name__}: {exc}"
            os.write(write, result.encode()[:60000])
            os.close(write)
            os.read(done_r, 1)   # until the parent says
        finally:
            os._exit(0)
    os.close(write)
    os.close(done_r)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)

    def end():
        os.close(done_w)
        os.waitpid(pid, 0)
    return b"".join(chunks).decode(), pid, end


def test_another_user_sees_the_first_users_lease_and_the_reverse(shared):
    with gpu_leases.take(1, what="a test"):   # root holds GPU 0
        told, pid, end = as_other_user(lambda: gpu_leases.take(2, what="nobody's launch"))
        end()
        assert told.startswith("GpusBusy: 2 GPU(s) needed but 1 free") and \
            f"GPU 0 by root (pid {os.getpid()}, a test)" in told, told
    held, pid, end = as_other_user(lambda: gpu_leases.take(2, what="nobody's pool").env)
    try:
        assert held == repr({"CUDA_VISIBLE_DEVICES": f"{A},{B}"})
        with pytest.raises(GpusBusy, match=f"GPU 0 by nobody \\(pid {pid}, nobody's pool\\), GPU 1 by nobody"):
            gpu_leases.take(1)
    finally:
        end()
    with gpu_leases.take(2):
        pass


def squat(where, key):
    """Another user's tricks: an unlocked lease file, one nobody else may read, a link to one."""
    os.mkdir(where)
    os.chmod(where, 0o1777)   # a lease folder as it should be, but theirs
    for name, mode in ((f"{key}.squat1.lease", 0o644), (f"{key}.squat2.lease", 0o600)):
        fd = os.open(os.path.join(where, name), os.O_CREAT | os.O_WRONLY, mode)
        os.write(fd, b"nobody 1 fake\n")
        os.close(fd)
    os.symlink("/etc/passwd", os.path.join(where, f"{key}.squat3.lease"))
    return sorted(os.listdir(where))


def test_a_squatter_blocks_nobody(shared):
    base = shared
    told, pid, end = as_other_user(lambda: open(base, "w").close() or 1)   # the folder's name, taken by a file
    end()
    assert os.path.isfile(base)
    told, pid, end = as_other_user(lambda: os.mkdir(base + "-2", 0o755))   # a folder only they can write in
    end()
    told, pid, end = as_other_user(squat, base + "-3", A)
    end()
    assert "squat1" in told
    with gpu_leases.take(2, what="a test") as lease:   # neither the file, the folder nor the unlocked leases stop us
        assert lease.env == {"CUDA_VISIBLE_DEVICES": f"{A},{B}"}
        assert gpu_leases.folder() == base + "-3"
        assert "folder owned by nobody" in gpu_leases.report()[0]
    told, pid, end = as_other_user(lambda: gpu_leases.take(1, what="nobody's launch").env)
    end()
    assert told == repr({"CUDA_VISIBLE_DEVICES": A})   # every user comes to the same folder


def test_report_shows_what_this_process_holds_and_who_holds_the_rest(shared, capsys):
    gpu_leases.show()                                  # before any lease: all free, and no folder made
    assert f"GPU 0 ({A}): free" in capsys.readouterr().out and not os.path.exists(shared)
    holder = Holder(1)
    try:
        with gpu_leases.take(1, what="a launch"):
            gpu_leases.show()
            out = capsys.readouterr().out
            assert f"GPU 0 ({A}): taken by root (pid {holder.pid}, a warm pool)" in out, out
            assert f"GPU 1 ({B}): held by this process (a launch)" in out, out
        gpu_leases.show()
        assert f"GPU 1 ({B}): free" in capsys.readouterr().out
    finally:
        holder.end()


def end_after(pid, seconds_):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, time
        time.sleep({seconds_})
        os.kill({pid}, signal.SIGTERM)""")])


@needs_nccl_build
def test_gpu_wait_waits_for_a_gpu_to_be_released(shared, monkeypatch):
    monkeypatch.setenv(gpu_leases.FAKE_VAR, A)
    holder = Holder(1)
    ender = end_after(holder.pid, 1)
    start = time.monotonic()
    assert launch(lambda: os.environ["CUDA_VISIBLE_DEVICES"], 1, backend="nccl", init=False, quiet=True,
                  gpu_wait=seconds(30)) == [A]
    assert time.monotonic() - start >= 0.9
    ender.wait()
    holder.p.wait()
    with pytest.raises(ValueError, match="gpu_wait must be a number of seconds"):
        launch(print, 1, backend="nccl", gpu_wait=-1)


@needs_nccl_build
def test_the_default_wait_comes_from_the_environment(shared, monkeypatch):
    monkeypatch.setenv(gpu_leases.FAKE_VAR, A)
    holder = Holder(1)
    ender = end_after(holder.pid, 1)
    monkeypatch.setenv(gpu_leases.WAIT_VAR, str(seconds(30)))   # as a test suite whose workers share a GPU
    assert launch(lambda: os.environ["CUDA_VISIBLE_DEVICES"], 1, backend="nccl", init=False, quiet=True) == [A]
    ender.wait()
    holder.p.wait()
    monkeypatch.setenv(gpu_leases.WAIT_VAR, "a minute")
    with pytest.raises(ValueError, match="DDP_HELPERS_GPU_WAIT='a minute': give a number of seconds"):
        launch(print, 1, backend="nccl")


@needs_nccl_build
def test_the_bench_command_line_says_who_holds_the_gpus_in_one_line(shared):
    holder = Holder(2)
    try:
        done = subprocess.run([sys.executable, "-m", "ddp_helpers.bench", "-b", "8", "-e", "8", "--nproc", "1",
                               "--backend", "nccl", "--device", "cuda"], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": REPO}, timeout=seconds(60))
        assert done.returncode == 1 and done.stderr.startswith("error: 1 GPU(s) needed but 0 free: 2 of 2 GPUs"), \
            done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    finally:
        holder.end()


@needs_nccl_build
def test_a_warm_pool_is_told_at_once_and_a_pool_that_fails_to_start_lets_go(shared, monkeypatch):
    from ddp_helpers import WorkerError
    from ddp_helpers.pool import Pool
    holder = Holder(1)
    try:
        with pytest.raises(GpusBusy, match=f"2 of 2 GPUs are held: GPU 0 by root \\(pid {holder.pid}, a warm pool\\), "
                                           f"GPU 1 by you \\(pid {os.getpid()}, a test\\)"):
            with gpu_leases.take(1, what="a test"):
                Pool(1, backend="nccl")
        with pytest.raises(WorkerError):   # GPU 1 is free now, but a fake GPU cannot start NCCL: CUDA sees none
            Pool(1, backend="nccl", start_timeout=seconds(60))
    finally:
        holder.end()
    with gpu_leases.take(2) as lease:   # nothing is left holding GPU 1
        assert lease.indices == [0, 1]


RACER = """
import os, sys, time
from ddp_helpers import gpu_leases
open(sys.argv[1] + f".ready{os.getpid()}", "w").close()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.001)
try:
    lease = gpu_leases.take(1, what="a racer")
except gpu_leases.GpusBusy:
    print("busy", flush=True)
else:
    print("got", lease.env["CUDA_VISIBLE_DEVICES"], flush=True)
    time.sleep(float(sys.argv[2]))   # holds it while the others try
"""


def test_many_takers_at_once_never_share_a_gpu(shared, tmp_path, monkeypatch):
    monkeypatch.setenv(gpu_leases.FAKE_VAR, A)   # one GPU, eight takers at the same moment
    go, racers = str(tmp_path / "go"), 8
    procs = [subprocess.Popen([sys.executable, "-c", RACER, go, str(seconds(2))], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO}) for _ in range(racers)]
    try:
        deadline = time.monotonic() + seconds(60)
        while len([f for f in os.listdir(tmp_path) if ".ready" in f]) < racers and time.monotonic() < deadline:
            time.sleep(0.05)
        open(go, "w").close()
        said = [p.communicate(timeout=seconds(60))[0].split() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    got = [words[1] for words in said if words[0] == "got"]
    assert got in ([], [A]), said    # never one GPU twice
    assert len(got) >= 1 and len(got) + sum(w == ["busy"] for w in said) == racers, said


def real_gpus():
    """This machine's GPUs as nvidia-smi lists them, not the fake ones ([] without nvidia-smi)."""
    saved = os.environ.pop(gpu_leases.FAKE_VAR, None)
    try:
        return gpu_leases.physical_gpus()
    finally:
        if saved is not None:
            os.environ[gpu_leases.FAKE_VAR] = saved


@pytest.mark.skipif(not real_gpus() or not torch.distributed.is_nccl_available(),
                    reason="needs a GPU machine (nvidia-smi) and torch with NCCL")
def test_two_kernels_on_the_real_gpus_the_second_is_told_at_once():
    """Two learners' kernels on one GPU machine: the first starts a warm NCCL pool on every GPU, the
    second asks for one GPU and is told at once who holds them, with no CUDA error and no rank started."""
    from jupyter_client import KernelManager
    top = tempfile.mkdtemp(prefix="leases-test-", dir="/tmp")
    os.chmod(top, 0o1777)
    env = {**os.environ, gpu_leases.FOLDER_VAR: os.path.join(top, "leases"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    for name in (gpu_leases.FAKE_VAR, gpu_leases.WAIT_VAR, "CUDA_VISIBLE_DEVICES"):   # conftest waits 600 s
        env.pop(name, None)
    n = len(real_gpus())
    kernels = []

    def run(client, code):
        out = []
        reply = client.execute_interactive(code, timeout=seconds(120),
                                           output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)

    try:
        for _ in range(2):
            km = KernelManager(kernel_name="python3")
            km.start_kernel(cwd=REPO, env=env)
            client = km.client()
            client.start_channels()
            client.wait_for_ready(timeout=seconds(60))
            kernels.append((km, client))
        (first_km, first), (_, second) = kernels
        started = run(first, f"%load_ext ddp_helpers\n%ddp start -n {n} -b nccl\nimport os\nprint('pid', os.getpid())")
        assert f"{n} ranks ready (nccl)" in started, started
        first_pid = started.split("pid ")[-1].split()[0]
        told = run(second, textwrap.dedent("""
            import time
            from ddp_helpers import launch
            from ddp_helpers.gpu_leases import GpusBusy
            start = time.monotonic()
            try:
                launch(print, 1, backend="nccl", quiet=True)
            except GpusBusy as busy:
                print(busy)
            print(f"after {time.monotonic() - start:.3f} s")
        """))
        assert f"{n} of {n} GPUs are held: GPU 0 by " in told and f"(pid {first_pid}, a warm pool)" in told, told
        assert float(told.split("after ")[-1].split()[0]) < seconds(2), told
        status = run(first, "%ddp status")
        assert "GPU 0 (" in status and "held by this process (a warm pool)" in status, status
        assert "stopped" in run(first, "%ddp stop")                         # the pool lets go of its GPUs
        assert "[1]" in run(second, "print(launch(lambda: __import__('torch').cuda.device_count(), 1, "
                                    "backend='nccl', quiet=True))")
    finally:
        for km, client in kernels:
            client.stop_channels()
            km.shutdown_kernel(now=False)
        shutil.rmtree(top, ignore_errors=True)
