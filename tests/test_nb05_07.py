"""Notebooks 05-07: the exercise checker of notebook 06 (an exact test score from a
DistributedSampler) accepts the reference answer and names each wrong one; the padding rule the
exercise teaches holds for torch's DistributedSampler."""
import pytest
import torch
import torch.distributed as dist
from checker_cases import decisive

from ddp_helpers import exercises, solutions
from ddp_helpers.exercises import ddp_cifar10


def _real(correct, n_images):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return rank + world_size * torch.arange(len(correct)) < n_images


def counts_the_padding(correct, n_images):
    counts = torch.tensor([float(correct.sum()), float(len(correct))])
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def averages_the_accuracies(correct, n_images):
    real = _real(correct, n_images)
    accuracy = torch.tensor([correct[real].double().mean().item()])
    dist.all_reduce(accuracy)
    return (accuracy / dist.get_world_size()).item()


def two_all_reduces(correct, n_images):
    real = _real(correct, n_images)
    right, scored = torch.tensor([float(correct[real].sum())]), torch.tensor([float(real.sum())])
    dist.all_reduce(right)
    dist.all_reduce(scored)
    return (right / scored).item()


def no_collective(correct, n_images):
    real = _real(correct, n_images)
    return correct[real].double().mean().item()


def reduce_to_rank_0(correct, n_images):
    real = _real(correct, n_images)
    counts = torch.tensor([float(correct[real].sum()), float(real.sum())])
    dist.reduce(counts, dst=0)
    return (counts[0] / counts[1]).item()


def all_gather_counts(correct, n_images):
    real = _real(correct, n_images)
    counts = torch.tensor([float(correct[real].sum()), float(real.sum())])
    everyone = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, counts)
    total = sum(everyone)
    return (total[0] / total[1]).item()


def max_instead_of_sum(correct, n_images):
    real = _real(correct, n_images)
    counts = torch.tensor([float(correct[real].sum()), float(real.sum())])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return (counts[0] / counts[1]).item()


def only_rank_0_reduces(correct, n_images):
    real = _real(correct, n_images)
    counts = torch.tensor([float(correct[real].sum()), float(real.sum())])
    if dist.get_rank() == 0:
        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def returns_the_counts(correct, n_images):
    real = _real(correct, n_images)
    counts = torch.tensor([float(correct[real].sum()), float(real.sum())])
    dist.all_reduce(counts)
    return counts


def still_a_stub(correct, n_images):
    raise NotImplementedError("Try it")


def test_the_padding_rule_holds_for_torchs_sampler():
    """Rank r's j-th sample is position r + j*W of the padded order; from n on, repeats."""
    for n, world_size, shuffle in [(10, 4, False), (11, 3, True), (9, 2, True), (12, 3, True), (5, 8, True)]:
        shares = [ddp_cifar10.sampler_share(n, world_size, r, shuffle) for r in range(world_size)]
        real = [i for r, share in enumerate(shares) for j, i in enumerate(share) if r + j * world_size < n]
        assert sorted(real) == list(range(n))       # each image exactly once
        assert sum(map(len, shares)) - len(real) == -n % world_size


def test_exact_accuracy_checker_accepts_the_solution():
    verdict = exercises.check_exact_accuracy(solutions.exact_accuracy)
    assert verdict, repr(verdict)


@pytest.mark.parametrize("wrong, message", [
    (counts_the_padding, "the sampler repeats 2 image(s) to give every rank 3; count only positions"),
    (averages_the_accuracies, "that is the mean of the ranks' own accuracies"),
    (two_all_reduces, "2 all_reduce calls: put both counts in one tensor"),
    (no_collective, "no collective was called"),
    (reduce_to_rank_0, "dist.reduce leaves the sum on one rank only"),
    (all_gather_counts, "you called dist.all_gather"),
    (max_instead_of_sum, "all_reduce with op=MAX"),
    (only_rank_0_reduces, "Does every rank call the same collectives?"),
    (returns_the_counts, "expected the accuracy as a number (a float)"),
    (still_a_stub, "still raises NotImplementedError"),
], ids=lambda x: getattr(x, "__name__", "message"))
def test_exact_accuracy_checker_names_each_wrong_answer(wrong, message):
    with decisive((10, 4)):
        verdict = exercises.check_exact_accuracy(wrong)
    assert not verdict and message in repr(verdict), repr(verdict)


def test_exact_accuracy_checker_refuses_what_is_not_a_function():
    verdict = exercises.check_exact_accuracy(0.5)
    assert not verdict and "expected a function exact_accuracy(correct, n_images)" in repr(verdict)


# ------------------------------------------------------------------ facts notebooks 05-07 state
def test_high_priority_streams_are_what_notebook_07_says_in_the_installed_torch():
    """07: TORCH_NCCL_HIGH_PRIORITY is read by ProcessGroupNCCL, and init_process_group's docstring
    names the option is_high_priority_stream (the .cpp that ORs the two is not in the wheel)."""
    import inspect
    import os
    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "distributed", "c10d",
                          "ProcessGroupNCCL.hpp")
    if os.path.exists(header):   # wheels ship the headers; a stripped install may not
        assert '"TORCH_NCCL_HIGH_PRIORITY"' in open(header).read()
    assert "is_high_priority_stream" in inspect.getdoc(dist.init_process_group)


def test_notebooks_05_to_07_name_the_buffer_sync_as_the_installed_torch_does():
    """DDP's forward_sync_buffers (broadcast_buffers before torch 2.13): no code or output of 07 shows
    the old name; 05 says DDP sends rank 0's buffers at the start of a forward, and 06 when (before any forward
    that follows a training forward: _post_forward leaves require_forward_param_sync set)."""
    import inspect
    import os

    import nbformat
    from conftest import REPO
    from torch.nn.parallel import DistributedDataParallel as DDP
    nb = lambda name: nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        for cell in nb("07_performance_lab.ipynb").cells:
            outputs = "".join(str(o) for o in cell.get("outputs", []))
            assert "broadcast_buffers" not in cell.source + outputs
    text_05 = " ".join(c.source for c in nb("05_data_parallel.ipynb").cells).replace("\n", " ")
    assert "broadcasts rank 0's buffers to every rank at the start of each forward" in text_05
    assert "`forward_sync_buffers` since torch 2.13" in text_05
    text_06 = " ".join(c.source for c in nb("06_ddp_cifar10.ipynb").cells).replace("\n", " ")
    assert "before any forward that follows a training forward" in text_06
