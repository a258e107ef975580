"""Each checker accepts the reference solution and rejects wrong answers precisely."""
import re

import torch
import torch.distributed as dist

from ddp_helpers import exercises, solutions


def still_a_stub(*args):
    raise NotImplementedError("Try it")


def test_rank_squares():
    assert exercises.check_rank_squares(solutions.my_square)
    verdict = exercises.check_rank_squares(lambda: dist.get_rank() * 2)
    assert not verdict and "world_size=4, rank 3: expected 9, got 6" in repr(verdict)


def test_parity_group_sum_accepts_the_solution():
    verdict = exercises.check_parity_group_sum(solutions.parity_group_sum)
    assert verdict and repr(verdict) == "✅ parity_group_sum: correct."


def test_parity_group_sum_rejects_a_wrong_answer_precisely():
    def whole_world_sum():
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t)  # forgot the subgroup
        return int(t.item())
    verdict = exercises.check_parity_group_sum(whole_world_sum)
    assert not verdict and "world_size=2, rank 0: expected 0, got 1" in repr(verdict)


def test_stub_is_recognised():
    verdict = exercises.check_parity_group_sum(still_a_stub)
    assert not verdict and "still raises NotImplementedError" in repr(verdict)


def test_parity_group_sum_adds_the_hint_to_errors():
    def group_with_a_rank_that_does_not_exist():
        dist.new_group(list(range(dist.get_world_size() + 1)))
        return dist.get_rank()
    verdict = exercises.check_parity_group_sum(group_with_a_rank_that_does_not_exist)
    assert not verdict and "must call dist.new_group for every group" in repr(verdict)


def test_all_gather_checker():
    assert exercises.check_all_gather(solutions.my_all_gather)
    # only rank 0's data is right; the rest are zeros
    def half_done(t):
        return [t.clone() if r == dist.get_rank() else torch.zeros_like(t) for r in range(dist.get_world_size())]
    verdict = exercises.check_all_gather(half_done)
    assert not verdict and "world_size=2, length=1, rank 0: item 1: element 0: expected 100, got 0" in repr(verdict)
    cheat = exercises.check_all_gather(lambda t: dist.all_gather([torch.empty_like(t) for _ in range(2)], t))
    assert not cheat and "use send/recv, not dist.all_gather" in repr(cheat)


def test_tree_broadcast_checker():
    assert exercises.check_tree_broadcast(solutions.tree_broadcast)
    def only_first_hop(t):  # rank 0 sends to rank 1 only
        if dist.get_rank() == 0:
            dist.send(t, 1)
        elif dist.get_rank() == 1:
            dist.recv(t, 0)
        return t
    verdict = exercises.check_tree_broadcast(only_first_hop)
    assert not verdict and "world_size=3, length=4, rank 2: element 0: expected 0, got 200" in repr(verdict)


def test_ring_all_reduce_checker():
    assert exercises.check_ring_all_reduce(solutions.ring_all_reduce)
    def even_split_only(t):  # view() into equal chunks fails when the world size does not divide the length
        return solutions.ring_all_reduce(t.view(dist.get_world_size(), -1).flatten())
    verdict = exercises.check_ring_all_reduce(even_split_only)
    assert not verdict and re.search(r"world_size=2, length=1: rank [01] raised RuntimeError", repr(verdict))
    def deadlocks(t):  # every rank receives first: nobody sends
        dist.recv(t, src=(dist.get_rank() - 1) % dist.get_world_size())
        return t
    verdict = exercises.check_ring_all_reduce(deadlocks)
    assert not verdict and "never finished" in repr(verdict)
    assert not exercises.check_ring_all_reduce(still_a_stub)


def test_busbw_checker():
    assert exercises.check_busbw(solutions.my_busbw)
    def forgot_the_factor(collective, nbytes, time_us, world_size):
        return nbytes / (time_us * 1e-6) / 1e9
    verdict = exercises.check_busbw(forgot_the_factor)
    assert not verdict and "all_reduce, 1048576 B in 100.0 µs on 2 ranks" not in repr(verdict)  # factor 1 there
    assert "all_reduce, 1073741824 B in 3273.0 µs on 8 ranks: expected 574.1058 GB/s" in repr(verdict)
    assert "that is the algbw" in repr(verdict)
    assert not exercises.check_busbw(still_a_stub)


def test_steps_per_epoch_checker():
    assert exercises.check_steps_per_epoch(solutions.steps_per_epoch)
    verdict = exercises.check_steps_per_epoch(lambda n, b, w: n // (b * w))  # forgets the padding
    assert not verdict and "998 images, 111 per rank, 3 ranks: expected 3 steps, got 2" in repr(verdict)
    verdict = exercises.check_steps_per_epoch(lambda n, b, w: n // b)  # forgets the ranks
    assert not verdict and "10000 images, 128 per rank, 2 ranks: expected 39 steps, got 78" in repr(verdict)


def test_torchrun_command_checker():
    assert exercises.check_torchrun_command(solutions.torchrun_command)
    stub = exercises.check_torchrun_command("torchrun ...")
    assert not stub and "still the stub" in repr(stub)
    per_job = exercises.check_torchrun_command(
        "torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node01:29500 "
        "--max-restarts=3 -m ddp_helpers.train --checkpoint ckpt/epoch-{epoch}.pt --resume auto")
    assert not per_job and len(per_job.problems) == 2
    assert "--nproc-per-node should be 4 (one process per GPU), got 8: it counts the processes on each node" in repr(per_job)
    assert "leave out --node-rank: with c10d torchrun ignores it" in repr(per_job)
    standalone = exercises.check_torchrun_command("torchrun --standalone --nproc-per-node=4 -m ddp_helpers.train")
    assert "--standalone is for one node only" in repr(standalone) and "--rdzv-backend should be c10d" in repr(standalone)
    misplaced = exercises.check_torchrun_command(
        "torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node01:29500 --max-restarts=3 "
        "--resume auto -m ddp_helpers.train --checkpoint ckpt/epoch-{epoch}.pt")
    assert "unrecognized arguments: --resume" in repr(misplaced)
    old = exercises.check_torchrun_command("python -m torch.distributed.launch --nproc_per_node=4 train.py")
    assert not old and "deprecated: use torchrun" in repr(old)
    rank_list = exercises.check_torchrun_command("RANK=0,1 torchrun --nproc-per-node=2 -m ddp_helpers.train")
    assert "torchrun sets RANK" in repr(rank_list)
