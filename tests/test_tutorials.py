"""Code written the way PyTorch's tutorials write it runs as written: `mp.spawn` and `mp.Process` from a
notebook cell, a rank's own `init_process_group` with its own MASTER_PORT, a script without the
`if __name__ == "__main__":` guard. (The tutorial-style code below is written for these tests.)"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, seconds
from test_kernel import run_notebook, text_of

from ddp_helpers import WorkerError, WorkerTimeout, launch


def tutorial_setup(rank, world_size):
    """As the DDP tutorial's setup(): a fixed address and port, then the rank's own init."""
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def sum_of_ranks_with_own_setup():
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tutorial_setup(rank, world_size)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_a_rank_that_sets_its_own_master_port_uses_the_launch_rendezvous(capfd):
    # before: every rank became a client of 12355, which nobody served, until the timeout
    assert launch(sum_of_ranks_with_own_setup, 2, init=False, timeout=seconds(20)) == [1.0, 1.0]
    out = capfd.readouterr().out
    # before: the line did not say that under torchrun the script hangs on its own port
    assert ("[rank 0] ddp_helpers: MASTER_ADDR:PORT localhost:12355 from your code -> this launch's own\n"
            "[rank 0] ddp_helpers: under torchrun, delete the lines that set them: torchrun sets both\n") in out, out
    assert "[rank 1] ddp_helpers" not in out, "from rank 0 only"
    assert max(map(len, out.splitlines())) <= 100, "each line fits a notebook's width"


def destroy_and_init_again(rounds):
    """The tutorials' pattern, in a loop: the rank's own setup(), a collective, cleanup()."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sums = []
    for i in range(rounds):
        tutorial_setup(rank, world_size)
        t = torch.tensor([float(rank + i)])
        dist.all_reduce(t)
        sums.append(t.item())
        dist.destroy_process_group()
    return sums


def test_a_group_destroyed_and_formed_again_finds_its_peers():
    # before: a later round found the previous group's addresses in the launch's store ("Gloo
    # connectFullMesh failed ... Connection refused", or a wait until the timeout) in 4 of 10 launches
    # of five rounds
    for _ in range(3):
        sums = launch(destroy_and_init_again, 2, args=(10,), init=False, timeout=seconds(30), quiet=True)
        assert sums == [[1.0 + 2 * i for i in range(10)]] * 2


def init_at_an_address_of_its_own():
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="tcp://10.11.12.13:23456", rank=rank, world_size=2)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_a_tcp_init_method_uses_the_launch_rendezvous(capfd):
    # before: every rank retried 10.11.12.13 for 30 minutes, printing a C++ backtrace at each retry
    assert launch(init_at_an_address_of_its_own, 2, init=False, timeout=seconds(20)) == [2.0, 2.0]
    out = capfd.readouterr().out
    assert ("[rank 0] ddp_helpers: init_method tcp://10.11.12.13:23456 from your code -> this launch's own "
            "rendezvous\n[rank 0] ddp_helpers: under torchrun, drop init_method: torchrun sets MASTER_ADDR/PORT "
            "for env://\n") in out, out
    assert "[rank 1] ddp_helpers" not in out, "from rank 0 only"


def test_init_process_group_inside_a_formed_group_keeps_it(capfd):
    # before: "ValueError: trying to initialize the default process group twice!"
    assert launch(sum_of_ranks_with_own_setup, 2, timeout=seconds(20)) == [1.0, 1.0]
    assert "kept the gloo group of 2 ranks that exists" in capfd.readouterr().out


def init_with(**kwargs):
    dist.init_process_group("gloo", **kwargs)
    return dist.get_world_size()


def test_a_world_size_that_does_not_fit_is_an_error_at_once():
    # before: the ranks waited for two more ranks until the launch's timeout
    with pytest.raises(WorkerError) as caught:
        launch(init_with, 2, init=False, kwargs={"world_size": 4, "rank": 0}, timeout=seconds(30))
    assert not isinstance(caught.value, WorkerTimeout)
    assert "init_process_group(world_size=4), but 2 ranks were started" in str(caught.value)
    with pytest.raises(WorkerError, match="a process group exists already"):
        launch(init_with, 2, kwargs={"world_size": 3}, timeout=seconds(30))


def test_a_rendezvous_that_cannot_complete_is_named_as_one(tmp_path):
    where = f"file://{tmp_path}/rendezvous"   # both ranks say they are rank 1: rank 0 never comes
    with pytest.raises(WorkerTimeout) as caught:
        launch(init_with, 2, init=False, timeout=seconds(4), quiet=True,   # long enough to reach init
               kwargs={"init_method": where, "rank": 1, "world_size": 2})
    message = str(caught.value)
    assert f"were still in init_process_group, waiting for the rendezvous at {where}" in message, message
    assert "waiting in a collective" not in message


def test_a_script_without_the_main_guard_works(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent("""
        from ddp_helpers import launch
        import torch.distributed as dist

        def rank_and_size():
            return dist.get_rank(), dist.get_world_size()

        print("results:", launch(rank_and_size, 2, timeout=60))
    """))
    env = {**os.environ, "PYTHONPATH": REPO}   # this checkout's ddp_helpers
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=seconds(60))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("results:") == 1 and "results: [(0, 2), (1, 2)]" in done.stdout


P2P_TUTORIAL = '''
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    print("Rank", rank, "has data", tensor[0])

def init_process(rank, size, fn, backend="gloo"):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)

if __name__ == "__main__":
    world_size = 2
    processes = []
    mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
'''

DDP_TUTORIAL = '''
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    ddp_model = DDP(ToyModel())
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    loss = nn.MSELoss()(ddp_model(torch.randn(20, 10)), torch.randn(20, 5))
    loss.backward()
    optimizer.step()
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")

def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)

run_demo(demo_basic, 2)
'''


def test_tutorial_launch_lines_run_notebook_functions_in_a_kernel():
    failing = ("def broken(rank, world_size):\n"
               "    if rank == 1:\n"
               "        raise RuntimeError('broken on rank one')\n")
    cells = [
        "%load_ext ddp_helpers",
        P2P_TUTORIAL,
        P2P_TUTORIAL,   # a re-run: "context has already been set" before
        DDP_TUTORIAL,
        failing + "mp.spawn(broken, args=(2,), nprocs=2)",
        failing + "ps = [mp.Process(target=init_process, args=(r, 2, broken)) for r in range(2)]\n"
                  "for p in ps: p.start()\nfor p in ps: p.join()",
        "%%ddp -n 2\nsetup(rank, world_size)\nt = torch.ones(1)\ndist.all_reduce(t)\ncleanup()\nt",
        "a, b = mp.Pipe()\np = mp.Process(target=init_process, args=(0, 1, lambda rank, size: b.send(rank)))\n"
        "p.start()",
        "from ddp_helpers import tutorials\ntutorials.disable()\n"
        "import torch.multiprocessing as mp\nprint(mp.spawn.__module__, mp.Process.__module__)",
    ]
    out = run_notebook(cells, timeout=seconds(60))
    for i in (1, 2):
        text = text_of(out[i])
        # before: "Can't get attribute 'init_process' on <module '__main__'>" in the kernel's stderr only
        assert "[rank 0] Rank 0 has data tensor(1.)" in text and "[rank 1] Rank 1 has data tensor(1.)" in text, text
        assert "29500 from your code -> this launch's own" in text
        assert not [o for o in out[i].outputs if o.output_type == "error"], text
    text = text_of(out[3])
    assert "[rank 1] Finished running basic DDP example on rank 1." in text, text
    for i in (4, 5):
        errors = [o for o in out[i].outputs if o.output_type == "error"]
        assert errors and errors[0].ename == "WorkerError", text_of(out[i])
        assert "rank 1 raised RuntimeError: broken on rank one" in text_of(out[i])
        assert "raise RuntimeError('broken on rank one')" in text_of(out[i]), "the cell's line"
    text = text_of(out[6])
    assert "[rank 0] tensor([2.])" in text and "kept the gloo group of 2 ranks" in text, text
    assert "12355 from your code -> this launch's own\n[rank 0] ddp_helpers: under torchrun, delete" in text, text
    # before: the Pipe end passed, and arrived in the rank as a bare file descriptor
    errors = [o for o in out[7].outputs if o.output_type == "error"]
    assert errors and errors[0].ename == "TypeError", text_of(out[7])
    assert "forms a process group, so it runs as one of ddp_helpers' ranks" in errors[0].evalue
    assert "a Pipe end cannot reach" in errors[0].evalue, errors[0].evalue
    assert "torch.multiprocessing.spawn multiprocessing.context" in text_of(out[8])


EVERYDAY_MULTIPROCESSING = [
    "%load_ext ddp_helpers",
    "import multiprocessing, time, torch\nimport torch.multiprocessing as mp\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "print('sum', sum(b[0].sum().item() for b in DataLoader(TensorDataset(torch.arange(64.)), batch_size=8, "
    "num_workers=2)))",
    "def nap(s):\n    time.sleep(s)\n"
    "p = mp.Process(target=nap, args=(0.2,))\np.start()\n"
    "print('real', isinstance(p, multiprocessing.Process), isinstance(p, mp.Process), p.pid > 0, p.sentinel >= 0)\n"
    "end = time.monotonic() + 60\nwhile p.is_alive() and time.monotonic() < end:\n    time.sleep(0.05)\n"
    "print('ended', p.is_alive(), p.exitcode)",
    "p = mp.Process(target=nap, args=(30,))\np.start()\nt = time.monotonic()\np.join(timeout=2)\n"
    "waited = time.monotonic() - t\nprint('after join(timeout=2)', p.is_alive(), 2 <= waited < 15)\n"
    "p.terminate()\np.join(timeout=20)\nprint('terminated', p.exitcode)",
    "def echo(conn, q):\n    q.put(conn.recv() * 2)\n    conn.send('done')\n"
    "a, b = mp.Pipe()\nq = mp.Queue()\np = mp.Process(target=echo, args=(b, q))\np.start()\na.send(21)\n"
    "print('queue', q.get(timeout=30), 'pipe', a.recv())\np.join()\nprint('exitcode', p.exitcode)",
]


def test_everyday_multiprocessing_in_the_kernel_is_torchs_own():
    # before: DataLoader raised "'Process' object has no attribute 'pid'"; is_alive() stayed True until
    # join(); join(timeout=2) waited for the whole target; terminate() did nothing; a Pipe end arrived
    # in a rank as a bare fd number
    out = run_notebook(EVERYDAY_MULTIPROCESSING, timeout=seconds(60))
    for cell in out:
        assert not [o for o in cell.outputs if o.output_type == "error"], text_of(cell)
        assert "Traceback" not in text_of(cell), text_of(cell)
    assert "sum 2016.0" in text_of(out[1]), text_of(out[1])
    assert "real True True True True" in text_of(out[2]) and "ended False 0" in text_of(out[2]), text_of(out[2])
    assert "after join(timeout=2) True True" in text_of(out[3]), text_of(out[3])
    assert "terminated -15" in text_of(out[3]), text_of(out[3])
    assert "queue 42 pipe done" in text_of(out[4]) and "exitcode 0" in text_of(out[4]), text_of(out[4])
