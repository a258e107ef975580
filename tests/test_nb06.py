"""Notebook 06: the script its %%writefile cell writes is examples/ddp_minimal.py as committed; the
picture of live.compare (one curve per run, a progress bar); compare checks every run's settings
before it starts any; the text says what a rank waiting in a collective meets (the timeout)."""
import os

import nbformat
import pytest
from conftest import REPO

from ddp_helpers import live

NOTEBOOK = os.path.join(REPO, "notebooks", "06_ddp_cifar10.ipynb")
SCRIPT = os.path.join(REPO, "examples", "ddp_minimal.py")


def _cells():
    return nbformat.read(NOTEBOOK, as_version=4).cells


def test_the_notebook_writes_the_committed_script():
    magic = "%%writefile {minimal_script}\n"    # examples/ddp_minimal.py, from the notebook's folder
    sources = [c.source for c in _cells() if c.cell_type == "code"]
    assert any('minimal_script = paths.example("ddp_minimal.py")' in s for s in sources)
    written = [s for s in sources if s.startswith(magic)]
    assert len(written) == 1, "one cell writes examples/ddp_minimal.py"
    with open(SCRIPT) as f:
        committed = f.read()
    assert written[0][len(magic):].rstrip("\n") == committed.rstrip("\n"), \
        "the %%writefile cell and examples/ddp_minimal.py differ: copy one to the other"
    assert len(committed.splitlines()) <= 80
    for needed in ("init_process_group", "DDP(", "DistributedSampler(", "set_epoch(", "all_reduce(",
                   "model.module.state_dict()", "barrier()", "destroy_process_group()"):
        assert needed in committed


def test_the_notebook_runs_the_script_under_torchrun():
    sources = [c.source for c in _cells() if c.cell_type == "code"]
    assert any("run_nodes([minimal_script, " in s for s in sources)


def test_no_rank_waits_forever_in_the_text():
    text = " ".join(c.source for c in _cells() if c.cell_type == "markdown").replace("\n", " ")
    assert "forever" not in text
    assert "30 minutes by default for Gloo, 10 for NCCL" in text and "12_debugging.ipynb" in text
    from datetime import timedelta

    from torch.distributed import constants
    assert constants.default_pg_timeout == timedelta(minutes=30)            # what the text says
    assert getattr(constants, "default_pg_nccl_timeout", timedelta(minutes=10)) == timedelta(minutes=10)


def _record(losses, accuracy=None, total=None):
    record = {"steps": [{"step": i + 1, "loss": loss, "images_per_s": 1.0} for i, loss in enumerate(losses)],
              "total_steps": total or len(losses), "epochs": []}
    if accuracy is not None:
        record["test_accuracy"] = accuracy
    return record


def test_mean_loss_is_the_mean_over_ranks_at_each_step():
    steps, loss = live.mean_loss(_record([[2.0, 4.0], [1.0, 2.0]]))
    assert steps == [1, 2] and loss == [3.0, 1.5]


def test_the_compare_picture_has_a_progress_bar_and_a_curve_per_run():
    names = ["1 rank", "2 ranks", "1 rank, seed 1"]
    done = {"1 rank": _record([[2.3], [2.0], [1.8]], 0.3)}
    running = _record([[2.3, 2.2], [2.1, 2.0]], total=3)
    fig = live.draw_compare(names, done, "2 ranks", running)
    bar, curves = fig.axes
    assert len(curves.lines) == 2                             # a finished run and the running one
    assert bar.patches[0].get_width() == pytest.approx((1 + 2 / 3) / 3)
    assert "run 2/3: 2 ranks, step 2/3" in bar.get_title()
    assert live.png(fig)[:4] == b"\x89PNG"
    end = live.draw_compare(names, {**done, "2 ranks": running, "1 rank, seed 1": running})
    assert end.axes[0].patches[0].get_width() == pytest.approx(1.0) and "3/3 runs" in end.axes[0].get_title()


def test_compare_checks_every_run_before_it_starts_one(monkeypatch):
    started = []
    monkeypatch.setattr(live, "launch_live", lambda *args: started.append(args))
    runs = {"good": dict(world_size=1), "bad": dict(world_size=2, lr=float("inf"))}
    with pytest.raises(ValueError, match="lr must be a positive, finite number"):
        live.compare(runs, view="text", width=16)
    assert started == []
