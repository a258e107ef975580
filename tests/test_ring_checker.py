"""Notebook 03's ring all-reduce checker checks the algorithm, not only the result: each wrong answer
below returns the right sum, and the checker must reject it and say why."""
import torch
import torch.distributed as dist
from checker_cases import decisive

from ddp_helpers import exercises, solutions


def gather_to_root(t):
    """Right sum, wrong algorithm: everyone sends its tensor to rank 0, which sends the sum back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        total = t.clone()
        for src in range(1, n):
            incoming = torch.empty_like(t)
            dist.recv(incoming, src)
            total += incoming
        for dst in range(1, n):
            dist.send(total, dst)
        return total
    dist.send(t, 0)
    total = torch.empty_like(t)
    dist.recv(total, 0)
    return total


def whole_tensor_ring(t):
    """Right sum, around a ring, but whole tensors: n-1 hops adding up, then n-1 hops passing the sum on."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    total, passing = t.clone(), t.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(t)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, passing, right),
                                               dist.P2POp(dist.irecv, incoming, left)]):
            request.wait()
        total += incoming
        passing = incoming
    return total


def ring_taking_turns(t):
    """Right sum, right messages, but blocking calls in order: rank 0 sends first, each other rank
    receives first and then sends, so within every step the ranks wait for each other."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(torch.tensor_split(t.clone(), n))

    def pass_along(send_index, recv_index):
        incoming = torch.empty_like(chunks[recv_index])
        if rank == 0:
            dist.send(chunks[send_index], right)
            dist.recv(incoming, left)
        else:
            dist.recv(incoming, left)
            dist.send(chunks[send_index], right)
        return incoming

    for step in range(n - 1):
        i = (rank - step - 1) % n
        chunks[i] += pass_along((rank - step) % n, i)
    for step in range(n - 1):
        i = (rank - step) % n
        chunks[i] = pass_along((rank - step + 1) % n, i)
    return torch.cat(chunks)


def test_reference_solution_passes():
    assert exercises.check_ring_all_reduce(solutions.ring_all_reduce)


def test_gather_to_rank_0_and_back_is_rejected_with_the_reason():
    with decisive((2, 5), (3, 4)):
        verdict = exercises.check_ring_all_reduce(gather_to_root)
    text = repr(verdict)
    assert not verdict
    assert "expected" not in text  # the sums were right: only the algorithm is wrong
    assert "world_size=2, length=5: rank 0 sent the whole tensor (20 bytes)" in text, text
    assert "world_size=3, length=4: rank 0 received from ranks 1, 2: that is gathering" in text, text


def test_whole_tensors_around_the_ring_are_rejected():
    with decisive((2, 5)):
        verdict = exercises.check_ring_all_reduce(whole_tensor_ring)
    assert not verdict and "sent the whole tensor" in repr(verdict), repr(verdict)


def test_a_ring_whose_ranks_take_turns_is_rejected_for_its_rounds():
    with decisive((3, 4)):
        verdict = exercises.check_ring_all_reduce(ring_taking_turns)
    text = repr(verdict)
    assert not verdict and "expected" not in text, text
    assert "world_size=3, length=4: " in text and "rounds instead of 2(n-1) = 4" in text, text


def test_an_extra_message_is_counted():
    def one_message_too_many(t):  # the reference ring, then one more message to the neighbour
        result = solutions.ring_all_reduce(t)
        rank, n = dist.get_rank(), dist.get_world_size()
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, t[:1].clone(), (rank + 1) % n),
                                               dist.P2POp(dist.irecv, torch.empty(1), (rank - 1) % n)]):
            request.wait()
        return result
    with decisive((2, 5)):
        verdict = exercises.check_ring_all_reduce(one_message_too_many)
    text = repr(verdict)
    assert not verdict and "expected" not in text, text
    assert "world_size=2, length=5: rank 0 sent 3 messages; a ring all-reduce sends 2(n-1) = 2" in text, text


def test_chunks_that_differ_by_more_than_one_element_are_named():
    def ring_with_torch_chunk(t):  # torch.chunk cuts 7 floats for 3 ranks as 3, 3, 1 (tensor_split: 3, 2, 2)
        rank, n = dist.get_rank(), dist.get_world_size()
        chunks = [c.clone() for c in torch.chunk(t, n)]
        if len(chunks) < n:  # torch.chunk may return fewer chunks: fall back to even pieces
            chunks = [c.clone() for c in torch.tensor_split(t, n)]
        right, left = (rank + 1) % n, (rank - 1) % n

        def pass_along(send_index, recv_index):
            incoming = torch.empty_like(chunks[recv_index])
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send_index], right),
                                                   dist.P2POp(dist.irecv, incoming, left)]):
                request.wait()
            return incoming
        for step in range(n - 1):
            i = (rank - step - 1) % n
            chunks[i] += pass_along((rank - step) % n, i)
        for step in range(n - 1):
            i = (rank - step) % n
            chunks[i] = pass_along((rank - step + 1) % n, i)
        return torch.cat(chunks)
    with decisive((3, 7)):
        verdict = exercises.check_ring_all_reduce(ring_with_torch_chunk)
    text = repr(verdict)
    assert not verdict and "expected" not in text, text
    assert ("world_size=3, length=7: rank 0 sent a message of 4 bytes; each step sends one chunk, 8 or 12 bytes"
            in text), text
