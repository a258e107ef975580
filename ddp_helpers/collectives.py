"""Collectives for notebooks 02 and 03: what this machine supports, a ring
all-reduce that records every step (for the stepper picture), and a ping-pong.

Everything here runs inside a rank (process group initialised).
"""
import time

import torch
import torch.distributed as dist

from .compat import renamed


def _support_probes(n, rank, device):
    """op name -> a call that uses it on small tensors of `device`."""
    def t(*shape):
        return torch.ones(*shape, device=device)

    def p2p():
        if n < 2:
            return
        if rank == 0:
            dist.send(t(2), dst=1)
        elif rank == 1:
            dist.recv(t(2), src=0)

    return {
        "send / recv": p2p,
        "broadcast": lambda: dist.broadcast(t(2), src=0),
        "all_reduce (SUM)": lambda: dist.all_reduce(t(2)),
        "all_reduce (AVG)": lambda: dist.all_reduce(t(2), op=dist.ReduceOp.AVG),
        "reduce": lambda: dist.reduce(t(2), dst=0),
        "all_gather": lambda: dist.all_gather([t(2) for _ in range(n)], t(2)),
        "all_gather (one tensor)": lambda: renamed("all_gather_single")(t(2 * n), t(2)),
        "gather": lambda: dist.gather(t(2), [t(2) for _ in range(n)] if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(t(2), [t(2) for _ in range(n)] if rank == 0 else None, src=0),
        "reduce_scatter": lambda: dist.reduce_scatter(t(2), [t(2) for _ in range(n)]),
        "reduce_scatter (one tensor)": lambda: renamed("reduce_scatter_single")(t(2), t(2 * n)),
        "all_to_all": lambda: dist.all_to_all([t(1) for _ in range(n)], [t(1) for _ in range(n)]),
        "all_to_all (one tensor)": lambda: dist.all_to_all_single(t(n), t(n)),
        "barrier": dist.barrier,
    }


def probe_support(device="cpu", only=None, skip=()):
    """Try every op on this process group's backend with tensors on `device`.

    Returns {op: "✓"} or {op: "✘ <error type>"}. Ops run in the same order on
    every rank, so a failing op fails on all of them and the probe carries on.
    `only` probes a single op (by its name in the result); ops in `skip` are not tried
    and reported as "not probed" (Gloo's send of a CUDA tensor raises a RuntimeError, but on
    torch 2.11 it can also abort the process: seen once in two runs on one H100).
    """
    found = {}
    for name, call in _support_probes(dist.get_world_size(), dist.get_rank(), device).items():
        if only is not None and name != only:
            continue
        if name in skip:
            found[name] = "not probed"
            continue
        try:
            call()
            if str(device).startswith("cuda"):
                torch.cuda.synchronize()
            found[name] = "✓"
        except Exception as exc:  # the backend says no: that is the answer we want
            found[name] = f"✘ {type(exc).__name__}"
    return found


def ring_all_reduce_steps(tensor):
    """SUM all-reduce along a ring, as NCCL's ring algorithm does, recording a
    snapshot of this rank's chunks after every step.

    Reduce-scatter (n-1 steps): at step s, rank r sends chunk (r - s) to rank r+1,
    which adds it to its own copy. Afterwards rank r owns the full sum of chunk (r + 1).
    All-gather (n-1 steps): the summed chunks travel on around the ring.
    Returns (result, snapshots): snapshots[k] is a list of this rank's chunks after step k.
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(torch.tensor_split(tensor.clone(), n))
    snapshots = [[c.clone() for c in chunks]]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            offset = step if phase == "reduce-scatter" else step - 1
            send_index, recv_index = (rank - offset) % n, (rank - offset - 1) % n
            incoming = torch.empty_like(chunks[recv_index])
            ops = [dist.P2POp(dist.isend, chunks[send_index], right),
                   dist.P2POp(dist.irecv, incoming, left)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            if phase == "reduce-scatter":
                chunks[recv_index] += incoming
            else:
                chunks[recv_index] = incoming
            snapshots.append([c.clone() for c in chunks])
    return torch.cat(chunks), snapshots


def ping_pong(sizes_bytes, iters=20, warmup=3, device="cpu", percentile=50):
    """Round-trip time between ranks 0 and 1 for each message size, in microseconds: the given
    percentile of `iters` round trips (50: the median). Rank 0 sends, rank 1 sends the same bytes
    back. First `warmup` untimed rounds (a fresh group's first messages set up buffers and
    connections), then `iters` timed rounds; each round makes one round trip of every size in turn,
    so that a burst of other work on a busy machine slows a round trip of many sizes, which the
    median leaves out, rather than many round trips of one size (a spike in the curve)."""
    rank = dist.get_rank()
    if rank > 1:
        return None  # only ranks 0 and 1 take part
    peer = 1 - rank
    buffers = [torch.zeros(max(1, size), dtype=torch.uint8, device=device) for size in sizes_bytes]

    def round_trip(buffer):
        if rank == 0:
            dist.send(buffer, dst=peer)
            dist.recv(buffer, src=peer)
        else:
            dist.recv(buffer, src=peer)
            dist.send(buffer, dst=peer)

    for _ in range(warmup):
        for buffer in buffers:
            round_trip(buffer)
    times = [[] for _ in buffers]
    for _ in range(iters):
        for buffer, timings in zip(buffers, times):
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            round_trip(buffer)
            if device != "cpu":
                torch.cuda.synchronize()   # a CUDA send returns when queued: wait for the GPU
            timings.append(time.perf_counter() - start)
    return [(size, sorted(t)[min(len(t) - 1, len(t) * percentile // 100)] * 1e6)
            for size, t in zip(sizes_bytes, times)]
