"""Checkers for notebooks 00-03's exercises on groups and point-to-point (re-exported by `exercises`).

Each runs the learner's function on real ranks for several world sizes and tensor lengths
(including lengths the world size does not divide) and compares every rank's result with the
expected one, computed here before any of the learner's code runs. Where an exercise rebuilds a
collective from send/recv, that collective is switched off in the ranks (`spies.forbidding`), and
the ranks' messages are recorded (`spies.recording_p2p`) so that the algorithm is checked too
(`traffic.Traffic`): a right result reached the wrong way (gathering everything at rank 0, a chain
instead of a tree, ranks that take turns) is named. The point-to-point exercises end with a case
drawn at random when the checker runs (`runner.unseen`), whose ranks hold random data: an answer
that computes the public cases' sums from their formula fails it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .spies import forbidding, recording_p2p
from .traffic import Traffic
from .verdict import Verdict, difference

__all__ = ["check_rank_squares", "check_parity_group_sum", "check_all_gather", "check_tree_broadcast",
           "check_ring_all_reduce", "run_counting_p2p"]


def _run_in_rank(fn, make_input, forbidden):
    """Inside a rank: fn(*make_input(rank, world_size)) with the forbidden collectives switched off."""
    with forbidding(forbidden):
        return fn(*make_input(dist.get_rank(), dist.get_world_size()))


def run_counting_p2p(fn: Callable, make_input: Callable, forbidden: tuple[str, ...]) -> tuple:
    """Inside a rank: like _run_in_rank, with the p2p calls recorded. Returns (result, events)."""
    with recording_p2p() as events:
        return _run_in_rank(fn, make_input, forbidden), events


def _check(title, fn, cases, make_input, expected, forbidden=(), hint="", algorithm=None, unseen=()) -> Verdict:
    """Run fn for each (world_size, length, seed) case (the public `cases`, then the `unseen` ones) and
    compare each rank's result with expected(rank, world_size, length, seed), every one of them computed
    before the first launch. With `algorithm`, the ranks' p2p calls are recorded too, and
    algorithm(Traffic, world_size, length) returns what is wrong with the way the result was computed
    (a list of problems)."""
    cases = [case + (None,) * (3 - len(case)) for case in cases]
    wants = {case: [expected(rank, *case) for rank in range(case[0])] for case in [*cases, *unseen]}
    check = runner.Checker(title, fn)
    in_rank = run_counting_p2p if algorithm else _run_in_rank

    def plan(case):
        world_size, length, seed = case
        return in_rank, world_size, (fn, lambda r, n, k=length, s=seed: make_input(r, n, k, s), forbidden)

    for world_size, length, seed in check.each(cases, unseen, plan):
        label = check.label(f"world_size={world_size}" + (f", length={length}" if length is not None else ""))
        got = check.run(*check.planned, label,
                        never_finished=f"a send without its recv, or the other way round? {hint}", on_error=hint)
        if got is None:
            continue
        if algorithm:
            traffic = Traffic([events for _, events in got])
            got = [value for value, _ in got]
        wrong = False
        for rank, value in enumerate(got):
            problem = difference(wants[world_size, length, seed][rank], value)
            if problem:
                wrong = True
                check.problems.append(f"{label}, rank {rank}: {problem}")
        if algorithm and not wrong:
            check.problems += [f"{label}: {problem}" for problem in algorithm(traffic, world_size, length)]
    return check.verdict()


def _no_input(rank, world_size, length, seed):
    return ()


def check_rank_squares(fn: Callable[[], int]) -> Verdict:
    """Each rank returns its rank squared."""
    return _check("my_square", fn, [(2, None), (4, None)], _no_input, lambda r, n, k, s: r * r)


def check_parity_group_sum(fn: Callable[[], int]) -> Verdict:
    """Notebook 01: each rank returns the sum of the ranks with its own parity,
    computed with an all_reduce inside a `new_group` of even or odd ranks."""
    hint = "Every rank must call dist.new_group for every group, in the same order, even groups it is not in."
    return _check("parity_group_sum", fn, [(2, None), (3, None), (4, None)], _no_input,
                  lambda r, n, k, s: sum(i for i in range(n) if i % 2 == r % 2), hint=hint)


def _rank_data(rank, world_size, length, seed=None):
    """Each rank's own tensor in the p2p exercises: easy to tell apart by eye (0, 1, 2, ... plus 100 times
    the rank); with a seed, whole numbers drawn at random (sums of them are exact in float32)."""
    if seed is None:
        return (torch.arange(length, dtype=torch.float32) + 100 * rank,)
    generator = torch.Generator().manual_seed(seed * 64 + rank)
    return (torch.randint(-99, 100, (length,), generator=generator).float(),)


_LENGTH_CASES = [(2, 1), (2, 5), (3, 4), (3, 7), (4, 3), (4, 10)]


def _draw_length_case(rng):
    """(world_size, length, seed): a case whose ranks hold random data."""
    return rng.randint(2, 4), rng.randint(1, 12), rng.randrange(2**40)


def _all_gather_traffic(traffic, n, length):
    """An all-gather sends each rank's tensor (S bytes) to every other rank once: every rank sends and
    receives (n-1)·S bytes, whatever the route (directly, or around a ring)."""
    size = 4 * length
    want = (n - 1) * size
    sent = [traffic.sent[r]["bytes"] for r in range(n)]
    received = [traffic.received[r]["bytes"] for r in range(n)]
    busiest = max(range(n), key=lambda r: sent[r])
    if sent[busiest] > want and sum(1 for b in sent if b <= size) >= n - 1:
        return [f"rank {busiest} sent {sent[busiest]} bytes in {traffic.sent[busiest]['messages']} messages, "
                f"every other rank at most {size} (its own tensor): that is gather-to-one-rank-and-send-back. "
                f"It gives the right result, but rank {busiest}'s link carries {sent[busiest] // size} tensors "
                f"while the others idle, and everybody waits for it. Let each rank send its own tensor to every "
                f"other rank: (n-1)·S = {want} bytes per rank, the same on every rank"]
    for rank in range(n):
        if sent[rank] != want:
            return [f"rank {rank} sent {sent[rank]} bytes in {traffic.sent[rank]['messages']} messages; an all-gather "
                    f"needs each rank to send its own {size}-byte tensor to the {n - 1} others: {want} bytes"]
        if received[rank] != want:
            return [f"rank {rank} received {received[rank]} bytes; it needs the {n - 1} other tensors: {want} bytes"]
    return []


def check_all_gather(fn: Callable[[torch.Tensor], list[torch.Tensor]]) -> Verdict:
    """Notebook 02: `fn(t)` returns the list of every rank's tensor, built from send/recv.
    Also checks how: every rank sends and receives (n-1)·S bytes (no gathering at one rank)."""
    return _check("my_all_gather", fn, _LENGTH_CASES, _rank_data,
                  lambda r, n, k, s: [_rank_data(i, n, k, s)[0] for i in range(n)],
                  forbidden=("all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
                             "broadcast"), algorithm=_all_gather_traffic, unseen=runner.unseen(_draw_length_case))


def _tree_broadcast_traffic(traffic, n, length):
    """A tree broadcast: every rank but 0 receives the tensor exactly once, and the longest chain of
    messages that wait for each other (a rank sends one at a time) is ceil(log2 n) long."""
    size = 4 * length
    for rank in range(1, n):
        got = traffic.received[rank]
        if got["messages"] != 1 or got["bytes"] != size:
            return [f"rank {rank} received {got['messages']} messages ({got['bytes']} bytes); in a broadcast each "
                    f"rank but the root receives the {size}-byte tensor exactly once"]
    if traffic.received[0]["messages"]:
        return [f"rank 0 received {traffic.received[0]['messages']} message(s): the root already has the data"]
    best = (n - 1).bit_length()   # ceil(log2 n)
    if traffic.rounds > best:
        hint = (f"rank 0 sends all {n - 1} messages itself, one after another"
                if all(a == 0 for a, _ in traffic.chain) else
                "each rank that has the data should send it on in every round, so the number of ranks with the "
                "data doubles")
        return [f"{traffic.rounds} rounds: the longest chain of messages that wait for each other is "
                f"{traffic.describe_chain()} (a rank sends one message at a time). A binomial tree needs only "
                f"ceil(log2 {n}) = {best}: {hint}"]
    return []


def check_tree_broadcast(fn: Callable[[torch.Tensor], torch.Tensor]) -> Verdict:
    """Notebook 02: `fn(t)` returns rank 0's tensor on every rank, sent along a binomial tree.
    Also checks how: one message per receiving rank, and at most ceil(log2 n) rounds."""
    return _check("tree_broadcast", fn, _LENGTH_CASES + [(4, 1), (5, 2)], _rank_data,
                  lambda r, n, k, s: _rank_data(0, n, k, s)[0],
                  forbidden=("broadcast", "broadcast_object_list", "scatter", "all_gather", "all_reduce"),
                  algorithm=_tree_broadcast_traffic, unseen=runner.unseen(_draw_length_case))


def _ring_all_reduce_traffic(traffic, n, length):
    """A ring all-reduce: every rank sends 2(n-1) messages, all to the same neighbour, each one chunk
    of the tensor (torch.tensor_split: chunks differ by at most one element), and the messages of a
    step travel at once, so the longest chain of messages that wait for each other is 2(n-1)."""
    size, steps = 4 * length, 2 * (n - 1)
    chunk_bytes = {4 * (length // n), 4 * -(-length // n)}
    by_rank = [[(peer, nbytes) for (src, peer, _), nbytes in sorted(traffic.message_bytes.items()) if src == rank]
               for rank in range(n)]
    sources = [sorted({src for (src, peer, _) in traffic.message_bytes if peer == rank}) for rank in range(n)]
    hub = max(range(n), key=lambda r: len(sources[r]))
    whole = [(r, peer) for r in range(n) for peer, nbytes in by_rank[r] if nbytes >= size and max(chunk_bytes) < size]
    if len(sources[hub]) > 1 or whole:
        who = (f"rank {hub} received from ranks {', '.join(map(str, sources[hub]))}" if len(sources[hub]) > 1 else
               f"rank {whole[0][0]} sent the whole tensor ({size} bytes) to rank {whole[0][1]}")
        return [f"{who}: that is gathering the tensors at one rank and sending the sum back (or passing whole "
                f"tensors around). The result is right, but one link carries (n-1)·S bytes each way while the "
                f"others idle, and the time grows with n. In a ring, each rank sends only to its neighbour, and "
                f"only one chunk of S/n bytes per step: 2(n-1)/n·S bytes in all, on every link at once"]
    for rank in range(n):
        sent = by_rank[rank]
        if len(sent) != steps:
            return [f"rank {rank} sent {len(sent)} messages; a ring all-reduce sends 2(n-1) = {steps}: n-1 steps of "
                    f"reduce-scatter, then n-1 steps of all-gather, one chunk per step"]
        odd = [nbytes for _, nbytes in sent if nbytes not in chunk_bytes]
        if odd:
            return [f"rank {rank} sent a message of {odd[0]} bytes; each step sends one chunk, "
                    f"{' or '.join(map(str, sorted(chunk_bytes)))} bytes for {length} floats over {n} ranks "
                    f"(torch.tensor_split makes chunks that differ by at most one element)"]
    directions = {(peer - rank) % n for rank in range(n) for peer, _ in by_rank[rank]}
    if len(directions) != 1 or not directions <= {1, n - 1}:
        return ["the ranks do not all send to the same neighbour: in a ring, rank r sends to rank r+1 "
                "(or every rank to r-1) and receives from the other side"]
    if traffic.rounds > steps:
        return [f"{traffic.rounds} rounds instead of 2(n-1) = {steps}: a rank waits to receive before it sends in "
                f"the same step (longest chain: {traffic.describe_chain()}), so the ranks take turns. Post each "
                f"step's send and receive together (dist.batch_isend_irecv), so that every link is busy at once"]
    return []


def check_ring_all_reduce(fn: Callable[[torch.Tensor], torch.Tensor]) -> Verdict:
    """Notebook 03: `fn(t)` returns the element-wise sum over ranks, by reduce-scatter then
    all-gather around a ring, with lengths the world size does not divide. Also checks how: per rank,
    2(n-1) messages of one chunk each to one neighbour, in 2(n-1) rounds (not gather-and-send-back).
    Reference solution: ddp_helpers/solutions.py, ring_all_reduce."""
    return _check("ring_all_reduce", fn, _LENGTH_CASES, _rank_data,
                  lambda r, n, k, s: sum(_rank_data(i, n, k, s)[0] for i in range(n)),
                  forbidden=("all_reduce", "reduce", "reduce_scatter", "all_gather", "broadcast",
                             "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
                             "reduce_scatter_single"), algorithm=_ring_all_reduce_traffic,
                  unseen=runner.unseen(_draw_length_case))
