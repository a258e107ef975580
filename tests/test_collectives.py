"""The teaching helpers of notebooks 02 and 03: probe, recorded ring, ping-pong, pictures."""
import matplotlib
import pytest
import torch
import torch.distributed as dist

from ddp_helpers import launch, plots, reference
from ddp_helpers.collectives import ping_pong, probe_support, ring_all_reduce_steps

matplotlib.use("Agg")


def ring_of_powers():
    n = dist.get_world_size()
    return ring_all_reduce_steps(torch.full((n,), 10.0 ** dist.get_rank()))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_recorded_ring_sums_and_records_every_step(world_size):
    out = launch(ring_of_powers, world_size)
    total = sum(10.0 ** r for r in range(world_size))
    for result, snapshots in out:
        assert torch.equal(result, torch.full((world_size,), total))
        assert len(snapshots) == 2 * (world_size - 1) + 1
    # after the reduce-scatter, rank r owns the full sum of chunk r + 1
    for rank, (_, snapshots) in enumerate(out):
        assert snapshots[world_size - 1][(rank + 1) % world_size].item() == total


def test_recorded_ring_handles_lengths_the_world_size_does_not_divide():
    def uneven():
        return ring_all_reduce_steps(torch.arange(7.0) * (dist.get_rank() + 1))[0]
    for result in launch(uneven, 3):
        assert torch.equal(result, torch.arange(7.0) * 6)


def test_probe_finds_everything_on_gloo_cpu_and_reports_refusals():
    found = launch(probe_support, 2)[0]
    # Gloo's list form of all_to_all is missing in torch 2.11 ("does not support alltoall"), there in 2.14
    assert found.pop("all_to_all") in ("✓", "✘ RuntimeError")
    assert found and all(v == "✓" for v in found.values()), found
    # an op that raises is reported, op by op, and the probe carries on: tensors on a GPU that does
    # not exist make every op but barrier (which takes no tensor) raise, with or without GPUs here
    refused = launch(probe_support, 2, args=("cuda:1000",))[0]
    assert set(refused) == set(found) | {"all_to_all"}
    assert all(v.startswith("✘") for op, v in refused.items() if op != "barrier"), refused
    # meta tensors are no refusal: c10d accepts them and moves nothing (torch 2.11 and 2.14). An
    # older probe called them refused on machines without a GPU only, where its synchronize raised.
    assert set(launch(probe_support, 2, args=("meta",))[0].values()) == {"✓"}


def test_probe_skips_what_it_is_told_to():
    found = launch(probe_support, 2, kwargs={"skip": ("send / recv",)})[0]
    assert found["send / recv"] == "not probed" and found["broadcast"] == "✓"


def test_ping_pong_times_every_size_on_ranks_0_and_1_only():
    out = launch(ping_pong, 3, args=([1, 1024, 65536],), kwargs={"iters": 5, "warmup": 1})
    assert out[2] is None
    assert [size for size, _ in out[0]] == [1, 1024, 65536]
    assert all(us > 0 for _, us in out[0])


def test_show_ranks_draws_one_row_per_rank_and_a_column_per_stage():
    per_rank = [(torch.arange(4.0) + 10 * r, torch.arange(8.0) if r == 0 else None) for r in range(3)]
    fig = plots.show_ranks(per_rank, "test", stages=("before", "after"))
    assert len(fig.axes) == 6 and fig.axes[0].get_title() == "before"
    texts = [t.get_text() for t in fig.axes[3].texts]  # rank 1, "after": no tensor
    assert texts == ["—"]
    matplotlib.pyplot.close("all")


def test_show_ranks_colours_by_source_rank():
    per_rank = [(torch.arange(4.0) + 10 * r, [torch.arange(4.0) + 10 * j for j in range(3)]) for r in range(3)]
    fig = plots.show_ranks(per_rank, "test", colour_by="source")
    assert [t.get_text() for t in fig.legends[0].texts] == ["from rank 0", "from rank 1", "from rank 2"]
    # rank 1's "before" is all from rank 1: one colour, that of rank 1 in the legend
    image = fig.axes[2].images[0]
    assert image.get_array().tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert plots.source_rank(23) == 2 and plots.source_rank(301) == 0
    matplotlib.pyplot.close("all")


def test_ring_strip_fits_a_notebook_in_two_rows():
    snapshots = [s for _, s in launch(ring_of_powers, 4)]
    fig = plots.ring_all_steps(snapshots)
    assert fig.get_figwidth() <= 9.5  # a notebook's width at 100 dpi, about 9-10 inches
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert titles == ["start"] + [f"reduce-scatter step {i}/3" for i in (1, 2, 3)] + \
        [f"all-gather step {i}/3" for i in (1, 2, 3)]
    matplotlib.pyplot.close("all")


def test_ring_pictures_show_contributors():
    snapshots = [s for _, s in launch(ring_of_powers, 3)]
    ax = plots.draw_ring_step(snapshots, 2)
    assert ax.get_title() == "step 2/4: reduce-scatter step 2/2"
    labels = sorted(t.get_text() for t in ax.texts)
    assert "111" in labels
    stepper = plots.ring_stepper(snapshots)
    assert stepper.children[0].max == 4
    matplotlib.pyplot.close("all")


def test_plotting_functions_return_their_figure_and_show_nothing(monkeypatch):
    """One idiom: a library function draws and returns the figure; the notebook shows it (at the cell's end,
    or with plt.show()), once."""
    from matplotlib.figure import Figure

    from ddp_helpers import parallel_plots, pipeline_plots
    monkeypatch.setattr(matplotlib.pyplot, "show", lambda *args, **kwargs: pytest.fail("a library function showed"))
    per_rank = [(torch.arange(4.0) + 10 * r, torch.arange(4.0) * 3 + 30) for r in range(3)]   # after: the sum
    snapshots = [[[torch.full((1,), 10.0 ** r)] * 3] * 5 for r in range(3)]
    timeline = {"bucket": [{"backward_ms": 5.0, "gradients_ms": [1.0, 4.0], "all_reduces_ms": [(4.0, 6.0)]}]}
    actions = [[("F", 0, 0, 0.0, 0.001), ("B", 0, 0, 0.002, 0.003)]]
    figures = [plots.show_ranks(per_rank, "t"), plots.show_contributions(per_rank, "t"),
               plots.ring_all_steps(snapshots), plots.overlap_timeline(timeline["bucket"]),
               plots.image_grid(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]), ["a", "b"]),
               parallel_plots.show_placements([[torch.ones(1, 2) * 10 ** r] for r in range(2)], ["Shard(0)"], "t"),
               parallel_plots.activation_bars({"one": {"x": 1024.0}}, "t"),
               pipeline_plots.timelines({"run": actions}), pipeline_plots.ring_blocks(2)]
    assert all(isinstance(fig, Figure) for fig in figures), figures
    matplotlib.pyplot.close("all")


def test_reference_files_round_trip_and_label(tmp_path):
    rows = [{"bytes": 8, "round_trip_us": 12.5}, {"bytes": 16, "round_trip_us": 13.0}]
    meta = {"hardware": "2x Test GPU", "interconnect": "NVLink", "torch": "2.11", "nccl": "2.28", "date": "2026-11-30"}
    reference.save("demo", rows, meta, tmp_path)
    loaded, loaded_meta = reference.load("demo", tmp_path)
    assert loaded == rows and loaded_meta == meta
    assert reference.label(meta) == "2x Test GPU, NVLink, torch 2.11, nccl 2.28 (stored, measured 2026-11-30)"


def test_one_loader_for_every_kind_of_stored_result(tmp_path):
    (tmp_path / "report.json").write_text('{"date": "2026-11-30"}')
    (tmp_path / "log.txt").write_text("NCCL INFO line\n")
    assert reference.load("report", tmp_path) == {"date": "2026-11-30"}
    assert reference.load("log.txt", tmp_path) == "NCCL INFO line\n"
    with pytest.raises(FileNotFoundError, match="no stored result 'missing': neither missing.csv nor missing.json"):
        reference.load("missing", tmp_path)
    assert "via P2P" in reference.load("bench_nccl_debug.txt")


def test_stored_gpu_references_are_real_measurements():
    rows, meta = reference.load("pingpong_nccl")
    assert "H200" in meta["hardware"] and meta["date"] and meta["torch"]
    assert len(rows) >= 5 and all(row["round_trip_us"] > 0 for row in rows)
