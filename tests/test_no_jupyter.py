"""`launch`, `spawn`, the trainer and `python -m ddp_helpers.bench` on a machine without Jupyter.

A GPU image, a torchrun job or a plain script often has no IPython: only the magics and the rich
display may need it. These tests run each one in a fresh Python where IPython, ipykernel, ipywidgets,
jupyter (and their kin) cannot be imported: a `sitecustomize` on PYTHONPATH puts a finder first on
`sys.meta_path` that raises ImportError for those names, in that process and in everything it starts
(the fork server and the ranks inherit PYTHONPATH). Cheaper than a second virtual environment without
them (minutes to build), and it catches the same imports.
"""
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import MINI, REPO, needs_mini, seconds

HIDDEN = ("IPython", "ipykernel", "ipywidgets", "jupyter", "jupyter_client", "jupyter_core",
          "matplotlib_inline", "comm")

SITECUSTOMIZE = f"""
import sys

HIDDEN = {HIDDEN!r}


class NoJupyter:
    '''Refuses the notebook's packages, as on a machine where they are not installed.'''

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by tests/test_no_jupyter.py)", name=name)
        return None


sys.meta_path.insert(0, NoJupyter())
"""


@pytest.fixture(scope="module")
def no_jupyter_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("no_jupyter")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "JPY_PARENT_PID")}
    env.update(PYTHONPATH=os.pathsep.join([str(folder), REPO]), OMP_NUM_THREADS="1", TMPDIR=str(folder))
    return env


def run_python(args, env, timeout=120):
    done = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=seconds(timeout))
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout


def test_the_notebook_packages_are_really_hidden(no_jupyter_env):
    out = run_python(["-c", textwrap.dedent("""
        for name in ("IPython", "IPython.display", "ipykernel", "ipywidgets", "jupyter_client"):
            try:
                __import__(name)
            except ImportError:
                print("hidden", name)
        """)], no_jupyter_env)
    assert out.split("\n")[:-1] == [f"hidden {n}" for n in
                                    ("IPython", "IPython.display", "ipykernel", "ipywidgets", "jupyter_client")]


SCRIPT = """
import sys
from ddp_helpers import launch, spawn
import torch.distributed as dist


def total(x):
    t = __import__("torch").tensor([float(x + dist.get_rank())])
    dist.all_reduce(t)
    display("shown as text")     # the rank's `display`, without IPython: its text
    return t.item()


def figure_bundle():
    import matplotlib.pyplot as plt
    from ddp_helpers.runtime import rank_io
    fig = plt.figure()
    plt.plot([1, 2])
    data, _ = rank_io.mime_bundle(fig)
    plt.close(fig)
    return sorted(data), data["image/png"][:8]


def demo(rank, world_size):
    return (rank, world_size, dist.get_world_size())


print("launch", launch(total, world_size=2, args=(1,), quiet=False))
print("spawn", spawn(demo, args=(2,), nprocs=2, quiet=True))
print("figure", launch(figure_bundle, world_size=1)[0])
print("IPython loaded:", "IPython" in sys.modules)
"""


def test_launch_and_spawn_without_ipython(no_jupyter_env, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = run_python([str(script)], no_jupyter_env)
    assert "launch [3.0, 3.0]" in out, out
    assert "spawn [(0, 2, 2), (1, 2, 2)]" in out, out
    assert "[rank 0] 'shown as text'" in out, out
    assert "figure (['image/png', 'text/plain'], 'iVBORw0K')" in out, out   # a PNG, base64
    assert "IPython loaded: False" in out


@needs_mini
def test_the_trainer_launched_and_its_cli_without_ipython(no_jupyter_env, tmp_path):
    env = dict(no_jupyter_env, DDP_HELPERS_CIFAR10=MINI)
    small = dict(width=8, per_class=5, test_per_class=2, batch_size=10, epochs=1, verbose=False, device="cpu")
    script = tmp_path / "train_script.py"
    script.write_text(f"from ddp_helpers import launch, train\n"
                      f"records = launch(train.run, 2, 'gloo', kwargs={small!r}, quiet=True, timeout=300)\n"
                      f"print('trained', len(records), records[0]['test_accuracy'] >= 0)\n")
    assert "trained 2 True" in run_python([str(script)], env, timeout=300)
    out = run_python(["-m", "ddp_helpers.train", "--width", "8", "--per-class", "5", "--test-per-class", "2",
                      "--epochs", "1", "--batch-size", "10", "--log-every", "1", "--device", "cpu"], env, timeout=300)
    assert "done: test accuracy" in out, out


def test_bench_cli_without_ipython(no_jupyter_env):
    out = run_python(["-m", "ddp_helpers.bench", "-c", "all_reduce", "-b", "8", "-e", "64", "-f", "8", "-n", "2",
                      "-w", "1"], no_jupyter_env)
    lines = [line.removeprefix("[rank 0]").strip() for line in out.splitlines()]   # the ranks' own table
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [8, 64] and all(r[-1] == "0" for r in rows), out   # #wrong: 0
