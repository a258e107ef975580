"""ddp_helpers.perf_lab, notebook 07's plumbing (byte counting, throughput), and speed_plots, its pictures."""
import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_helpers import launch, perf_lab, speed_plots  # noqa: E402


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
    fig = speed_plots.overlap_timeline(runs, "title")
    ax = fig.axes[0]
    orange = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:orange")]
    assert len(orange) == 4 and [t.get_text() for t in ax.get_yticklabels()] == ["one", "several"]
    runs["one"]["last_ms"] = 69.0                  # the black line: that step's end, not the median
    ends = speed_plots.overlap_timeline(runs, "title").axes[0].collections[-1].get_segments()
    assert ends[0][0][0] == 69.0
    fig = speed_plots.overlap_sweep({"a": {0.1: 10.0, 1.0: 5.0}, "b": {0.1: 12.0, 1.0: 5.0}}, "title",
                                    model={"a, model": {0.1: 9.0, 1.0: 4.0}})
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["a", "b", "a, model"]
    assert fig.axes[0].get_lines()[2].get_linestyle() == "--"


def _over_a_slow_link():
    torch.set_num_threads(1)
    make = lambda: torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    return perf_lab.buckets_over_link(make, torch.randn(256, 128), caps=(0.05, 100), GBps=0.005, steps=3)


def test_buckets_over_a_simulated_link_overlap_and_the_real_average_is_apart():
    """4 buckets leave during backward, one after it; 264 kB at 5 MB/s is about 53 ms on the link
    (sleeping: no CPU), which the one-bucket step pays after its computation."""
    for out in launch(_over_a_slow_link, 2):
        several, one = out["runs"][0.05], out["runs"][100]
        assert len(several["link_ms"]) == 4 and len(one["link_ms"]) == 1
        assert several["link_ms"][0][0] < max(several["ready_ms"])     # the first leaves during backward
        assert one["link_ms"][0][0] == one["ready_ms"][0]               # the only one: when it is ready
        assert abs(out["link_ms"] - out["grad_bytes"] / 5e6 * 1e3) < 1e-6 and out["real_all_reduce_ms"] > 0
        assert one["step_ms"] >= out["link_ms"] and len(several["steps_ms"]) == 3
        assert one["wait_ms"] >= 0.9 * out["link_ms"] and several["last_ms"] == several["steps_ms"][-1]


def test_stored_caption_and_time_to_accuracy():
    report = {"machine": {"gpus": ["NVIDIA H200"] * 2, "torch": "2.11.0+cu130", "nccl": "2.28.9"},
              "date": "2026-11-30T12:00:00"}
    assert speed_plots.stored_caption(report) == "stored: 2x NVIDIA H200, torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-30"
    cpu = {"machine": {"cpu_cores": 2, "torch": "2.14.1"}, "date": "2026-12-02"}
    assert speed_plots.stored_caption(cpu) == "stored: 2 CPU cores, no GPU, torch 2.14.1, 2026-12-02"
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    assert speed_plots.accuracy_vs_seconds(ax, [("ours", 3.0, 0.1, 0.94, 0.001)]) is ax
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ours: 94.00% in 3.00 s"]
    plt.close(fig)


def test_side_by_side_prints_numbers_and_words(capsys):
    perf_lab.side_by_side("eager", 1234.4, None)
    perf_lab.side_by_side("graph", "failed: x", 99.6)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["eager", "1,234", "-"] and out[1].split() == ["graph", "failed:", "x", "100"]
