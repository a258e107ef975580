"""Inside the ranks: the buffers of one collective call, its time per call, and nccl-tests' #wrong.

    call, out, expected = prepare("all_reduce", count, torch.float32, device)
    seconds = time_calls(call, iters=20, warmup=5, device=device)     # per call, on this rank

`prepare` is the only place that calls torch.distributed's collectives; `sweeps.sweep` times each
size with `time_calls` (or a timer of one's own) and checks it with `count_wrong`.
"""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import machine
from ..compat import barrier, renamed
from .formulas import check_collective

# For cuda_graph=True: NCCL by default synchronises every captured call so that captured and
# uncaptured calls may run at the same time on one communicator; that costs about 5 µs a call
# (measured on 2 H200s: 10 -> 5 µs for small all_reduces). A sweep never runs both at once.
GRAPH_ENV = {"NCCL_GRAPH_MIXING_SUPPORT": "0"}


# ------------------------------------------------------------ inputs and results
def pattern(count: int, seed: int, dtype: torch.dtype, device: torch.device | str, offset: int = 0) -> torch.Tensor:
    """Small integers (0..6) that differ by rank and position: sums of up to ~36
    ranks stay exact even in bfloat16, so results can be compared exactly."""
    i = torch.arange(offset, offset + count, device=device)
    return ((i + 3 * seed) % 7).to(dtype)


def _sum_over_ranks(count, n, dtype, device, offset=0):
    total = pattern(count, 0, dtype, device, offset)
    for seed in range(1, n):
        total += pattern(count, seed, dtype, device, offset)
    return total


def prepare(collective: str, count: int, dtype: torch.dtype, device: torch.device
            ) -> tuple[Callable[[], object], torch.Tensor, Callable[[], torch.Tensor | None]]:
    """Buffers for one call on this rank: returns (call, output, expected).

    call() runs the collective once; expected() gives what `output` must hold
    afterwards (None where nothing is defined, e.g. `reduce` off the root). This is
    the only place that calls torch.distributed's collectives.
    """
    n, r = dist.get_world_size(), dist.get_rank()
    mine = pattern(count * n if collective in ("reduce_scatter", "all_to_all") else count, r, dtype, device)
    out = torch.empty(count * n if collective in ("all_gather", "all_to_all") else count, dtype=dtype, device=device)
    if collective == "all_reduce":
        return (lambda: dist.all_reduce(mine)), mine, lambda: _sum_over_ranks(count, n, dtype, device)
    if collective == "broadcast":
        return (lambda: dist.broadcast(mine, src=0)), mine, lambda: pattern(count, 0, dtype, device)
    if collective == "reduce":
        expected = (lambda: _sum_over_ranks(count, n, dtype, device)) if r == 0 else (lambda: None)
        return (lambda: dist.reduce(mine, dst=0)), mine, expected
    if collective == "all_gather":
        gather = renamed("all_gather_single")
        return ((lambda: gather(out, mine)), out,
                lambda: torch.cat([pattern(count, j, dtype, device) for j in range(n)]))
    if collective == "reduce_scatter":  # rank r gets the sum of everyone's r-th chunk
        scatter = renamed("reduce_scatter_single")
        return ((lambda: scatter(out, mine)), out,
                lambda: _sum_over_ranks(count, n, dtype, device, offset=r * count))
    if collective == "all_to_all":      # chunk j of rank r goes to rank j
        return ((lambda: dist.all_to_all_single(out, mine)), out,
                lambda: torch.cat([pattern(count, j, dtype, device, offset=r * count) for j in range(n)]))
    if collective == "sendrecv":        # a ring: send to the next rank, receive from the previous one
        ops = [dist.P2POp(dist.isend, mine, (r + 1) % n), dist.P2POp(dist.irecv, out, (r - 1) % n)]

        def sendrecv():
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return sendrecv, out, lambda: pattern(count, (r - 1) % n, dtype, device)
    check_collective(collective)


def count_wrong(collective: str, count: int, dtype: torch.dtype, device: torch.device) -> int:
    """nccl-tests' #wrong on this rank: run once on fresh inputs, count elements that differ."""
    call, out, expected = prepare(collective, count, dtype, device)
    call()
    want = expected()
    return 0 if want is None else int((out != want).sum())


# ------------------------------------------------------------------- timing
def rank_device(device: str) -> torch.device:
    """This rank's torch.device for device 'cpu' or 'cuda' (its GPU: LOCAL_RANK, else its rank, modulo the
    GPUs it sees), made the current CUDA device."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but this process sees no CUDA GPU")
    index = int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def time_calls(call: Callable[[], object], iters: int, warmup: int, device: torch.device,
               cuda_graph: bool = False) -> float:
    """Seconds per call on this rank: warm-up calls, a barrier, then `iters` timed calls.

    CPU: wall clock. CUDA: events on the stream, since a call returns before the GPU
    is done. cuda_graph: the `iters` calls are captured once in a CUDA graph and
    replayed, so the time is NCCL's, not Python's launch overhead (start the ranks
    with GRAPH_ENV, as `measure` and the command line do, for NCCL's best).
    """
    if cuda_graph:
        return _time_graph(call, iters, max(warmup, 1), device)
    for _ in range(warmup):
        call()

    def loop():
        for _ in range(iters):
            call()
    return _timed(loop, device) / iters


def _time_graph(call, iters, warmup, device):
    side = torch.cuda.Stream(device)  # warm up off the default stream, as torch.cuda.graph's docs advise
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):      # also creates the NCCL communicator: it cannot be made during capture
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's own threads may call CUDA while we capture (nccl-tests does the same)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(iters):
            call()
    graph.replay()                   # the first replay uploads the graph
    return _timed(graph.replay, device) / iters


def _timed(run, device):
    """Seconds that run() takes, starting together after a barrier."""
    if device.type == "cpu":
        barrier(device)
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)  # nothing left queued before the clock starts
    barrier(device)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def hardware_name(device: torch.device) -> str:
    """'NVIDIA H200' for a GPU; the CPU model and core count for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({machine.cpu_count()} cores)"
