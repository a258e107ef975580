"""Who sent what to whom: the point-to-point checkers' reading of every rank's recorded messages.

The ranks record their send/recv/isend/irecv calls (`spies.recording_p2p`); `Traffic` matches the
i-th send from a to b with the i-th receive at b from a, counts per rank the messages and bytes,
and finds the longest chain of messages each of which had to wait for the one before it (a
longest path in the graph of messages): the number of rounds the algorithm takes, which tells a
tree from a chain and a ring whose ranks take turns from one whose links are busy at once.
"""
from __future__ import annotations


class Traffic:
    """Who sent what to whom, from every rank's recorded p2p events (see spies.recording_p2p).

    sent[r], received[r]: messages and bytes per rank. rounds: the length of the longest chain of
    messages each of which had to wait for the one before it, where a rank sends one message at a
    time (its link is busy) and can only pass on what it has already received. chain: that chain,
    as (sender, receiver) pairs."""

    def __init__(self, events_per_rank: list[list[tuple]]):
        self.world_size = n = len(events_per_rank)
        self.sent = [{"messages": 0, "bytes": 0} for _ in range(n)]
        self.received = [{"messages": 0, "bytes": 0} for _ in range(n)]
        self.message_bytes: dict[tuple[int, int, int], int] = {}
        for rank, events in enumerate(events_per_rank):
            for kind, peer, index, nbytes in events:
                side = self.sent if kind == "send" else self.received
                side[rank]["messages"] += 1
                side[rank]["bytes"] += nbytes
                if kind == "send":
                    self.message_bytes[(rank, peer, index)] = nbytes
        self.rounds, self.chain = longest_chain(events_per_rank)

    def describe_chain(self) -> str:
        return ", then ".join(f"{a}→{b}" for a, b in self.chain)


def longest_chain(events_per_rank: list[list[tuple]]) -> tuple[int, list[tuple[int, int]]]:
    """(rounds, chain): the longest chain of messages that waited for each other, and its (src, dst) pairs."""
    round_of, before = {}, {}   # message (src, dst, index) -> its round, the message it waited for
    for _ in range(sum(len(e) for e in events_per_rank) + 1):   # acyclic: settles within that many passes
        changed = False
        for rank, events in enumerate(events_per_rank):
            ready, cause = 0, None   # the round by which this rank's link and data are ready
            for kind, peer, index, _ in events:
                if kind == "send":
                    message = (rank, peer, index)
                    if round_of.get(message) != ready + 1:
                        round_of[message], before[message], changed = ready + 1, cause, True
                    ready, cause = ready + 1, message
                else:
                    message = (peer, rank, index)
                    if round_of.get(message, 0) > ready:
                        ready, cause = round_of[message], message
        if not changed:
            break
    if not round_of:
        return 0, []
    last = max(round_of, key=round_of.get)
    chain = []
    while last is not None:
        chain.append(last[:2])
        last = before.get(last)
    return max(round_of.values()), chain[::-1]
