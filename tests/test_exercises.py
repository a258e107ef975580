"""Each checker accepts the reference solution and rejects wrong answers."""
import torch
import torch.distributed as dist

from ddp_helpers import exercises, solutions


def whole_world_sum():
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)  # forgot the subgroup
    return int(t.item())


def still_a_stub():
    raise NotImplementedError("Try it")


def test_parity_group_sum_accepts_the_solution():
    verdict = exercises.check_parity_group_sum(solutions.parity_group_sum)
    assert verdict and repr(verdict) == "✅ parity_group_sum: correct."


def test_parity_group_sum_rejects_a_wrong_answer_precisely():
    verdict = exercises.check_parity_group_sum(whole_world_sum)
    assert not verdict
    assert "world_size=2, rank 0: expected 0, got 1" in repr(verdict)


def test_parity_group_sum_recognises_the_stub():
    verdict = exercises.check_parity_group_sum(still_a_stub)
    assert not verdict and "still raises NotImplementedError" in repr(verdict)


def test_parity_group_sum_explains_a_hang():
    def each_rank_creates_only_its_own_group():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = dist.new_group(list(range(rank % 2, world_size, 2)))
        t = torch.tensor([rank])
        dist.all_reduce(t, group=mine)
        return int(t.item())
    verdict = exercises.check_parity_group_sum(each_rank_creates_only_its_own_group)
    assert not verdict and "must call dist.new_group for every group" in repr(verdict)


def test_rank_squares():
    assert exercises.check_rank_squares(solutions.my_square)
    verdict = exercises.check_rank_squares(lambda: dist.get_rank() * 2)
    assert not verdict and "world_size=4, rank 3: expected 9, got 6" in repr(verdict)
