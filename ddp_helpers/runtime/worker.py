"""What runs inside each rank that `launch` starts: a rank's life, from start to exit.

`run_worker(local_rank, job)` is the target handed to
`torch.multiprocessing.start_processes`. In order, it:

1. sets the process up (`rank_setup.setup_worker_process`: output pipes, the environment torchrun
   would set, a random state of its own, a watchdog that ends it if the launching process dies);
2. optionally calls `init_process_group`, runs the user's function, and
   calls `destroy_process_group`;
3. writes the return value, or the exception with its traceback (an `ErrorRecord`), to a file in
   the run folder for the launcher to read: an error in step 1 too. A function that returns while
   threads it started still run is an error that names them (`rank_setup.ThreadsLeftRunning`);
4. ends any process the function started and left running (`rank_setup.end_worker`).

A warm pool's workers run `serve.serve` instead, which shares steps 1 and 4.
"""
from __future__ import annotations

import os
import sys

import cloudpickle
import torch.distributed as dist

from ..files import atomic_write
from .cells import to_cpu
from .rank_setup import (
    ThreadsLeftRunning,
    WorkerJob,
    end_worker,
    init_process_group,
    report_error,
    setup_worker_process,
    threads_left_running,
)
from .run_dirs import rank_file


def run_worker(local_rank: int, job: WorkerJob) -> None:
    """Target of `torch.multiprocessing.start_processes` for `launch`: one call of the job's function."""
    rank = local_rank  # one machine: global rank == local rank
    try:
        setup_worker_process(local_rank, job)
        fn, args, kwargs = cloudpickle.loads(job.payload)
        if job.init:
            init_process_group(job.backend, local_rank, job.pg_timeout_s)
        else:
            joined = _note_joining()
        result = fn(*args, **kwargs)
        left = threads_left_running()
        if left:   # Python would wait for them before this process may exit: forever, maybe
            report_error(job.run_dir, rank, ThreadsLeftRunning(left))
            end_worker()
            os._exit(1)
        if job.init and dist.is_initialized():
            dist.destroy_process_group()
        if not job.init and not joined:
            open(rank_file(job.run_dir, rank, "nogroup"), "w").close()
        with atomic_write(rank_file(job.run_dir, rank, "result")) as f:
            f.write(cloudpickle.dumps(to_cpu(result)))
    except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the launcher must hear of them
        report_error(job.run_dir, rank, exc)
        if threads_left_running(grace_s=0):   # Python would wait for them before exiting
            end_worker()
            os._exit(1)
        sys.exit(1)
    finally:
        end_worker()


def _note_joining() -> list[bool]:
    """For init=False: a list that gets an entry when the function forms a process group (it may
    destroy it again before it returns, which leaves no other trace). Where this torch has no
    `_update_default_pg` to watch, the list says "joined": nobody is blamed for leaving early."""
    c10d = dist.distributed_c10d
    real = getattr(c10d, "_update_default_pg", None)
    if real is None:
        return [True]
    joined: list[bool] = []

    def update_default_pg(pg: object) -> object:
        if pg is not None:
            joined.append(True)
        return real(pg)

    c10d._update_default_pg = update_default_pg
    return joined
