"""ddp_helpers.perf_lab: notebook 07's plumbing (byte counting, throughput, its pictures)."""
import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_helpers import launch, perf_lab  # noqa: E402


def _bytes_sent(hook_name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(10, 6))                      # 66 parameters
    if hook_name:
        model.register_comm_hook(None, getattr(default_hooks, hook_name))
    before = dist.all_reduce
    with perf_lab.counting_bytes() as sent:
        model(torch.randn(4, 10)).sum().backward()
    return sum(sent), dist.all_reduce is before


def test_counting_bytes_sees_the_hooks_all_reduces_and_restores_all_reduce():
    results = launch(lambda: {name: _bytes_sent(name) for name in ("allreduce_hook", "bf16_compress_hook", None)}, 2)
    for per_rank in results:
        assert per_rank["allreduce_hook"] == (66 * 4, True)
        assert per_rank["bf16_compress_hook"] == (66 * 2, True)
        assert per_rank[None] == (0, True)          # DDP's own all-reduce runs in C++: not seen (documented)


def test_counted_throughput_counts_the_steps_after_the_warm_up():
    record = {"config": {"batch_size": 100}, "world_size": 2,
              "steps": [{"images_per_s": 1.0}] * 3 + [{"images_per_s": 400.0}, {"images_per_s": 200.0}]}
    # after 3 warm-up steps: 2 steps of 200 images, in 0.5 s and 1 s
    assert abs(perf_lab.counted_throughput(record, 3) - 400 / 1.5) < 1e-9


def test_overlap_pictures_draw_every_bucket_and_every_setting():
    runs = {"several": {"step_ms": 50.0, "ready_ms": [5.0, 10.0, 30.0], "link_ms": [(5, 20), (20, 35), (35, 48)]},
            "one": {"step_ms": 70.0, "ready_ms": [30.0], "link_ms": [(30, 68)]}}
    fig = perf_lab.overlap_timeline(runs, "title")
    ax = fig.axes[0]
    orange = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:orange")]
    assert len(orange) == 4 and [t.get_text() for t in ax.get_yticklabels()] == ["one", "several"]
    fig = perf_lab.overlap_sweep({"a": {0.1: 10.0, 1.0: 5.0}, "b": {0.1: 12.0, 1.0: 5.0}}, "title")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["a", "b"]


def test_side_by_side_prints_numbers_and_words(capsys):
    perf_lab.side_by_side("eager", 1234.4, None)
    perf_lab.side_by_side("graph", "failed: x", 99.6)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["eager", "1,234", "-"] and out[1].split() == ["graph", "failed:", "x", "100"]
