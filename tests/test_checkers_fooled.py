"""Answers made to fool the exercise checkers: each is wrong, and each checker must say so.

What a rank returns reaches the kernel as plain data (numbers, strings, tensors, and lists, tuples
and dicts of them), converted inside the rank: an object whose `==` says yes, a tensor subclass whose
`!=` says no, or an object whose unpickling would run code in the kernel is judged by its data or
named, and runs nothing in the kernel. Each checker also runs a case drawn at random when it is
called, so an answer that looks the public cases up is caught.
"""
import os

import pytest
import torch
import torch.distributed as dist
from checker_cases import decisive

from ddp_helpers import exercises, solutions
from ddp_helpers.exercises import ddp_cifar10, runner
from ddp_helpers.exercises.verdict import Verdict, difference


# ---- an object whose __eq__ says yes ------------------------------------------------------------
class EqualToAnything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


def equal_to_any_square():
    return EqualToAnything()


def test_an_object_equal_to_anything_is_not_a_square():
    with decisive((2,)):
        verdict = exercises.check_rank_squares(equal_to_any_square)
    assert not verdict, repr(verdict)
    assert "world_size=2, rank 0: expected 0, got an EqualToAnything object" in repr(verdict), repr(verdict)


def test_difference_compares_exact_types_only():
    """The one comparison: `==` only between plain numbers and strings, `torch.equal` only between
    plain tensors; anything else differs, whatever its own `==` or `!=` says."""
    assert difference(9, EqualToAnything()) is not None
    assert difference([torch.ones(2)], [NeverDifferent(torch.zeros(2))]) is not None
    assert difference(torch.ones(2), NeverDifferent(torch.zeros(2))) is not None
    assert difference(9, 9) is None and difference(9, 9.0) is None and difference(torch.ones(2), torch.ones(2)) is None
    assert difference(1, True) is not None   # a bool is not a number of ranks


# ---- a tensor subclass whose != says "nowhere" --------------------------------------------------
class NeverDifferent(torch.Tensor):
    def __ne__(self, other):
        return torch.zeros(self.shape, dtype=torch.bool)

    def __eq__(self, other):
        return torch.ones(self.shape, dtype=torch.bool)

    __hash__ = torch.Tensor.__hash__


def ring_messages_then_own_data(t):
    """The reference ring's messages (so the traffic is right), then this rank's own tensor, dressed
    as a tensor that is never different from anything."""
    solutions.ring_all_reduce(t.clone())
    return t.as_subclass(NeverDifferent)


def test_a_tensor_subclass_that_is_never_different_is_judged_by_its_data():
    with decisive((2, 1)):
        verdict = exercises.check_ring_all_reduce(ring_messages_then_own_data)
    assert not verdict, repr(verdict)
    assert "world_size=2, length=1, rank 0: element 0: expected 100, got 0" in repr(verdict), repr(verdict)


# ---- an object that runs code in the kernel when it is unpickled --------------------------------
KERNEL_PID = os.getpid()


def _always_correct(self):
    return Verdict(self.title, [])


def _replace_the_verdict(value):
    """Run where the object is unpickled: from then on every checker says ✅ (as the issue found)."""
    if os.getpid() == KERNEL_PID:
        runner.Checker.verdict = _always_correct
    return value


class RunsCodeWhenUnpickled:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _replace_the_verdict, (self.value,)


def square_that_runs_code_when_unpickled():
    return RunsCodeWhenUnpickled(dist.get_rank() ** 2 + 1)


class _TextThatRunsCode(str):
    def __reduce__(self):
        return _replace_the_verdict, (str(self),)


class _ErrorWithCode(Exception):
    def __str__(self):
        return _TextThatRunsCode("no square today")


def error_whose_message_runs_code_when_unpickled():
    raise _ErrorWithCode()


def square_after_patching_the_ranks_pickler():
    """Plain data, but this rank's pickler is changed to wrap whatever it writes in the payload."""
    import cloudpickle
    real = cloudpickle.dumps
    cloudpickle.dumps = lambda value, *args, **kwargs: real(RunsCodeWhenUnpickled(value), *args, **kwargs)
    return dist.get_rank() ** 2 + 1


@pytest.fixture
def real_verdict(monkeypatch):
    """Checker.verdict as it is now; put back after the test, whatever the test did to it."""
    real = runner.Checker.verdict
    monkeypatch.setattr(runner.Checker, "verdict", real)
    return real


@pytest.mark.parametrize("fn, message", [
    (square_that_runs_code_when_unpickled, "world_size=2, rank 0: expected 0, got a RunsCodeWhenUnpickled object"),
    (error_whose_message_runs_code_when_unpickled, "raised _ErrorWithCode: no square today"),   # both ranks raise
    (square_after_patching_the_ranks_pickler, "world_size=2: the ranks sent something other than plain data"),
])
def test_nothing_a_rank_returns_runs_in_the_kernel(real_verdict, fn, message):
    with decisive((2,)):
        verdict = exercises.check_rank_squares(fn)
    assert runner.Checker.verdict is real_verdict, "the rank's object ran code in the kernel"
    assert not verdict and message in repr(verdict), repr(verdict)
    assert exercises.check_rank_squares(solutions.my_square)          # later checks judge as before
    with decisive((4,)):
        wrong = exercises.check_rank_squares(lambda: dist.get_rank() * 2)
    assert not wrong and "world_size=4, rank 3: expected 9, got 6" in repr(wrong), repr(wrong)


# ---- answers that look the public cases up -------------------------------------------------------
def slowest_from_the_public_cases(seconds):
    """One all_reduce for show, then the answer looked up in SLOWEST_RANK_CASES by this rank's time."""
    dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.MAX)
    mine, rank, n = seconds.item(), dist.get_rank(), dist.get_world_size()
    for case in exercises.SLOWEST_RANK_CASES:
        times = torch.tensor(case, dtype=torch.float32).tolist()
        if len(times) == n and times[rank] == mine:
            return max(times), times.index(max(times))
    return mine, rank


def ring_messages_then_the_public_formula(t):
    """The ring's messages for show, then the sum of the ranks' tensors as the checker makes them."""
    solutions.ring_all_reduce(t.clone())
    return sum(torch.arange(len(t), dtype=torch.float32) + 100 * r for r in range(dist.get_world_size()))


def mean_loss_from_the_public_losses(loss):
    """The checker gives rank r the loss 1 + r: the mean is (n + 1) / 2, with a collective for show."""
    dist.all_reduce(torch.zeros(1))
    mean = (dist.get_world_size() + 1) / 2
    if dist.get_rank() == 0:
        print(mean)
    return mean


def accuracy_from_the_public_truth(correct, n_images):
    """One all_reduce of two counts for show, then the accuracy of the checker's own fixed truth."""
    dist.all_reduce(torch.zeros(2))
    return int(ddp_cifar10._truth(n_images).sum()) / n_images


_PUBLIC_STEPS = {case: solutions.steps_per_epoch(*case) for case in ddp_cifar10._STEP_CASES}


def steps_from_a_table(n_images, batch_per_rank, world_size):
    return _PUBLIC_STEPS.get((n_images, batch_per_rank, world_size), 0)


@pytest.mark.parametrize("check, fn, message", [
    (exercises.check_slowest_rank, slowest_from_the_public_cases, "(a case drawn at random now), rank "),
    (exercises.check_ring_all_reduce, ring_messages_then_the_public_formula, "(a case drawn at random now), rank "),
    (exercises.check_mean_loss, mean_loss_from_the_public_losses, "(a case drawn at random now), rank 0: expected "),
    (exercises.check_exact_accuracy, accuracy_from_the_public_truth, "(a case drawn at random now), rank 0: expected "),
    (exercises.check_steps_per_epoch, steps_from_a_table, "(a case drawn at random now): expected "),
])
def test_an_answer_that_looks_up_the_public_cases_fails_a_case_drawn_now(check, fn, message):
    verdict = check(fn)
    assert not verdict and all(message in problem for problem in verdict.problems), repr(verdict)


def test_a_plain_launchs_error_record_runs_nothing_in_the_kernel(real_verdict):
    """Not only checkers: a rank's error reaches the kernel as exact strings, so an exception whose
    str() is a str subclass with a __reduce__ is read as its text."""
    from ddp_helpers import launch
    from ddp_helpers.launcher import WorkerError
    with pytest.raises(WorkerError, match="no square today"):
        launch(error_whose_message_runs_code_when_unpickled, 2, quiet=True)
    assert runner.Checker.verdict is real_verdict, "the rank's error record ran code in the kernel"
