"""What the launcher, the pool and the magic say when something is wrong, before any rank starts or
after a cell ran out of time; the seed a learner gives; a pasted script's `__main__` block; the
extension unloaded and loaded again; the run folders' fallback when the usual one is taken."""
import multiprocessing
import os
import re
import tempfile
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist
from conftest import seconds
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from ddp_helpers import WorkerError, WorkerTimeout, launch, spawn
from ddp_helpers import launcher as launcher_module
from ddp_helpers import magic as magic_module
from ddp_helpers import pool as pool_module
from ddp_helpers.pool import Pool
from ddp_helpers.runtime import run_dirs as run_dirs_module
from ddp_helpers.runtime.cell_exec import run_cell


def run_dirs():
    root = os.path.join(tempfile.gettempdir(), f"ddp_helpers-{os.getuid()}")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def nothing_started(check):
    """Run `check()` (which must raise) and assert that no run folder nor process was made."""
    before_dirs, before_children = run_dirs(), multiprocessing.active_children()
    check()
    assert run_dirs() == before_dirs
    assert multiprocessing.active_children() == before_children


@pytest.fixture(scope="module")
def pool():
    with Pool(world_size=2) as p:
        yield p


@pytest.fixture
def magics():
    """The %%ddp magic in this process's IPython shell (no pool running, none left running)."""
    shell = InteractiveShell.instance()
    yield magic_module.DDPMagics(shell=shell)
    if magic_module.DDPMagics.pool is not None:
        magic_module.DDPMagics.pool.stop()
        magic_module.DDPMagics.pool = None
    InteractiveShell.clear_instance()   # later tests in this process see no IPython shell


# ---- world_size 0, torchrun's variables in env=, the seed: refused before anything starts ----
def test_a_world_size_of_zero_says_where_a_zero_comes_from():
    # before: "world_size must be between 1 and 64 on one machine, got 0", and nothing more
    for call in (lambda: launch(lambda: 1, world_size=0), lambda: spawn(print, nprocs=0),
                 lambda: Pool(world_size=0)):
        def check(call=call):
            with pytest.raises(ValueError, match=re.escape("torch.cuda.device_count()")) as info:
                call()
            assert "gloo" in str(info.value)
        nothing_started(check)
    with pytest.raises(ValueError) as info:
        spawn(print, nprocs=0)
    assert "nprocs" in str(info.value), "spawn's own name for it"
    with pytest.raises(ValueError) as info:
        launch(lambda: 1, world_size=65)
    assert "device_count" not in str(info.value), "only a 0 comes from there"


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                  "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"])
def test_torchrun_variables_in_env_are_refused_before_any_process_starts(name):
    # before: env={"WORLD_SIZE": "7"} made every rank wait for 7 ranks until the timeout
    def check():
        with pytest.raises(ValueError, match=f"env={{'{name}': ...}}") as info:
            launch(lambda: 1, 2, env={name: "7", "OTHER": "fine"}, timeout=seconds(20))
        assert "world_size" in str(info.value) or "MASTER" in name or "TORCHELASTIC" in name
    nothing_started(check)
    with pytest.raises(ValueError, match=name):
        Pool(world_size=2, env={name: "7"})


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (2**64, ValueError), (1.5, TypeError),
                                         ("0", TypeError), (True, TypeError)])
def test_a_bad_seed_is_refused_before_any_process_starts(seed, error):
    # before: launch(..., seed=...) was an unexpected keyword argument
    nothing_started(lambda: _raises(error, "seed must be", lambda: launch(lambda: 1, 2, seed=seed)))
    nothing_started(lambda: _raises(error, "seed must be", lambda: spawn(print, nprocs=1, seed=seed)))


def _raises(error, words, call):
    with pytest.raises(error, match=words):
        call()


def test_the_seed_travels_to_the_ranks(monkeypatch, pool, magics):
    # before: no seed parameter anywhere
    jobs = []
    real_job = launcher_module.WorkerJob

    def recording_job(**fields):
        jobs.append(fields.get("seed"))
        return real_job(**fields)
    monkeypatch.setattr(launcher_module, "WorkerJob", recording_job)
    assert launch(lambda: 1, 2, seed=3, quiet=True) == [1, 1]
    assert spawn(lambda rank: rank, nprocs=2, seed=4, quiet=True) == [0, 1]
    assert launch(lambda: 1, 1, quiet=True) == [1]
    assert jobs == [3, 4, None]

    requests = []
    real_message = pool_module._message

    def recording_message(request):
        requests.append((type(request).__name__, getattr(request, "seed", "no field")))
        return real_message(request)
    monkeypatch.setattr(pool_module, "_message", recording_message)
    assert list(pool.run_cell("rank", seed=5)) == [0, 1]
    assert pool.run(lambda: 2, seed=6) == [2, 2]
    assert list(pool.run_cell("rank")) == [0, 1]
    assert requests == [("Exec", 5), ("Call", 6), ("Exec", None)]
    with pytest.raises(ValueError, match="seed must be"):
        pool.run_cell("rank", seed=-3)
    assert len(requests) == 3, "a bad seed sends nothing"

    calls = []
    monkeypatch.setattr(magic_module, "launch", lambda *a, **kw: calls.append(kw.get("seed")) or [None])
    magics.ddp("-n 1 --seed 7", "x = 1")
    magics.ddp("-n 1", "x = 1")
    assert calls == [7, None]
    with pytest.raises(UsageError, match="seed"):
        magics.ddp("-n 1 --seed -2", "x = 1")


def test_a_seeded_ddp_cell_draws_the_same_numbers_again(magics):
    # before: %%ddp had no --seed (and every rank drew the fork server's numbers)
    cell = "torch.rand(1).item()"
    first, again = magics.ddp("-n 2 --seed 0", cell), magics.ddp("-n 2 --seed 0", cell)
    assert list(first) == list(again) and first[0] != first[1], (first, again)
    assert list(magics.ddp("-n 2", cell)) != list(first)
    magics.ddp("start -n 2")
    seeded = [list(magics.ddp("--seed 0", cell)) for _ in range(2)]
    assert seeded == [list(first)] * 2, "a pool cell with --seed draws what a fresh launch with it draws"
    magics.ddp("start -n 2 --seed 0")
    assert list(magics.ddp("", cell)) == list(first), "%ddp start --seed seeds the ranks as they start"
    with pytest.raises(UsageError, match="--seed goes with"):
        magics.ddp("status --seed 1")


# ---- a pasted script: its `if __name__ == "__main__":` block runs on every rank ----
PASTED_SCRIPT = textwrap.dedent('''
    import argparse, os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:   # an older torch
        fully_shard = None

    def main(args):
        dist.init_process_group("gloo")       # the group a %%ddp cell has already: kept
        rank = int(os.environ["LOCAL_RANK"])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        if fully_shard is not None:   # on the CPU: a GPU machine's cuda mesh would want a GPU per rank
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        loss = model(torch.ones(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        print(f"main ran on rank {rank}: loss {loss.item():.4f}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        parser = argparse.ArgumentParser(description="a pasted training script")
        parser.add_argument("--lr", type=float, default=0.1)
        main(parser.parse_args())
''')


def test_a_pasted_scripts_main_block_runs_on_every_rank(capfd, pool):
    # before: the block was skipped without a word (the cell's __name__ was "__ddp__"); and the
    # kernel's own command line (pytest's here, `-f kernel.json` in Jupyter) reached argparse
    launch(run_cell, 2, args=(PASTED_SCRIPT, {}, "<ddp-cell-1>"), timeout=seconds(60))
    out, _ = capfd.readouterr()
    assert "[rank 0] main ran on rank 0: loss" in out and "[rank 1] main ran on rank 1: loss" in out, out
    pool.run_cell(PASTED_SCRIPT, timeout=seconds(60))
    out, _ = capfd.readouterr()
    assert "[rank 0] main ran on rank 0: loss" in out and "[rank 1] main ran on rank 1: loss" in out, out
    # a cell without the block runs as it did; the pool's group survived the script's destroy
    assert list(pool.run_cell("t = torch.ones(1) * rank\ndist.all_reduce(t)\n(__name__, t.item())")) == \
        [("__main__", 1.0), ("__main__", 1.0)]


SPAWN_IN_A_CELL = '''
import torch.multiprocessing as mp
def demo(rank, world_size):
    print("demo on", rank)
if __name__ == "__main__":
    mp.spawn(demo, args=(2,), nprocs=2)
'''


def test_mp_spawn_inside_a_ddp_cell_says_what_to_do(magics):
    # before: a PicklingError from deep in multiprocessing ("import of module '__ddp__' failed")
    with pytest.raises(WorkerError) as info:
        magics.ddp("-n 2", SPAWN_IN_A_CELL)
    first_lines = "\n".join(str(info.value).splitlines()[:2])
    assert "mp.spawn" in first_lines and "without %%ddp" in first_lines, str(info.value)


# ---- a timeout: what to change ----
def test_a_timeout_in_the_learners_code_names_the_limit_not_collectives():
    # before: "A rank waiting in a collective for a rank that never calls it waits forever", for a
    # rank that was in time.sleep, and no word of timeout=
    def sleep_on_rank_1():   # defined here, so it travels by value (the ranks import nothing of the tests)
        import time
        if dist.get_rank() == 1:
            time.sleep(600)

    def reduce_on_rank_0_only():
        import time
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        else:
            time.sleep(600)

    limit = seconds(1)
    with pytest.raises(WorkerTimeout) as info:
        launch(sleep_on_rank_1, 2, timeout=limit, quiet=True)
    message = str(info.value)
    assert f"timeout={limit:g}" in message and "collective" not in message, message
    assert info.value.unfinished_ranks == [1] and info.value.in_collective == {}
    with pytest.raises(WorkerTimeout) as info:
        launch(reduce_on_rank_0_only, 2, timeout=limit, quiet=True)
    message = str(info.value)
    assert f"timeout={limit:g}" in message and "rank 0 was waiting in all_reduce" in message, message
    assert "waits forever" in message and info.value.in_collective == {0: "all_reduce"}, message


def test_ranks_waiting_in_different_collectives_are_called_a_mismatch():
    # before: "look for a rank that skipped it" and "raise the limit", when no rank skipped anything
    # and no limit helps: rank 0 waited in all_reduce, rank 1 in broadcast (notebook 12's first cell)
    def mismatched():
        t = torch.ones(4)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=1)

    with pytest.raises(WorkerTimeout) as info:
        launch(mismatched, 2, timeout=seconds(1), quiet=True)
    lines = str(info.value).splitlines()
    hint = [line for line in lines if "different collectives" in line]
    assert len(hint) == 1 and "mismatch" in hint[0] and "same order" in hint[0], lines
    assert len(hint[0]) <= 100, hint[0]
    assert "skipped" not in str(info.value) and "raise the limit" not in str(info.value), lines
    assert info.value.in_collective == {0: "all_reduce", 1: "broadcast"}
    assert all(len(line) <= 100 for line in lines if not line.startswith("Logs: ")), lines


def fake_stack(function):
    """A faulthandler dump of one thread waiting in torch.distributed's `function`."""
    where = os.path.join(os.path.dirname(dist.__file__), "distributed_c10d.py")
    return (f"Current thread 0x00007f0000000001 (most recent call first):\n"
            f'  File "{where}", line 1 in {function}\n  File "<cell>", line 3 in step\n')


def test_a_send_facing_a_recv_is_not_called_a_mismatch():
    # Point-to-point ranks wait in different calls by design; nor is a rank in its own code a mismatch.
    from ddp_helpers.runtime.stacks import describe_timeout
    for places in ({0: "send", 1: "recv"}, {0: "all_reduce", 1: ""}):
        stacks = {r: fake_stack(f) if f else 'Current thread 0x1 (most recent call first):\n'
                  '  File "<cell>", line 3 in step\n' for r, f in places.items()}
        message, _ = describe_timeout(1, [0, 1], stacks, "/tmp/logs", where="in the logs")
        assert "mismatch" not in message and "skipped" in message, message
    message, waiting = describe_timeout(1, [0, 1, 2], {0: fake_stack("all_reduce"), 1: fake_stack("send"),
                                                       2: fake_stack("all_reduce")}, "/tmp/logs")
    assert "different collectives" in message and waiting == {0: "all_reduce", 1: "send", 2: "all_reduce"}


def test_a_pool_timeout_names_the_limit(pool):
    # before: "timed out after 1.5 s: rank(s) [1] had not finished; their stacks are printed above"
    with pytest.raises(WorkerTimeout) as info:
        pool.run_cell("import time\nif rank == 1:\n    time.sleep(600)", timeout=1.5)
    message = str(info.value)
    assert "timeout=1.5" in message and "collective" not in message, message
    assert list(pool.run_cell("rank")) == [0, 1]


def test_a_ddp_cell_timeout_names_dash_t(magics):
    # before: no word of -t
    cell = "import time\nif rank == 1:\n    time.sleep(600)"
    with pytest.raises(WorkerTimeout) as info:
        magics.ddp("-n 2 -t 2", cell)
    assert "-t 2" in str(info.value) and "timeout=" not in str(info.value), str(info.value)
    magics.ddp("start -n 2")
    with pytest.raises(WorkerTimeout) as info:
        magics.ddp("-t 1.5", "import time\nif rank == 0:\n    dist.all_reduce(torch.ones(1))\n"
                             "else:\n    time.sleep(600)")
    message = str(info.value)
    assert "-t 1.5" in message and "collective" in message and "all_reduce" in message, message


# ---- %ddp push of something that cannot travel ----
def test_pushing_a_lock_names_the_variable(pool, magics):
    # before: a raw pickling traceback from inside the pool
    with pytest.raises(TypeError, match="cannot send 'my_lock' to the ranks") as info:
        pool.push(ok=1, my_lock=threading.Lock())
    assert "'ok'" not in str(info.value)
    assert list(pool.run_cell("rank")) == [0, 1], "the pool is as it was"
    magics.shell.user_ns["my_lock"] = threading.Lock()
    magics.shell.user_ns["lr"] = 0.1
    magics.ddp("start -n 1")
    with pytest.raises(UsageError, match="my_lock") as info:
        magics.ddp("push lr my_lock")
    assert "Lock" in str(info.value) or "lock" in str(info.value)
    assert list(magics.ddp("-n 1", "rank")) == [0]


# ---- %unload_ext, then %load_ext again ----
def test_the_extension_unloads_and_loads_again(tmp_path):
    # before: "The extension ddp_helpers doesn't define how to unload it."
    from test_kernel import run_notebook, text_of
    cells = [
        "import torch.multiprocessing as mp\nreal_spawn = mp.spawn",
        "%load_ext ddp_helpers",
        "%ddp start -n 2",
        "from ddp_helpers.magic import DDPMagics\npids = [r['pid'] for r in DDPMagics.pool.status()]",
        "%unload_ext ddp_helpers",
        "import os\nprint('alive', [os.path.exists(f'/proc/{p}') for p in pids], DDPMagics.pool,\n"
        "      'spawn restored', mp.spawn is real_spawn)",
        "%%ddp -n 2\nrank",
        "%load_ext ddp_helpers",
        "%%ddp -n 2\nrank",
        "print('shim again', mp.spawn is not real_spawn)",
    ]
    out = run_notebook(cells, timeout=seconds(60))
    assert "doesn't define how to unload" not in text_of(out[4]), text_of(out[4])
    assert not [o for o in out[4].outputs if o.output_type == "error"], text_of(out[4])
    assert "alive [False, False] None spawn restored True" in text_of(out[5]), text_of(out[5])
    assert "UsageError" in text_of(out[6]) and "ddp" in text_of(out[6]), "the magic is gone"
    assert "[rank 0] 0\n[rank 1] 1" in text_of(out[8]), text_of(out[8])
    assert "shim again True" in text_of(out[9]), text_of(out[9])


# ---- the run folders' root, when $TMPDIR/ddp_helpers-<uid> is taken ----
def test_a_squatted_scratch_root_leaves_one_fallback_folder(tmp_path, monkeypatch):
    # before: every kernel made a new ddp_helpers-<uid>-XXXX folder and left it behind
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    uid = os.getuid()
    (tmp_path / f"ddp_helpers-{uid}").write_text("not a folder")
    others = tmp_path / f"ddp_helpers-{uid}-aaaa"   # named like a fallback, but another user's
    others.mkdir(mode=0o700)
    os.chown(others, uid + 1, -1)
    roots = []
    for _kernel in range(3):   # each kernel starts with no fallback of its own yet
        monkeypatch.setattr(run_dirs_module, "_fallback_roots", {})
        with pytest.warns(UserWarning, match="it is not a folder"):
            folder = run_dirs_module.new_run_dir()
        run_dirs_module.release_run_dir(folder)
        roots.append(os.path.dirname(folder))
    assert len(set(roots)) == 1, roots
    assert roots[0] != str(others), "another user's folder is never used"
    made = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"ddp_helpers-{uid}-"))
    assert made == sorted([others.name, os.path.basename(roots[0])]), made
    st = os.stat(roots[0])
    assert st.st_uid == uid and st.st_mode & 0o777 == 0o700
