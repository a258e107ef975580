"""`python -m ddp_helpers.bench`: the nccl-tests command line (`-b 8 -e 1G -f 2 -c all_reduce ...`), under
torchrun (this process is one rank) or alone (it starts `--nproc` ranks with `measure`).

    torchrun --nproc-per-node=2 -m ddp_helpers.bench --collective all_reduce -b 8 -e 1G -f 2
    python -m ddp_helpers.bench -b 8 -e 32M --csv rows.csv
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import gpu_leases, machine, reference
from ..compat import one_gpu_per_rank
from .formulas import COLLECTIVES, DTYPES, check_setup, plan, resolve_dtype, size_range
from .sweeps import check_memory, measure, sweep
from .timing import GRAPH_ENV

DESCRIPTION = "Measure collectives the way NVIDIA's nccl-tests does: time, algbw, busbw, #wrong."


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.bench", description=DESCRIPTION)
    p.add_argument("-c", "--collective", default="all_reduce", choices=COLLECTIVES)
    p.add_argument("-b", "--min-bytes", default="8", help="smallest message, e.g. 8, 64K (default 8)")
    p.add_argument("-e", "--max-bytes", default="32M", help="largest message, e.g. 1G (default 32M)")
    p.add_argument("-f", "--factor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("-d", "--dtype", default="float", choices=sorted(DTYPES))
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    p.add_argument("-G", "--cuda-graph", action="store_true", help="time CUDA-graph replays (NCCL only)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if every rank gets a GPU, else cpu")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl if every rank gets a GPU, else gloo")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not run under torchrun (default 2)")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    args = p.parse_args(argv)
    if "RANK" not in os.environ and args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    # Ranks on this machine: torchrun's, or the ones we start. NCCL needs a GPU of its own for each.
    ranks = (int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))) if "RANK" in os.environ
             else args.nproc)
    args.local_ranks = ranks
    gpus = machine.gpu_count() if "RANK" in os.environ else len(gpu_leases.visible_gpus())  # as launch counts
    one_gpu_each = one_gpu_per_rank(ranks, gpus)
    if args.backend == "nccl" and not one_gpu_each:
        p.error(f"--backend nccl needs one GPU per rank: {ranks} ranks here, {gpus} GPU(s)")
    chosen = [name for name in ("device", "backend") if getattr(args, name) is None]
    args.device = args.device or ("cuda" if one_gpu_each or args.backend == "nccl" else "cpu")
    args.backend = args.backend or ("nccl" if args.device == "cuda" and one_gpu_each else "gloo")
    why = f"{ranks} rank(s), {gpus} GPU(s)" + ("" if one_gpu_each or not gpus else ": NCCL needs one GPU per rank")
    args.chosen = f"# chose {' and '.join(f'{n} {getattr(args, n)}' for n in chosen)} ({why})" if chosen else None
    return args


def main(argv: Sequence[str] | None = None) -> list[dict] | None:
    """Run the command line; returns rank 0's rows (None on the other ranks under torchrun)."""
    args = parse_args(argv)
    sizes = size_range(args.min_bytes, args.max_bytes, args.factor)
    for size in sizes:  # bad sizes: an error now, before anything else is said or started
        plan(args.collective, size, resolve_dtype(args.dtype).itemsize, int(os.environ.get("WORLD_SIZE", args.nproc)))
    check_memory(max(sizes), args.dtype, args.local_ranks, args.device)
    if args.chosen and os.environ.get("RANK", "0") == "0":  # what was chosen for the user, said once
        print(args.chosen, file=sys.stderr)
    options = dict(dtype=args.dtype, device=args.device, iters=args.iters, warmup=args.warmup,
                   cuda_graph=args.cuda_graph)
    if "RANK" not in os.environ:  # not under torchrun: start the ranks ourselves
        rows = measure(args.collective, sizes, args.nproc, args.backend, verbose=True, **options)
    else:
        rows = _main_in_rank(args, sizes, options)
    if rows and args.csv:
        reference.write_rows(rows, args.csv)
    return rows


def _main_in_rank(args, sizes, options):
    """Under torchrun: this process is one rank; join the group, sweep, leave."""
    check_setup(args.backend, args.device, args.cuda_graph, args.collective)
    for s in sizes:  # every rank fails the same way before joining, instead of hanging
        plan(args.collective, s, resolve_dtype(args.dtype).itemsize, int(os.environ["WORLD_SIZE"]))
    if args.cuda_graph:
        for key, value in GRAPH_ENV.items():
            os.environ.setdefault(key, value)  # read when NCCL's communicator is made, after this
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=300))
    try:
        rows = sweep(args.collective, sizes, verbose=True, **options)
    finally:
        dist.destroy_process_group()
    return rows if int(os.environ["RANK"]) == 0 else None
