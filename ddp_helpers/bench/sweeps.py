"""A sweep over message sizes: inside ranks that share a process group (`sweep`), or starting the
ranks from a notebook (`measure`), after checking what this machine can run (`available_setups`,
`check_memory`) before any rank starts.

    rows = sweep("all_reduce", [8, 1024, 2**20])          # in each rank: one dict per message size
    rows = measure("all_reduce", size_range(8, 2**20), world_size=2, backend="gloo", device="cpu")
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

import psutil
import torch
import torch.distributed as dist

from .. import machine
from ..compat import one_gpu_per_rank
from . import timing
from .formulas import (
    IN_PLACE,
    NCCL_TYPE_NAMES,
    REDOP,
    ROOT,
    algbw_GBps,
    busbw_GBps,
    check_counts,
    check_setup,
    human,
    memory_per_rank,
    plan,
    resolve_dtype,
)
from .table import format_row, header
from .timing import GRAPH_ENV, hardware_name, rank_device, time_calls

Timer = Callable[[Callable[[], object], int, int, torch.device], float]


# ------------------------------------------------------------ what this machine can run
def available_setups(world_size: int = 2) -> list[tuple[str, str]]:
    """(backend, device) pairs this machine can run with world_size ranks.
    Counts GPUs without initialising CUDA here (safe in a notebook kernel)."""
    gpus = machine.gpu_count()
    setups = []
    if dist.is_gloo_available():
        setups.append(("gloo", "cpu"))
        if gpus >= 1:
            setups.append(("gloo", "cuda"))   # Gloo copies CUDA tensors through the host
    if one_gpu_per_rank(world_size, gpus):
        setups.append(("nccl", "cuda"))
    return setups


def check_memory(max_bytes: int, dtype: torch.dtype | str, ranks: int, device: str,
                 gpu_free: Sequence[int] | None = None) -> None:
    """Refuse a sweep whose largest size cannot fit in memory, before any rank starts: on the CPU the
    memory available now (psutil); on GPUs the free memory of each GPU (rank r uses GPU r % count)."""
    need = memory_per_rank(max_bytes, dtype)
    if device == "cpu":
        have, where = psutil.virtual_memory().available, "this machine has"
        need *= ranks
    else:
        free = gpu_free_bytes() if gpu_free is None else gpu_free
        if not free:
            return
        ranks_on = [len(range(i, ranks, len(free))) for i in range(len(free))]
        gpu = max(range(len(free)), key=lambda i: ranks_on[i] * need - free[i])
        have, where = free[gpu], f"GPU {gpu} has"
        need *= ranks_on[gpu]
    if need > have:
        raise ValueError(f"{human(max_bytes)} messages need about {human(need)} of memory on {ranks} ranks; "
                         f"{where} {human(have)} available: choose a smaller largest size")


def gpu_free_bytes() -> list[int]:
    """Free bytes of each visible GPU (torch.cuda.mem_get_info), read in a child process so that CUDA
    is not initialised here (a notebook's kernel); [] without GPUs."""
    if not machine.gpu_count():
        return []
    code = "import torch; print([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 and done.stdout else []


# -------------------------------------------------------------------- sweep
def warm_up(collective: str, counts: Sequence[int], dtype: torch.dtype, device: torch.device, calls: int,
            timed: Callable, cuda_graph: bool = False) -> None:
    """Untimed calls before a sweep, as nccl-tests' TimeTest does (`src/common.cu`: its warm-up
    iterations at the largest size, then at the smallest): the first calls of a process pay one-time
    costs (the connections' first use, buffers and pages touched for the first time, NCCL's
    communicator) that would otherwise land on the first size timed. Each size runs through `timed`,
    its result thrown away, so that a timer of one's own (and a CUDA graph) is warmed up too."""
    for count in counts:
        call = timing.prepare(collective, count, dtype, device)[0]
        timed(call, 1, calls, device, cuda_graph)
        del call


def sweep(collective: str, sizes: Sequence[int], dtype: torch.dtype | str = torch.float32, device: str = "cpu",
          iters: int = 20, warmup: int = 5, cuda_graph: bool = False, verbose: bool = False,
          timer: Timer | None = None) -> list[dict]:
    """Measure `collective` at each requested size (bytes); run on every rank.

    timer(call, iters, warmup, device) -> seconds per call on this rank: how each size is timed
    (default `time_calls`; a timer written in a notebook cell travels to the ranks too). With
    cuda_graph, the calls are captured and replayed by `time_calls` instead. Before the first size,
    `warm_up` makes untimed calls at the largest size, then the smallest, as nccl-tests does.

    Returns the same list of rows on every rank, one dict per size: bytes (S),
    count, dtype, time_us (mean per call, averaged over ranks), algbw_GBps,
    busbw_GBps, wrong (elements that differ from the expected result, all ranks).
    verbose: rank 0 prints the nccl-tests table as it goes.
    """
    dtype, n, backend = resolve_dtype(dtype), dist.get_world_size(), dist.get_backend()
    check_setup(backend, device, cuda_graph, collective)
    check_counts(iters, warmup)
    plans = [plan(collective, s, dtype.itemsize, n) for s in sizes]
    dev = rank_device(device)
    base = {"collective": collective, "backend": backend, "device": device, "hardware": hardware_name(dev),
            "world_size": n, "dtype": NCCL_TYPE_NAMES[dtype], "redop": REDOP.get(collective, "none"),
            "root": ROOT.get(collective, -1), "in_place": collective in IN_PLACE, "cuda_graph": cuda_graph,
            "iters": iters, "warmup": warmup}
    if verbose and dist.get_rank() == 0:
        print(header(base), flush=True)
    timed = time_calls if timer is None or cuda_graph else (
        lambda call, iters, warmup, dev, cuda_graph: timer(call, iters, warmup, dev))
    warm_up(collective, [plans[-1][0], plans[0][0]], dtype, dev, max(warmup, 1), timed, cuda_graph)
    rows = []
    for count, nbytes in plans:
        call, _, _ = timing.prepare(collective, count, dtype, dev)
        seconds = timed(call, iters, warmup, dev, cuda_graph)
        del call  # frees the timed buffers before the check makes its own
        wrong = timing.count_wrong(collective, count, dtype, dev)
        # one all_reduce gives the mean time and the total #wrong over ranks
        totals = torch.tensor([seconds, wrong], dtype=torch.float64, device=dev)
        dist.all_reduce(totals)
        time_us = totals[0].item() / n * 1e6
        rows.append(dict(base, bytes=nbytes, count=count, time_us=time_us,
                         algbw_GBps=algbw_GBps(nbytes, time_us),
                         busbw_GBps=busbw_GBps(collective, nbytes, time_us, n), wrong=int(totals[1].item())))
        if verbose and dist.get_rank() == 0:
            print(format_row(rows[-1]), flush=True)
    return rows


def measure(collective: str = "all_reduce", sizes: Sequence[int] = (8, 1024, 2**20), world_size: int = 2,
            backend: str = "gloo", device: str = "cpu", dtype: torch.dtype | str = torch.float32, iters: int = 20,
            warmup: int = 5, cuda_graph: bool = False, env: dict[str, str] | None = None, timeout: float = 300,
            verbose: bool = False, timer: Timer | None = None) -> list[dict]:
    """Start `world_size` ranks with `launch`, run `sweep` there, return rank 0's rows.

    Checks the arguments here first, so a mistake fails before any process starts.
    env: extra environment for the ranks, e.g. {"NCCL_P2P_DISABLE": "1"}; with
         cuda_graph, GRAPH_ENV is added for what neither env nor os.environ sets.
    verbose: print the nccl-tests table live (otherwise the ranks stay quiet).
    timer: how to time each size, as in `sweep` (it travels to the ranks with cloudpickle).
    """
    from ..launcher import launch
    dtype = resolve_dtype(dtype)
    check_setup(backend, device, cuda_graph, collective)
    check_counts(iters, warmup)
    for s in sizes:
        plan(collective, s, dtype.itemsize, world_size)
    check_memory(max(sizes), dtype, world_size, device)
    graph_env = {k: v for k, v in GRAPH_ENV.items() if cuda_graph and k not in os.environ}
    env = {**graph_env, **(env or {})}
    if timer is not None and not callable(timer):
        raise ValueError(f"timer must be a function timer(call, iters, warmup, device), got {timer!r}")
    kwargs = dict(dtype=dtype, device=device, iters=iters, warmup=warmup, cuda_graph=cuda_graph, verbose=verbose,
                  timer=timer)
    results = launch(sweep, world_size, backend, args=(collective, list(sizes)), kwargs=kwargs,
                     timeout=timeout, env=env, quiet=not verbose)
    return results[0]
