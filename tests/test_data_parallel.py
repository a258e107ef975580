"""Notebook 05's claims, as tests: hand-averaged and DDP training equal one process."""
import matplotlib
import torch

from ddp_helpers import exercises, launch, plots, solutions
from ddp_helpers.data_parallel import (ddp_timeline, ddp_training, hand_averaged_training, no_sync_gradients,
                                       single_process_training)

matplotlib.use("Agg")


def test_hand_averaged_and_ddp_training_equal_one_process():
    grads, params = single_process_training(steps=4)
    for trainer in (hand_averaged_training, ddp_training):
        for first_grads, final_params in launch(trainer, 2, args=(4,)):
            assert torch.allclose(first_grads, grads, atol=1e-6)
            assert torch.allclose(final_params, params, atol=1e-5)


def test_ddp_overlaps_all_reduce_with_backward_in_small_buckets():
    small, large = launch(ddp_timeline, 2, args=(1,))[0], launch(ddp_timeline, 2, args=(100,))[0]
    assert len(small["all_reduces_ms"]) > len(large["all_reduces_ms"]) >= 1
    first_start = small["all_reduces_ms"][0][0]
    assert first_start < small["backward_ms"], "the first bucket is reduced while backward still runs"
    plots.overlap_timeline([small, large])
    matplotlib.pyplot.close("all")


def test_no_sync_skips_the_all_reduce_until_the_last_micro_batch():
    (inside0, after0), (inside1, after1) = launch(no_sync_gradients, 2)
    assert not torch.allclose(inside0, inside1), "inside no_sync each rank keeps its own gradients"
    assert torch.allclose(after0, after1), "the last backward outside no_sync averages the accumulated sums"


def test_average_gradients_checker():
    assert exercises.check_average_gradients(solutions.average_gradients)
    def sum_not_mean(model):
        import torch.distributed as dist
        for p in model.parameters():
            dist.all_reduce(p.grad)
    verdict = exercises.check_average_gradients(sum_not_mean)
    assert not verdict and "sum instead of mean?" in repr(verdict)
    verdict = exercises.check_average_gradients(lambda model: None)
    assert not verdict and "ranks disagree with each other" in repr(verdict)
