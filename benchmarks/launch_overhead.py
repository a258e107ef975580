"""How long does `launch` take for a trivial 2-rank Gloo job, against bare
torch.multiprocessing with fork (fast, but unsafe once the parent touched CUDA)
and with spawn (safe, slow)? All measured side by side in this one run.

    python benchmarks/launch_overhead.py [--repeats 20]

The job: init_process_group, one all_reduce of one float, destroy_process_group.
"""
import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_helpers import launch, machine


def job():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def bare_worker(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    assert job() == world_size
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_bare(start_method, world_size=2):
    start = time.perf_counter()
    mp.start_processes(bare_worker, args=(world_size, free_port()), nprocs=world_size,
                       start_method=start_method)
    return time.perf_counter() - start


def time_launch(world_size=2):
    start = time.perf_counter()
    assert launch(job, world_size, quiet=True) == [float(world_size)] * world_size
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--spawn-repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine.summary_line())
    first = time_launch()
    ours = [time_launch() for _ in range(args.repeats)]
    fork = [time_bare("fork") for _ in range(args.repeats)]
    spawn = [time_bare("spawn") for _ in range(args.spawn_repeats)]
    med = statistics.median
    print(f"launch, first call (starts the forkserver): {first:.3f} s")
    print(f"launch, repeat (median of {args.repeats}):        {med(ours):.3f} s  (min {min(ours):.3f})")
    print(f"bare start_processes, fork (median):         {med(fork):.3f} s  (min {min(fork):.3f})")
    print(f"bare start_processes, spawn (median of {args.spawn_repeats}):  {med(spawn):.3f} s")
    print(f"ratio launch / fork: {med(ours) / med(fork):.2f}x  (goal: at most 2x)")


if __name__ == "__main__":
    main()
