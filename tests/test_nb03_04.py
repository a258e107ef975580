"""Notebooks 03 and 04: the contributions picture draws who went into each element of a reduction,
the version shims live in one setup cell, 03's backend probe says what the stored probe found, and
04 leaves peer failures to notebook 12 and compares with nccl-tests on both sides."""
import os
import re
import types

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import REPO  # noqa: E402
from matplotlib import colors  # noqa: E402

from ddp_helpers import plots  # noqa: E402

NB03 = os.path.join(REPO, "notebooks", "03_collectives.ipynb")
NB04 = os.path.join(REPO, "notebooks", "04_gloo_vs_nccl.ipynb")


@pytest.fixture
def drawn(monkeypatch):
    """Each figure plots.show_contributions returns, kept."""
    figures, real = [], plots.show_contributions
    monkeypatch.setattr(plots, "show_contributions", lambda *args, **kwargs: figures.append(real(*args, **kwargs)))
    yield figures
    plt.close("all")


def _inputs(world=4, length=4):
    return [torch.arange(float(length)) + 10 * r for r in range(world)]


def _bands(ax):
    """Per element (left to right): the source ranks of its bands, top to bottom, by tab10 colour."""
    palette = [colors.to_hex(plt.get_cmap("tab10")(i)) for i in range(10)]
    elements = {}
    for patch in ax.patches:
        x, y = patch.get_xy()
        elements.setdefault(round(x + 0.5), []).append((-y, palette.index(colors.to_hex(patch.get_facecolor()))))
    return [[rank for _, rank in sorted(bands)] for _, bands in sorted(elements.items())]


def test_a_sum_shows_every_rank_in_every_element_and_a_max_only_the_winner(drawn):
    inputs = _inputs()
    total, largest = sum(inputs), inputs[3]
    plots.show_contributions([(inputs[r], total, largest) for r in range(4)], "all_reduce",
                             stages=("before", "SUM", "MAX"), ops=(None, "sum", "max"))
    axes = drawn[0].axes
    grid = [axes[3 * r:3 * r + 3] for r in range(4)]
    for rank in range(4):
        assert _bands(grid[rank][0]) == [[rank]] * 4          # an input: its own rank's colour
        assert _bands(grid[rank][1]) == [[0, 1, 2, 3]] * 4    # a sum: a band for every rank
        assert _bands(grid[rank][2]) == [[3]] * 4             # the max: rank 3's values won


def test_reduce_scatter_takes_slice_r_and_a_rank_without_a_result_is_a_dash(drawn):
    inputs = _inputs(length=8)
    total = sum(inputs)
    plots.show_contributions([(inputs[r], total[2 * r:2 * r + 2]) for r in range(4)], "rs",
                             scattered=True)
    axes = drawn[0].axes
    assert all(_bands(axes[2 * r + 1]) == [[0, 1, 2, 3]] * 2 for r in range(4))
    plots.show_contributions([(inputs[r], total if r == 0 else None) for r in range(4)], "reduce")
    axes = drawn[1].axes
    assert [t.get_text() for t in axes[3].texts] == ["—"]
    with pytest.raises(ValueError, match=r"rank 1, element 0: 68 is not the sum .* position 0 \(0, 10, 20, 30\)"):
        # without scattered=True, rank 1's result would be slice 0's sum: the check catches it
        plots.show_contributions([(inputs[r], total[2 * r:2 * r + 2]) for r in range(4)], "rs")


def test_a_value_that_is_not_the_reduction_of_the_inputs_is_refused(drawn):
    inputs = _inputs()
    wrong = sum(inputs).clone()
    wrong[2] += 1
    with pytest.raises(ValueError, match=r"rank 0, element 2: 69 is not the sum"):
        plots.show_contributions([(inputs[r], wrong) for r in range(4)], "all_reduce")
    with pytest.raises(ValueError, match=r"is not the max"):
        plots.show_contributions([(inputs[r], inputs[2]) for r in range(4)], "max", ops=(None, "max"))
    with pytest.raises(ValueError, match="one op per stage"):
        plots.show_contributions([(inputs[r], inputs[2]) for r in range(4)], "x", ops=(None,))


def _code_cells(path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def test_03_names_the_renamed_collectives_in_one_setup_cell_only():
    old_names = re.compile(r"all_gather_into_tensor|reduce_scatter_tensor|hasattr\(dist")
    with_shims = [c for c in _code_cells(NB03) if old_names.search(c.source)]
    assert len(with_shims) == 1, [c.source[:80] for c in with_shims]
    setup = with_shims[0].source
    assert "torch 2.11" in setup and _code_cells(NB03).index(with_shims[0]) <= 2
    lessons = "\n".join(c.source for c in _code_cells(NB03))
    assert "dist.all_gather_single(" in lessons and "dist.reduce_scatter_single(" in lessons
    # the setup gives a torch without the new names (2.11) the new names, and leaves a newer one alone
    old = types.SimpleNamespace(all_gather_into_tensor=object(), reduce_scatter_tensor=object())
    exec(setup.split("\n", 1)[1], {"dist": old})   # the cell without its %%ddp line
    assert old.all_gather_single is old.all_gather_into_tensor
    assert old.reduce_scatter_single is old.reduce_scatter_tensor
    new = types.SimpleNamespace(all_gather_single=1, reduce_scatter_single=2,
                                all_gather_into_tensor=3, reduce_scatter_tensor=4)
    exec(setup.split("\n", 1)[1], {"dist": new})
    assert (new.all_gather_single, new.reduce_scatter_single) == (1, 2)


def test_03_async_cell_measures_the_overlap_it_claims():
    cell = next(c for c in _code_cells(NB03) if "async_op=True" in c.source)
    assert "perf_counter" in cell.source and "hidden" in cell.source
    assert "nbval-ignore-output" in cell.metadata.get("tags", [])
    printed = "".join(o.get("text", "") for o in cell.outputs)
    assert re.search(r"hidden behind the work: -?[\d.]+ ms of the all-reduce's [\d.]+ ms", printed)


def _markdown(path):
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")


def test_03_says_what_the_stored_gpu_probe_found():
    from ddp_helpers import reference
    rows, _ = reference.load("support_gpu")
    gloo = {r["op"]: r["result"] for r in rows if r["backend"] == "gloo"}
    assert gloo["send / recv"] == "✘ RuntimeError"       # it raised: the text must not say "crashed"
    text = _markdown(NB03)
    assert "raised a `RuntimeError`" in text and "crashed" not in text
    probe = next(c for c in _code_cells(NB03) if "docs_no" in c.source)
    assert 'columns["Gloo, CUDA (stored)"]["send / recv"] == "✘ RuntimeError"' in probe.source
    # the docs' table as quoted (the version with four backends): Gloo marks all_to_all ✘ on CPU too
    assert '"Gloo, CPU (here)": {"all_to_all"}' in probe.source


def test_04_leaves_peer_failures_to_notebook_12():
    text = _markdown(NB04)
    assert "(12_debugging.ipynb)" in text
    for topic in ("watchdog", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "shrink_group", "torchft"):
        assert topic not in text, topic
    assert not [c for c in _code_cells(NB04) if "peer_leaves" in c.source or "shrink" in c.source]


def test_04_compares_with_nccl_tests_on_both_sides():
    cell = next(c for c in _code_cells(NB04) if "bench_nccl_tests_comparison" in c.source)
    for bound in ("1.3 < min(graph)", "max(graph) < 2.0", "1.5 < min(plain)", "0.95 < r[\"ratio\"] < 1.05"):
        assert bound in cell.source, bound
    exec(cell.source, {"reference": __import__("ddp_helpers.reference", fromlist=["load"])})
