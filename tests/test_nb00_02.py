"""Notebooks 00-02: the checker of 00's exercise (accepts the reference answer, rejects wrong answers
and names what is wrong), the ping-pong timing of 02 and its plot."""
import time

import matplotlib
import pytest
import torch
import torch.distributed as dist
from checker_cases import decisive

from ddp_helpers import exercises, launch, plots, solutions

matplotlib.use("Agg")


# ---- notebook 00: the slowest rank, with all_reduce ---------------------------------------------

def test_slowest_rank_accepts_the_solution():
    verdict = exercises.check_slowest_rank(solutions.slowest_rank)
    assert verdict, verdict
    assert "correct" in repr(verdict)


def test_slowest_rank_accepts_one_all_reduce_of_every_time():
    def one_slot_each(seconds):
        times = torch.zeros(dist.get_world_size())
        times[dist.get_rank()] = seconds
        dist.all_reduce(times)                     # SUM: every rank's time in its own slot
        slowest = int(times.argmax())              # argmax: the first of equal values
        return times[slowest].item(), slowest
    assert exercises.check_slowest_rank(one_slot_each)


def test_slowest_rank_names_a_stub():
    def stub(seconds):
        raise NotImplementedError("Try it")
    with decisive((0.25, 0.75)):
        verdict = exercises.check_slowest_rank(stub)
    assert not verdict and "still raises NotImplementedError" in repr(verdict)


def test_slowest_rank_rejects_no_communication():
    with decisive((0.25, 0.75)):
        verdict = exercises.check_slowest_rank(lambda seconds: (seconds.item(), dist.get_rank()))
    assert not verdict
    assert "no rank called a collective" in repr(verdict)


def test_slowest_rank_rejects_a_sum():
    def summed(seconds):
        t = seconds.clone()
        dist.all_reduce(t)                         # SUM, not MAX
        return t.item(), 0
    with decisive((0.25, 0.75)):
        verdict = exercises.check_slowest_rank(summed)
    assert not verdict
    assert "expected the slowest time 0.75, got 1" in repr(verdict) and "ReduceOp.MAX" in repr(verdict)


def test_slowest_rank_rejects_gathering_everything():
    def gathered(seconds):
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, seconds.item())
        slowest = max(every)
        return slowest, every.index(slowest)
    with decisive((0.25, 0.75)):
        verdict = exercises.check_slowest_rank(gathered)
    assert not verdict
    assert "dist.all_gather_object: use dist.all_reduce only" in repr(verdict)


def test_slowest_rank_names_a_rank_that_names_itself():
    def itself(seconds):
        t = seconds.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item(), dist.get_rank()
    with decisive((0.25, 0.75)):
        verdict = exercises.check_slowest_rank(itself)
    assert not verdict
    assert "rank 0: the time is right, but the slowest rank is 1, not 0 (its own rank number)" in repr(verdict)


def test_slowest_rank_wants_the_lowest_rank_on_a_tie():
    def highest_on_a_tie(seconds):
        t = seconds.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        who = torch.tensor([dist.get_rank() if bool(seconds == t) else -1])
        dist.all_reduce(who, op=dist.ReduceOp.MAX)  # the highest of the tied ranks
        return t.item(), int(who)
    verdict = exercises.check_slowest_rank(highest_on_a_tie)
    assert not verdict
    text = repr(verdict)
    assert "seconds=[0.3, 0.9, 0.2, 0.9]" in text and "slowest rank is 1, not 3" in text
    assert "return the lowest of them" in text
    assert text.count("   - ") == 1                # the other cases passed


def test_slowest_rank_rejects_three_calls():
    def three(seconds):
        t = seconds.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return solutions.slowest_rank(seconds)
    with decisive((0.25, 0.75)):
        verdict = exercises.check_slowest_rank(three)
    assert not verdict and "called dist.all_reduce 4 times" in repr(verdict)


def test_slowest_rank_names_a_collective_only_one_rank_calls():
    def only_rank_0(seconds):
        t = seconds.clone()
        if dist.get_rank() == 0:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item(), 0
    started = time.monotonic()
    with decisive((0.25, 0.75), (0.5, 0.125, 0.375)):
        verdict = exercises.check_slowest_rank(only_rank_0)
    assert not verdict
    assert "Every rank must call every collective" in repr(verdict)
    assert time.monotonic() - started < 120     # stuck once, not once per case


def test_the_old_exercise_of_00_still_checks():
    assert exercises.check_rank_squares(solutions.my_square)
    with decisive((2,)):
        assert not exercises.check_rank_squares(lambda: dist.get_rank() * 2)


# ---- notebook 02: ping-pong ---------------------------------------------------------------------

def _ping_pong_with_a_burst(sizes, burst, pause):
    """ping_pong on ranks 0 and 1, where rank 0's sends number `burst` (from 1: one per round trip)
    each wait `pause` seconds first, as if the machine were busy with other work for a moment."""
    from ddp_helpers.collectives import ping_pong
    real, count = dist.send, [0]

    def send(*args, **kwargs):
        count[0] += 1
        if dist.get_rank() == 0 and count[0] in burst:
            time.sleep(pause)
        return real(*args, **kwargs)

    dist.send = send
    try:
        return ping_pong(sizes, iters=9, warmup=1)
    finally:
        dist.send = real


def test_a_busy_moment_does_not_make_a_spike_in_the_ping_pong_curve():
    # Five round trips in a row wait 0.3 s. Timed size by size, they would be 5 of size 1's 9 (a
    # spike); timed in rounds of every size, they hit each size at most twice, which the median skips.
    sizes, pause = [1, 1024, 65536], 0.3
    rows = launch(_ping_pong_with_a_burst, 2, args=(sizes, range(3, 8), pause), timeout=120)[0]
    assert [size for size, _ in rows] == sizes
    assert all(0 < us < pause / 2 * 1e6 for _, us in rows), rows


def test_ping_pong_legend_covers_no_point():
    live = "Gloo, CPU processes, this machine now: torch 2.14.1+cu130, 2 cores, load 9.9 (busy)"
    ax = plots.latency_plot([(1, 50.0), (4 * 2**20, 4000.0)], live)   # notebook 02's longest labels
    plots.latency_plot([(1, 60.0), (4 * 2**20, 80.0)], "NCCL: 2x NVIDIA H200, NVLink, a long stored label", ax)
    ax.figure.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.y1 <= axes.y0, (legend, axes)    # below the axes, so over no point
    matplotlib.pyplot.close("all")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
