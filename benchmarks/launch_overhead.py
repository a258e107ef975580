"""How long does `launch` take for a trivial job: the first launch of a fresh process (a notebook's
first cell that launches), and a repeat launch, against bare torch.multiprocessing with fork (fast,
but unsafe once the parent touched CUDA) and with spawn (safe, slow)? All measured in this one run.

    python benchmarks/launch_overhead.py [--repeats 20] [--first-launches 3] [--backend nccl --world-size 1]
                                         [--torch-first]

The job: init_process_group, one all_reduce of one float, destroy_process_group.
The first launch is measured in fresh Python processes, right after `import ddp_helpers` (timed
too), in both ways the fork server can start: at `import ddp_helpers` (what a Jupyter kernel does;
DDP_HELPERS_EARLY_FORKSERVER=1 here) or at the first launch (what a script does; =0). Right after
the import is the worst case for the first: in a notebook, cells usually run in between.
`--torch-first`: the fresh process imports torch before ddp_helpers, as the notebooks' first cells do;
then the fork server starts only once the process has imported torch, and the first launch waits for
the server's whole import.
"""
import argparse
import json
import os
import subprocess
import sys
import time

if __name__ == "__main__" and "--first-only" in sys.argv:   # a fresh process: time the import itself
    if "--torch-first" in sys.argv:
        import torch  # noqa: F401
    _start = time.perf_counter()
    import ddp_helpers  # noqa: F401
    IMPORT_S = time.perf_counter() - _start

import socket  # noqa: E402
import statistics  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from ddp_helpers import launch, machine  # noqa: E402
from ddp_helpers.runtime.forkserver import EARLY_ENV_VAR  # noqa: E402

HERE = os.path.abspath(__file__)


def job():
    t = torch.ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
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


def time_launch(world_size=2, backend="gloo"):
    start = time.perf_counter()
    assert launch(job, world_size, backend=backend, quiet=True) == [float(world_size)] * world_size
    return time.perf_counter() - start


def first_launches(args, early):
    """Fresh processes, each timing its import of ddp_helpers, its first launch and its second."""
    env = {**os.environ, EARLY_ENV_VAR: "1" if early else "0"}
    runs = []
    for _ in range(args.first_launches):
        done = subprocess.run([sys.executable, HERE, "--first-only", "--backend", args.backend,
                               "--world-size", str(args.world_size), *(["--torch-first"] if args.torch_first else [])],
                              env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the fresh process failed:\n{done.stdout}\n{done.stderr}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--spawn-repeats", type=int, default=3)
    parser.add_argument("--first-launches", type=int, default=3, help="fresh processes for each way")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--torch-first", action="store_true",
                        help="the fresh processes import torch before ddp_helpers, as the notebooks do")
    parser.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_only:
        first = time_launch(args.world_size, args.backend)
        second = time_launch(args.world_size, args.backend)
        print(json.dumps({"import_s": IMPORT_S, "first_s": first, "second_s": second}))
        return
    med = statistics.median
    print(machine.summary_line())
    print(f"{args.world_size} rank(s), {args.backend}; first launches: {args.first_launches} fresh processes each way"
          + (", each importing torch before ddp_helpers" if args.torch_first else ""))
    for early, how in ((True, "at import (a Jupyter kernel)"), (False, "at the first launch (a script)")):
        runs = first_launches(args, early)
        print(f"fork server started {how}:")
        for key, what in (("import_s", "import ddp_helpers"), ("first_s", "first launch, right after"),
                          ("second_s", "second launch")):
            values = [r[key] for r in runs]
            print(f"  {what:<27} median {med(values):6.3f} s  (all: {', '.join(f'{v:.3f}' for v in values)})")
    time_launch(args.world_size, args.backend)   # this process's first: starts its fork server
    ours = [time_launch(args.world_size, args.backend) for _ in range(args.repeats)]
    print(f"launch, repeat (median of {args.repeats}):        {med(ours):.3f} s  (min {min(ours):.3f})")
    if args.backend == "gloo":
        fork = [time_bare("fork", args.world_size) for _ in range(args.repeats)]
        spawn = [time_bare("spawn", args.world_size) for _ in range(args.spawn_repeats)]
        print(f"bare start_processes, fork (median):         {med(fork):.3f} s  (min {min(fork):.3f})")
        print(f"bare start_processes, spawn (median of {args.spawn_repeats}):  {med(spawn):.3f} s")
        print(f"ratio launch / fork: {med(ours) / med(fork):.2f}x  (goal: at most 2x)")


if __name__ == "__main__":
    main()
