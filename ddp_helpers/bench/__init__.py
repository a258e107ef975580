"""Measure collectives the way NVIDIA's nccl-tests does: time, algbw, busbw, #wrong.

Inside ranks that already share a process group (from `launch` or `torchrun`):

    rows = sweep("all_reduce", [8, 1024, 2**20])          # one dict per message size

From a notebook, starting the ranks too:

    rows = measure("all_reduce", size_range(8, 2**20), world_size=2, backend="gloo", device="cpu")

From a shell, printing the `all_reduce_perf` table:

    torchrun --nproc-per-node=2 -m ddp_helpers.bench --collective all_reduce -b 8 -e 1G -f 2

A module per part, all of their names found here too (`bench.measure`, `bench.size_range`, ...):
`formulas` (algbw, busbw, the sizes nccl-tests rounds to, the checks of a request: no process),
`timing` (in the ranks: the buffers of a call, its time, #wrong), `sweeps` (a sweep in the ranks,
`measure` starting them, what this machine can run), `table` (nccl-tests' printed table) and
`cli` (`python -m ddp_helpers.bench`, run by `__main__`). Definitions: see `formulas`.
"""
from .cli import main, parse_args
from .formulas import (
                       COLLECTIVES,
                       DTYPES,
                       IN_PLACE,
                       NCCL_TYPE_NAMES,
                       REDOP,
                       ROOT,
                       SPLIT,
                       algbw_GBps,
                       bus_factor,
                       busbw_GBps,
                       check_collective,
                       check_counts,
                       check_setup,
                       compare,
                       human,
                       memory_per_rank,
                       parse_size,
                       plan,
                       resolve_dtype,
                       size_range,
)
from .sweeps import available_setups, check_memory, gpu_free_bytes, measure, sweep, warm_up
from .table import format_row, header
from .timing import GRAPH_ENV, count_wrong, hardware_name, pattern, prepare, rank_device, time_calls

__all__ = ["COLLECTIVES", "DTYPES", "GRAPH_ENV", "IN_PLACE", "NCCL_TYPE_NAMES", "REDOP", "ROOT", "SPLIT",
           "algbw_GBps", "available_setups", "bus_factor", "busbw_GBps", "check_collective", "check_counts",
           "check_memory", "check_setup", "compare", "count_wrong", "format_row", "gpu_free_bytes",
           "hardware_name", "header", "human", "main", "measure", "memory_per_rank", "parse_args", "parse_size",
           "pattern", "plan", "prepare", "rank_device", "resolve_dtype", "size_range", "sweep", "time_calls",
           "warm_up"]
