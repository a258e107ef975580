"""The table that nccl-tests' `all_reduce_perf` prints, for a sweep's rows: `header`, then `format_row`
for each size. `sweep(verbose=True)` and the command line print it; notebook 04 prints stored rows with it.
"""
from __future__ import annotations

import torch

from .. import machine


def _fixed(value: float, width: int) -> str:
    """A number in `width` characters, as nccl-tests' getFloatStr prints it."""
    for spec in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{spec}}"
        if len(text) <= width:
            return text
    return f"{value:{width}.{1 if width >= 7 else 0}e}"


def header(info: dict) -> str:
    """The nccl-tests column header, after one line that says what was measured."""
    placement = "in-place" if info["in_place"] else "out-of-place"
    nccl = machine.nccl_version() if info["backend"] == "nccl" else None
    cols = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s"
    return "\n".join([   # lines of at most 100 characters: a notebook would wrap them mid-word
        f"# {info['collective']} on {info['world_size']} ranks: backend {info['backend']}, device "
        f"{info['device']}, torch {torch.__version__}" + (f", NCCL {nccl}" if nccl else ""),
        f"# on {info['hardware']}",
        f"# iters {info['iters']}, warm-up {info['warmup']}, CUDA graph {'on' if info['cuda_graph'] else 'off'}",
        "#",
        "# %10s  %12s  %8s  %6s  %6s           %s" % ("", "", "", "", "", placement),  # noqa: UP031
        cols % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"),
        cols % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""),
    ])


def format_row(row: dict) -> str:
    """One line of the table, in nccl-tests' `all_reduce_perf` layout."""
    # printf-style on purpose: the columns read as nccl-tests' own format strings
    return ("%12d  %12d  %8s  %6s  %6s" % (row["bytes"], row["count"], row["dtype"], row["redop"],  # noqa: UP031
                                           row["root"])
            + "  %7s  %6s  %6s  %6d" % (_fixed(row["time_us"], 7), _fixed(row["algbw_GBps"], 6),  # noqa: UP031
                                        _fixed(row["busbw_GBps"], 6), row["wrong"]))
