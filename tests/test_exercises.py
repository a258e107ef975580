"""Each checker accepts the reference solution and rejects wrong answers precisely."""
import re
import time

import pytest
import torch
import torch.distributed as dist
from checker_cases import decisive
from conftest import seconds

from ddp_helpers import exercises, launch, solutions
from ddp_helpers.exercises import ddp_cifar10, runner


def still_a_stub(*args):
    raise NotImplementedError("Try it")


def test_rank_squares():
    assert exercises.check_rank_squares(solutions.my_square)
    with decisive((4,)):
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
    with decisive((2,)):
        verdict = exercises.check_parity_group_sum(whole_world_sum)
    assert not verdict and "world_size=2, rank 0: expected 0, got 1" in repr(verdict)


def test_stub_is_recognised():
    with decisive((2,)):
        verdict = exercises.check_parity_group_sum(still_a_stub)
    assert not verdict and "still raises NotImplementedError" in repr(verdict)


def test_parity_group_sum_adds_the_hint_to_errors():
    def group_with_a_rank_that_does_not_exist():
        dist.new_group(list(range(dist.get_world_size() + 1)))
        return dist.get_rank()
    with decisive((2,)):
        verdict = exercises.check_parity_group_sum(group_with_a_rank_that_does_not_exist)
    assert not verdict and "must call dist.new_group for every group" in repr(verdict)


def test_all_gather_checker():
    assert exercises.check_all_gather(solutions.my_all_gather)
    # only rank 0's data is right; the rest are zeros
    def half_done(t):
        return [t.clone() if r == dist.get_rank() else torch.zeros_like(t) for r in range(dist.get_world_size())]
    with decisive((2, 1)):
        verdict = exercises.check_all_gather(half_done)
        cheat = exercises.check_all_gather(lambda t: dist.all_gather([torch.empty_like(t) for _ in range(2)], t))
    assert not verdict and "world_size=2, length=1, rank 0: item 1: element 0: expected 100, got 0" in repr(verdict)
    assert not cheat and "use send/recv, not dist.all_gather" in repr(cheat)


def test_tree_broadcast_checker():
    assert exercises.check_tree_broadcast(solutions.tree_broadcast)
    def only_first_hop(t):  # rank 0 sends to rank 1 only
        if dist.get_rank() == 0:
            dist.send(t, 1)
        elif dist.get_rank() == 1:
            dist.recv(t, 0)
        return t
    with decisive((3, 4)):
        verdict = exercises.check_tree_broadcast(only_first_hop)
    assert not verdict and "world_size=3, length=4, rank 2: element 0: expected 0, got 200" in repr(verdict)


def test_ring_all_reduce_checker(monkeypatch):
    assert exercises.check_ring_all_reduce(solutions.ring_all_reduce)
    def even_split_only(t):  # view() into equal chunks fails when the world size does not divide the length
        return solutions.ring_all_reduce(t.view(dist.get_world_size(), -1).flatten())
    with decisive((2, 1)):
        verdict = exercises.check_ring_all_reduce(even_split_only)
    assert not verdict and re.search(r"world_size=2, length=1: rank [01] raised RuntimeError", repr(verdict))
    def deadlocks(t):  # every rank receives first: nobody sends
        dist.recv(t, src=(dist.get_rank() - 1) % dist.get_world_size())
        return t
    monkeypatch.setattr(runner, "HANG_TIMEOUT_S", seconds(1.5))   # the deadlock waits this out (CI time)
    with decisive((2, 1)):
        verdict = exercises.check_ring_all_reduce(deadlocks)
        assert not verdict and "never finished" in repr(verdict)
        assert not exercises.check_ring_all_reduce(still_a_stub)


def timing(barrier=True, warm_up=True, clock_after_barrier=True, mean="sum / world size"):
    """A learner's answer to notebook 04's Try it, right by default; each argument breaks one rule."""
    def my_all_reduce_time(nbytes, iters=20, warmup=5):
        t = torch.ones(nbytes // 4)
        for _ in range(warmup if warm_up else 0):
            dist.all_reduce(t)
        if not clock_after_barrier:
            start = time.perf_counter()
        if barrier:
            dist.barrier()
        if clock_after_barrier:
            start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        seconds = (time.perf_counter() - start) / iters
        if mean == "none":
            return seconds
        if mean == "all calls":                      # forgot to divide by iters
            seconds *= iters
        total = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(total)
        if mean == "sum":
            return total.item()
        if mean == "sum / 2":                        # the world size written as a number
            return total.item() / 2
        return total.item() / dist.get_world_size()
    return my_all_reduce_time


def test_all_reduce_timing_checker_accepts_the_solution_and_compares_the_prediction():
    measured_us = launch(solutions.my_all_reduce_time, 2, backend="gloo", args=(3 * 2**20,), quiet=True)[0] * 1e6
    # the algorithm is what these two check: a loose tolerance, as two timings on a busy machine may differ
    verdict = exercises.check_all_reduce_timing(solutions.my_all_reduce_time, measured_us, tolerance=30)
    assert verdict, repr(verdict)
    assert "measured: all_reduce of 3 MiB on 2 Gloo ranks" in repr(verdict) and "predicted:" in repr(verdict)
    beta = 3 * 2**20 / measured_us / 1e3   # GB/s: the model t = 0 + S / beta predicts the measurement
    assert exercises.check_all_reduce_timing(timing(), solutions.predicted_us(3 * 2**20, 0.0, beta), tolerance=30)
    unit_slip = exercises.check_all_reduce_timing(solutions.my_all_reduce_time, measured_us * 1e3)
    assert not unit_slip and "a unit slip? It is off by about 1e3" in repr(unit_slip), repr(unit_slip)
    missing = exercises.check_all_reduce_timing(solutions.my_all_reduce_time, None)
    assert not missing and "my_prediction_us is None: set it to the model's time" in repr(missing)


@pytest.mark.parametrize("wrong, message", [
    (dict(barrier=False), "world_size=2, rank 0: no dist.barrier() before the timed calls"),
    (dict(warm_up=False), "world_size=2, rank 0: no warm-up: no all_reduce before dist.barrier()"),
    (dict(clock_after_barrier=False), "the clock starts before dist.barrier()"),
    (dict(mean="none"), "world_size=2: the ranks returned different times"),
    (dict(mean="sum"), "world_size=2: you returned the sum of the ranks' times"),
    (dict(mean="sum / 2"), "world_size=3: you divided by 2, but the world size here is 3"),
    (dict(mean="all calls"), "time is for all 20 calls together"),
])
def test_all_reduce_timing_checker_names_each_wrong_answer(wrong, message):
    with decisive(3 if "world_size=3" in message else 2):
        verdict = exercises.check_all_reduce_timing(timing(**wrong), 2000.0)
    assert not verdict and message in repr(verdict), repr(verdict)


def test_all_reduce_timing_checker_recognises_the_stub():
    verdict = exercises.check_all_reduce_timing(still_a_stub, None)
    assert not verdict and "still raises NotImplementedError: fill in the stub" in repr(verdict)


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
    assert ("--nproc-per-node should be 4 (one process per GPU), got 8: it counts the processes on each node"
            in repr(per_job))
    assert "leave out --node-rank: with c10d torchrun ignores it" in repr(per_job)
    standalone = exercises.check_torchrun_command("torchrun --standalone --nproc-per-node=4 -m ddp_helpers.train")
    assert "--standalone is for one node only" in repr(standalone)
    assert "--rdzv-backend should be c10d" in repr(standalone)
    misplaced = exercises.check_torchrun_command(
        "torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node01:29500 --max-restarts=3 "
        "--resume auto -m ddp_helpers.train --checkpoint ckpt/epoch-{epoch}.pt")
    assert "unrecognized arguments: --resume" in repr(misplaced)
    old = exercises.check_torchrun_command("python -m torch.distributed.launch --nproc_per_node=4 train.py")
    assert not old and "deprecated: use torchrun" in repr(old)
    rank_list = exercises.check_torchrun_command("RANK=0,1 torchrun --nproc-per-node=2 -m ddp_helpers.train")
    assert "torchrun sets RANK" in repr(rank_list)
    # "gpu" (one process per GPU, as the SLURM file writes it) is right on these 4-GPU nodes, GPUs here or not
    per_gpu = exercises.check_torchrun_command(solutions.torchrun_command.replace("--nproc-per-node=4",
                                                                                  "--nproc-per-node=gpu"))
    assert "--nproc-per-node=gpu" in solutions.torchrun_command.replace("--nproc-per-node=4", "--nproc-per-node=gpu")
    assert per_gpu, repr(per_gpu)


# ---- notebook 05: one all-reduce for all gradients (the checker wraps dist.all_reduce in the ranks)
def _copy_back(grads, bucket):
    offset = 0
    for g in grads:
        g.copy_(bucket[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def per_parameter_average(model):  # right numbers, but one all_reduce per parameter
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def one_bucket_not_divided(model):
    grads = [p.grad for p in model.parameters()]
    bucket = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(bucket)
    _copy_back(grads, bucket)


def one_bucket_not_written_back(model):
    bucket = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(bucket)
    bucket /= dist.get_world_size()


def never_all_reduced(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def weights_only_bucket(model):  # leaves the biases out of the buffer
    grads = [p.grad for p in model.parameters() if p.dim() == 2]
    bucket = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(bucket)
    bucket /= dist.get_world_size()
    _copy_back(grads, bucket)


def one_bucket_with_avg(model):
    grads = [p.grad for p in model.parameters()]
    bucket = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(bucket, op=dist.ReduceOp.AVG)
    _copy_back(grads, bucket)


def only_rank_0_writes_back(model):
    grads = [p.grad for p in model.parameters()]
    bucket = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(bucket)
    bucket /= dist.get_world_size()
    if dist.get_rank() == 0:
        _copy_back(grads, bucket)


def divided_by_two(model):
    grads = [p.grad for p in model.parameters()]
    bucket = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(bucket)
    bucket /= 2
    _copy_back(grads, bucket)


def test_one_bucket_average_accepts_the_solution_and_reduce_op_avg():
    verdict = exercises.check_one_bucket_average(solutions.average_gradients_one_bucket)
    assert verdict and repr(verdict) == "✅ average_gradients_one_bucket: correct."
    assert exercises.check_one_bucket_average(one_bucket_with_avg)


def test_one_bucket_average_rejects_one_all_reduce_per_parameter_although_the_result_is_right():
    verdict = exercises.check_one_bucket_average(per_parameter_average)
    assert not verdict and verdict.problems == [
        f"world_size={n}, rank 0: you called all_reduce 4 times (once per parameter?): flatten all gradients "
        f"into one buffer and all_reduce it once" for n in (2, 3)]


def test_one_bucket_average_names_each_wrong_answer():
    expected = {
        one_bucket_not_divided: "world_size=2, rank 0: the gradients are the sum over the ranks, not the mean: "
                                "divide the buffer by dist.get_world_size()",
        one_bucket_not_written_back: "world_size=2, rank 0: the .grad tensors still hold this rank's own gradients: "
                                     "copy the averaged buffer back into each p.grad",
        never_all_reduced: "world_size=2, rank 0: you never called dist.all_reduce",
        weights_only_bucket: "world_size=2, rank 0: your all_reduce carried 768 bytes, but the 4 gradients are "
                             "848 bytes (212 floats): not all gradients are in the buffer",
        only_rank_0_writes_back: "world_size=2: ranks disagree (rank(s) [0] right, rank 1 not): the .grad tensors "
                                 "still hold this rank's own gradients",
        divided_by_two: "world_size=3, rank 0: you divided by 2, but the world size here is 3",
    }
    for wrong, message in expected.items():
        with decisive((3 if "world_size=3" in message else 2,)):
            verdict = exercises.check_one_bucket_average(wrong)
        assert not verdict and message in repr(verdict), (wrong.__name__, repr(verdict))
    assert "divided by" not in repr(exercises.check_one_bucket_average(one_bucket_not_divided))
    with decisive((2,)):
        stub = exercises.check_one_bucket_average(still_a_stub)
    assert not stub and stub.problems == ["still_a_stub still raises NotImplementedError: fill in the stub"]


# ---- the checkers check the algorithm, not only the result (issue 17): each wrong answer below gives
# the right tensors, and each was accepted by the checkers that compared results only.
def gather_at_rank_0_and_send_back(t):
    rank, n = dist.get_rank(), dist.get_world_size()
    gathered = [t.clone() if r == rank else torch.empty_like(t) for r in range(n)]
    if rank == 0:
        for peer in range(1, n):
            dist.recv(gathered[peer], src=peer)
        for peer in range(1, n):
            for r in range(n):
                if r != peer:
                    dist.send(gathered[r], dst=peer)
    else:
        dist.send(t, dst=0)
        for r in range(n):
            if r != rank:
                dist.recv(gathered[r], src=0)
    return gathered


def ring_all_gather(t):  # another right algorithm: n-1 steps around the ring, batch_isend_irecv
    rank, n = dist.get_rank(), dist.get_world_size()
    gathered = [t.clone() if r == rank else torch.empty_like(t) for r in range(n)]
    for step in range(n - 1):
        out, into = (rank - step) % n, (rank - step - 1) % n
        ops = [dist.P2POp(dist.isend, gathered[out], (rank + 1) % n),
               dist.P2POp(dist.irecv, gathered[into], (rank - 1) % n)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return gathered


def test_all_gather_checker_rejects_gathering_at_rank_0_and_sending_back():
    assert exercises.check_all_gather(ring_all_gather)
    with decisive((4, 3)):
        verdict = exercises.check_all_gather(gather_at_rank_0_and_send_back)
    assert not verdict
    assert ("world_size=4, length=3: rank 0 sent 108 bytes in 9 messages, every other rank at most 12 (its own "
            "tensor): that is gather-to-one-rank-and-send-back") in repr(verdict), repr(verdict)
    assert "(n-1)·S = 36 bytes per rank" in repr(verdict)


def flat_broadcast(t):  # rank 0 sends to every rank itself: n-1 rounds
    t = t.clone()
    if dist.get_rank() == 0:
        for peer in range(1, dist.get_world_size()):
            dist.send(t, dst=peer)
    else:
        dist.recv(t, src=0)
    return t


def chain_broadcast(t):  # 0 -> 1 -> 2 -> ...: n-1 rounds
    rank, n = dist.get_rank(), dist.get_world_size()
    t = t.clone()
    if rank > 0:
        dist.recv(t, src=rank - 1)
    if rank < n - 1:
        dist.send(t, dst=rank + 1)
    return t


def broadcast_twice(t):  # the tree, then rank 0 sends to everybody again: right result, redundant messages
    t = solutions.tree_broadcast(t)
    return flat_broadcast(t)


def test_tree_broadcast_checker_counts_rounds_and_messages():
    with decisive((4, 3), (5, 2)):
        flat = exercises.check_tree_broadcast(flat_broadcast)
    assert not flat and ("world_size=4, length=3: 3 rounds: the longest chain of messages that wait for each other "
                         "is 0→1, then 0→2, then 0→3") in repr(flat), repr(flat)
    assert "ceil(log2 4) = 2: rank 0 sends all 3 messages itself" in repr(flat)
    assert "world_size=5, length=2: 4 rounds" in " ".join(flat.problems)
    with decisive((4, 3)):
        chain = exercises.check_tree_broadcast(chain_broadcast)
    assert not chain and "is 0→1, then 1→2, then 2→3" in repr(chain), repr(chain)
    with decisive((2, 1)):
        twice = exercises.check_tree_broadcast(broadcast_twice)
    assert not twice and ("world_size=2, length=1: rank 1 received 2 messages (8 bytes); in a broadcast each rank "
                          "but the root receives the 4-byte tensor exactly once") in repr(twice), repr(twice)


def reduce_then_broadcast(model):  # right mean, but two collectives per gradient
    for p in model.parameters():
        dist.reduce(p.grad, dst=0)
        dist.broadcast(p.grad, src=0)
        p.grad /= dist.get_world_size()


def test_one_bucket_average_rejects_other_collectives_although_the_result_is_right():
    with decisive((2,)):
        verdict = exercises.check_one_bucket_average(reduce_then_broadcast)
    assert not verdict and verdict.problems[0].startswith(
        "world_size=2, rank 0: you called dist.reduce, dist.broadcast (8 call(s)) besides 0 all_reduce(s)"), \
        repr(verdict)


def test_steps_per_epoch_checker_rejects_rounding_and_floats():
    rounded = exercises.check_steps_per_epoch(lambda n, b, w: round(n / w / b))
    assert not rounded and ("1000 images, 64 per rank, 2 ranks: expected 7 steps, got 8; each rank gets "
                            "ceil(n / world_size) = 500 images") in repr(rounded), repr(rounded)
    floats = exercises.check_steps_per_epoch(lambda n, b, w: -(-n // w) / b // 1)
    assert not floats and "expected a whole number of steps (an int), got 78.0 (float)" in repr(floats)


def test_torchrun_command_checker_asks_torchrun_for_its_settings():
    import os
    before = os.environ.get("OMP_NUM_THREADS")
    both = exercises.check_torchrun_command(solutions.torchrun_command.replace(" -m ", " --no-python -m "))
    assert not both and ("torchrun would stop before starting anything: Don't use both the '--no-python' flag "
                         "and the '--module' flag") in repr(both), repr(both)
    assert os.environ.get("OMP_NUM_THREADS") == before   # torchrun's parser sets it; the checker puts it back


# ---- notebook 12: the collective that only rank 0 called
def mean_loss_only_rank_0_reduces(loss):  # the bug in the notebook: the others never join the all_reduce
    t = torch.tensor([float(loss)])
    if dist.get_rank() == 0:
        dist.all_reduce(t)
        t /= dist.get_world_size()
        print(f"mean loss {t.item():.3f}")
    return t.item()


def mean_loss_everybody_prints(loss):
    t = torch.tensor([float(loss)])
    dist.all_reduce(t)
    t /= dist.get_world_size()
    print(f"mean loss {t.item():.3f}")
    return t.item()


def mean_loss_extra_barrier_on_rank_0(loss):  # right values, but rank 0 calls one more collective
    t = torch.tensor([float(loss)])
    dist.all_reduce(t)
    t /= dist.get_world_size()
    if dist.get_rank() == 0:
        dist.barrier(async_op=True)   # would hang the next collective of a real program
        print(f"mean loss {t.item():.3f}")
    return t.item()


def test_mean_loss_checker():
    assert exercises.check_mean_loss(solutions.mean_loss)
    with decisive((1.0, 2.0)):   # world_size=2
        hang = exercises.check_mean_loss(mean_loss_only_rank_0_reduces)
        chatty = exercises.check_mean_loss(mean_loss_everybody_prints)
        extra = exercises.check_mean_loss(mean_loss_extra_barrier_on_rank_0)
        stub = exercises.check_mean_loss(still_a_stub)
    assert not hang and "Every rank must call every collective" in repr(hang), repr(hang)
    assert not chatty and "world_size=2: rank(s) [0, 1] printed; only rank 0 should print the mean" in repr(chatty)
    assert not extra and ("world_size=2: rank 0 called ['all_reduce', 'barrier'], rank 1 called ['all_reduce']: "
                          "every rank must call the same collectives") in repr(extra), repr(extra)
    assert not stub and "still raises NotImplementedError" in repr(stub)


# ------------------------------------------------------------------ notebook 07: the fp16 compression hook
def fp16_hook_without_dividing(state, bucket):
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.float16), async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def fp16_hook_dividing_after_the_sum(state, bucket):
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.float16), async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0] / dist.get_world_size()))


def float32_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.allreduce_hook(None, bucket)


def fp16_hook_twice(state, bucket):
    buffer = bucket.buffer()
    half = (buffer / dist.get_world_size()).half()
    dist.all_reduce(half.clone())
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def fp16_hook_stub(state, bucket):
    raise NotImplementedError("Try it")


def test_fp16_compress_hook_checker_accepts_the_solution_and_pytorchs_own_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    verdict = exercises.check_fp16_compress_hook(solutions.fp16_compress)
    assert verdict, repr(verdict)
    assert exercises.check_fp16_compress_hook(default_hooks.fp16_compress_hook)


def test_fp16_compress_hook_checker_names_each_wrong_answer():
    with decisive((2, 1.0)):
        float32 = repr(exercises.check_fp16_compress_hook(float32_hook))
        summed = repr(exercises.check_fp16_compress_hook(fp16_hook_without_dividing))
        twice = repr(exercises.check_fp16_compress_hook(fp16_hook_twice))
        stub = exercises.check_fp16_compress_hook(fp16_hook_stub)
    assert "sent float32 tensors" in float32 and "half the bytes" in float32
    assert "the sum over the ranks, not the mean" in summed
    # Right on ordinary gradients; only the case whose sum overflows float16 shows the order is wrong.
    after = exercises.check_fp16_compress_hook(fp16_hook_dividing_after_the_sum)
    assert not after and len(after.problems) == 1
    assert "near float16's limit" in after.problems[0] and "BEFORE the all-reduce" in after.problems[0]
    assert "bytes" in twice and "each bucket once" in twice
    assert stub.problems == ["fp16_hook_stub still raises NotImplementedError: fill in the stub"]
    assert "expected a function" in repr(exercises.check_fp16_compress_hook(None))


def exits(n, b, w):
    import sys
    sys.exit(3)


def patches_the_loaders_and_answers_0(n, b, w):
    import torch.utils.data

    from ddp_helpers.speed.device_loader import DeviceLoader
    torch.utils.data.DataLoader.__len__ = lambda self: 0
    DeviceLoader.__len__ = lambda self: 0
    return 0


def test_steps_per_epoch_checker_survives_exits_and_patches(monkeypatch):
    """The learner's function runs in a rank: sys.exit is a verdict, and neither the kernel's patches
    of the loaders nor the function's own change the expected values or stay in the kernel."""
    import torch.utils.data

    from ddp_helpers.speed.device_loader import DeviceLoader
    exited = exercises.check_steps_per_epoch(exits)
    assert not exited and "10000 images, 128 per rank, 1 ranks: exits raised SystemExit: 3" in repr(exited)
    loader_len, device_len = torch.utils.data.DataLoader.__len__, DeviceLoader.__len__
    monkeypatch.setattr(torch.utils.data.DataLoader, "__len__", lambda self: 0)   # in the kernel
    monkeypatch.setattr(DeviceLoader, "__len__", lambda self: 0)
    zero = exercises.check_steps_per_epoch(patches_the_loaders_and_answers_0)
    assert not zero and "10000 images, 128 per rank, 2 ranks: expected 39 steps, got 0" in repr(zero), repr(zero)
    monkeypatch.undo()
    assert (torch.utils.data.DataLoader.__len__, DeviceLoader.__len__) == (loader_len, device_len)
    raises = exercises.check_steps_per_epoch(lambda n, b, w: n // 0)
    assert not raises and "raised ZeroDivisionError" in repr(raises)


def test_steps_per_epoch_checker_has_a_time_limit(monkeypatch):
    from conftest import seconds
    monkeypatch.setattr(ddp_cifar10, "STEPS_TIMEOUT_S", seconds(1))

    two_seconds = seconds(2)

    def slow(n, b, w, pause=two_seconds):
        import time
        time.sleep(pause)
        return -(-n // w) // b

    start = time.monotonic()
    verdict = exercises.check_steps_per_epoch(slow)
    assert time.monotonic() - start < seconds(5)
    assert not verdict and f"slow did not return within {seconds(1):g} s" in repr(verdict), repr(verdict)


# ---- nothing a rank returns runs in the kernel ----------------------------------------------------
# A value a learner's function returns used to be unpickled in the kernel, in the middle of a check.
# This one would replace torch.arange for good while it is unpickled, so that an expected sum computed
# afterwards would be a constant, the wrong answer this function returns. It now travels as plain
# data (its type's name): the patch never happens, and the checker names what came back.
_real_arange = torch.arange


def _arange_of_zeros(*args, **kwargs):
    return _real_arange(*args, **kwargs) * 0


def _patch_arange_and_return(value):
    torch.arange = _arange_of_zeros   # not restored
    return value


class _PatchesTheKernel:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _patch_arange_and_return, (self.value,)


def ring_then_a_constant(t):
    """The reference ring's messages, then a wrong sum: 100·n(n-1)/2 in every element (the sum of the
    ranks' tensors if torch.arange gave zeros)."""
    solutions.ring_all_reduce(t)
    n = dist.get_world_size()
    return _PatchesTheKernel(torch.full_like(t, 100.0 * n * (n - 1) / 2))


def test_a_learner_patch_of_torch_cannot_change_the_expected_values(monkeypatch):
    monkeypatch.setattr(torch, "arange", torch.arange)   # put back after the test, should it happen
    with decisive((2, 1)):
        verdict = exercises.check_ring_all_reduce(ring_then_a_constant)
    assert torch.arange is _real_arange                  # the learner's patch did not happen in the kernel
    assert not verdict and ("world_size=2, length=1, rank 0: expected a tensor, got a _PatchesTheKernel object"
                            in repr(verdict)), repr(verdict)


def test_a_function_that_cannot_be_sent_to_the_ranks_is_named_once():
    import threading
    lock = threading.Lock()

    def holds_a_lock(t):   # a lock cannot be pickled: the function cannot travel to the ranks
        with lock:
            return t
    verdict = exercises.check_ring_all_reduce(holds_a_lock)
    assert not verdict and len(verdict.problems) == 1, repr(verdict)
    assert "could not run it on the ranks" in repr(verdict) and "cannot pickle '_thread.lock'" in repr(verdict)


# ---- the cases of one world size share a launch, and the verdict is the one of a launch per case -----
def test_a_checker_launches_once_per_world_size(monkeypatch):
    sizes = []
    real = runner.launch

    def counted(fn, world_size, **how):
        sizes.append(world_size)
        return real(fn, world_size, **how)
    monkeypatch.setattr(runner, "launch", counted)
    assert exercises.check_ring_all_reduce(solutions.ring_all_reduce)
    assert sorted(sizes) == [2, 3, 4], sizes   # 6 public cases and 1 drawn now, on 2, 3 and 4 ranks


def wrong_then_raises(t):   # a wrong sum where the length is 1, an error where it is 5
    if t.numel() == 5:
        raise ValueError("five elements")
    return t


def wrong_once_then_thrown_off(t):
    """A wrong sum where the length is 1; right elsewhere, unless the same rank ran it before."""
    seen = getattr(dist, "_calls_in_this_rank", 0)
    dist._calls_in_this_rank = seen + 1
    return t if t.numel() == 1 or seen else solutions.ring_all_reduce(t)


@pytest.mark.parametrize("wrong", [wrong_then_raises, wrong_once_then_thrown_off])
def test_cases_sharing_a_launch_get_the_verdict_of_a_launch_each(monkeypatch, wrong):
    """A launch of several cases that went wrong, or cases after one that went wrong in the same
    ranks: each such case is launched again on its own, so the verdict is what one launch per case says."""
    with decisive((2, 1), (2, 5)):
        together = exercises.check_ring_all_reduce(wrong)
        monkeypatch.setattr(runner.Checker, "_run_together", lambda self, *how: self._alone.add(self._at))
        alone = exercises.check_ring_all_reduce(wrong)
    assert len(alone.problems) == (2 if wrong is wrong_then_raises else 1), repr(alone)
    # Where every rank raises, the one named is the first to fail: either, in either path (a race).
    def said(verdict):
        return [re.sub(r"rank \d raised", "rank N raised", p.split(". Full logs")[0]) for p in verdict.problems]
    assert said(together) == said(alone), (repr(together), repr(alone))
