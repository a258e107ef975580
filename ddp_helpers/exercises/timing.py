"""Checker for notebook 04's exercise: timing an all-reduce as nccl-tests times it, and predicting it.

The learner's function runs on 2 and 3 Gloo ranks with every collective and the clocks of `time`
watched (`spies.CallLog`, this rank's own thread only): the checker reads the order of the calls
(warm-up, barrier, clock, timed calls, clock, the all_reduce of the time), the bytes and op of each
all_reduce, and the values of the small one before and after, and names the first rule broken.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .spies import COLLECTIVES, CallLog, op_name
from .verdict import Verdict, near

__all__ = ["check_all_reduce_timing"]

CLOCKS = ("perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns", "time_ns")


def _describe_collective(name, args, kwargs):
    event = {"kind": name}
    tensor = args[0] if args else kwargs.get("tensor")
    if name == "all_reduce" and isinstance(tensor, torch.Tensor):
        op = args[1] if len(args) > 1 else kwargs.get("op", dist.ReduceOp.SUM)
        event.update(bytes=tensor.numel() * tensor.element_size(), op=op_name(op))
        if tensor.numel() <= 8:
            event["before"] = tensor.detach().double().flatten().tolist()
            event["tensor"] = tensor
    return event


def _after_collective(event, args, kwargs, result):
    if "tensor" in event:
        event["after"] = event.pop("tensor").detach().double().flatten().tolist()


def _clock_reading(name, args, kwargs):
    return {"kind": "clock", "ns": name.endswith("_ns")}


def _read_clock(event, args, kwargs, value):
    event["seconds"] = value / 1e9 if event.pop("ns") else value


def _timing_in_rank(fn, nbytes, iters, warmup):
    """Inside a rank: fn(nbytes, iters, warmup) with every collective and the clocks of `time` wrapped to
    write down, in order, what this rank's thread does: each collective (an all_reduce with its bytes, its
    op, and for a small tensor its values before and after), each clock reading. Returns (result, events)."""
    log = CallLog(this_thread=True)
    with log.watching(COLLECTIVES, dist, _describe_collective, _after_collective), \
            log.watching(CLOCKS, time, _clock_reading, _read_clock):
        result = fn(nbytes, iters, warmup)
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        result = result.item()
    events = [{k: v for k, v in e.items() if k not in ("tensor", "ns")} for e in log.notes]
    return result, events


def _timing_order_problem(events, nbytes, iters, warmup):
    """What is wrong with the order of one rank's calls, or None; and the seconds per call its clock
    readings around the timed calls give (None where no clock of `time` was seen)."""
    others = [e["kind"] for e in events if e["kind"] not in ("all_reduce", "barrier", "clock")]
    if others:
        return (f"you called dist.{others[0]}: timing an all-reduce needs only dist.all_reduce and "
                f"dist.barrier (the mean over ranks is an all_reduce too)"), None
    payload = [i for i, e in enumerate(events) if e["kind"] == "all_reduce" and e.get("bytes") == nbytes]
    if not payload:
        sizes = sorted({e.get("bytes") for e in events if e["kind"] == "all_reduce"})
        return (f"no all_reduce of {nbytes} bytes" + (f" (yours carried {sizes} bytes)" if sizes else "")
                + f": all_reduce a tensor of nbytes // 4 = {nbytes // 4} float32 elements, e.g. "
                  f"torch.ones(nbytes // 4)"), None
    barriers = [i for i, e in enumerate(events) if e["kind"] == "barrier" and i < payload[-1]]
    if not barriers:
        return ("no dist.barrier() before the timed calls: the ranks do not start together, and a rank that "
                "arrives first times its wait for the others. Call dist.barrier() after the warm-up, then "
                "start the clock"), None
    start_line = barriers[-1]
    warm = [i for i in payload if i < start_line]
    timed = [i for i in payload if i > start_line]
    if not warm:
        return ("no warm-up: no all_reduce before dist.barrier(). The first calls of a process pay one-time "
                "costs (first use of the connections, buffers, pages): make `warmup` untimed calls first, "
                "then the barrier, then the clock"), None
    if not timed:
        return "no all_reduce after dist.barrier(): time `iters` calls after it", None
    clocks = [i for i, e in enumerate(events) if e["kind"] == "clock"]
    per_call = None
    if clocks:
        before = [i for i in clocks if i < timed[0]]
        after = [i for i in clocks if i > timed[-1]]
        if not before or before[-1] < start_line:
            return ("the clock starts before dist.barrier(): a rank that reaches the barrier first would time "
                    "its wait for the others. Read the clock after the barrier, just before the timed calls"), None
        if not after:
            return "no clock reading after the last timed call: read the clock again when the calls are done", None
        per_call = (events[after[0]]["seconds"] - events[before[-1]]["seconds"]) / iters
    if len(warm) != warmup:
        return (f"{len(warm)} warm-up all_reduce(s) before the barrier, but the checker asked for "
                f"warmup={warmup}: use the argument"), per_call
    if len(timed) != iters:
        return (f"{len(timed)} timed all_reduce(s) after the barrier, but the checker asked for iters={iters}: "
                f"use the argument"), per_call
    return None, per_call




def _timing_mean_problem(runs, world_size, iters):
    """What is wrong with the mean over ranks (the same number on every rank, the mean of each rank's
    seconds per call), or None."""
    results = [result for result, _, _ in runs]
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in results):
        bad = next(r for r in results if not isinstance(r, (int, float)) or isinstance(r, bool))
        return f"return a number, the mean seconds per call; got {bad!r} ({type(bad).__name__})"
    if not all(math.isfinite(r) and r > 0 for r in results):
        return f"the time per call must be a positive number of seconds; got {results}"
    if any(not near(r, results[0], 1e-9) for r in results):
        shown = ", ".join(f"rank {rank} {value:.6g} s" for rank, value in enumerate(results))
        return (f"the ranks returned different times ({shown}): each rank returned its own. The mean over ranks: "
                f"put this rank's seconds per call in a tensor, dist.all_reduce it (a sum) and divide by "
                f"dist.get_world_size(), so that every rank returns the same number")
    means = [next((e for i, e in reversed(list(enumerate(events))) if e["kind"] == "all_reduce" and "after" in e), None)
             for _, events, _ in runs]
    if any(m is None for m in means):
        return ("every rank returned the same time, but not through an all_reduce of the ranks' times: "
                "all_reduce a tensor holding this rank's seconds per call, then divide by the world size")
    mine = [m["before"][0] for m in means]
    total = means[0]["after"][0]
    want = total if means[0]["op"] == "AVG" else total / world_size
    got = results[0]
    if not near(got, want):
        if means[0]["op"] == "SUM" and near(got, total):
            return (f"you returned the sum of the ranks' times ({got:.6g} s): divide it by "
                    f"dist.get_world_size() = {world_size}")
        for k in range(1, 9):
            if k != world_size and near(got, total / k):
                return f"you divided by {k}, but the world size here is {world_size}: use dist.get_world_size()"
        return (f"you returned {got:.6g} s, but the all_reduce of the ranks' times gave {total:.6g} s "
                f"over {world_size} ranks: return their mean, {want:.6g} s")
    for rank, (value, (_, _, per_call)) in enumerate(zip(mine, runs)):
        if per_call is None or near(value, per_call, 0.2):
            continue
        if near(value, per_call * iters, 0.2):
            return (f"rank {rank}'s time is for all {iters} calls together ({value:.6g} s): divide by iters for "
                    f"the time per call")
        if near(value, per_call * 1e6, 0.2) or near(value, per_call * 1e3, 0.2):
            return f"rank {rank} gave {value:.6g}: return seconds per call (the clock's unit), not µs or ms"
        return (f"rank {rank}'s time per call is {value:.6g} s, but its clock readings around the timed calls "
                f"give {per_call:.6g} s per call: time from just before the first timed call to just after the last")
    return None


def check_all_reduce_timing(fn: Callable[[int, int, int], float], predicted_us: float | None,
                            nbytes: int = 3 * 2**20, iters: int = 20, warmup: int = 5,
                            tolerance: float = 3.0) -> Verdict:
    """Notebook 04: `fn(nbytes, iters, warmup)`, run on every rank, returns the seconds per dist.all_reduce
    of `nbytes` bytes of float32, the mean over the ranks, timed as nccl-tests times it; `predicted_us` is
    the alpha-beta model's time for that size, in µs.

    Runs fn on 2 and 3 Gloo ranks with every collective and the clocks of `time` wrapped, and checks the
    algorithm on each rank: `warmup` all_reduces of `nbytes` bytes, then dist.barrier(), then the clock,
    then `iters` all_reduces, then the clock, then one all_reduce of the time; every rank returns the same
    mean. Then compares the prediction with the 2-rank measurement, loosely (within a factor of
    `tolerance` either way: times on a busy machine vary). Reference solution:
    ddp_helpers/solutions.py, my_all_reduce_time."""
    from .. import bench
    from ..bench_plots import human_bytes
    title = "my_all_reduce_time"
    if not (isinstance(nbytes, int) and nbytes >= 4 and isinstance(iters, int) and iters >= 1
            and isinstance(warmup, int) and warmup >= 1):
        raise ValueError(f"need nbytes >= 4, iters >= 1 and warmup >= 1 (whole numbers), "
                         f"got {nbytes!r}, {iters!r}, {warmup!r}")
    check, measured_us = runner.Checker(title, fn), None
    problems, notes = check.problems, check.notes
    for world_size in check.each((2, 3)):
        label = f"world_size={world_size}"
        runs = check.run(
            _timing_in_rank, world_size, (fn, nbytes, iters, warmup), label, timeout=30,
            never_finished="they wait in a collective another rank never calls. Every rank must make the "
                           "same calls: the warm-up, the barrier, the timed all_reduces and the all_reduce "
                           "of the time",
            partner_left=": its partner had left. Does every rank make the same calls, the same number of times?")
        if runs is None:
            continue
        checked = []
        for rank, (result, events) in enumerate(runs):
            problem, per_call = _timing_order_problem(events, nbytes, iters, warmup)
            if problem:
                problems.append(f"{label}, rank {rank}: {problem}")
                break
            checked.append((result, events, per_call))
        else:
            problem = _timing_mean_problem(checked, world_size, iters)
            if problem:
                problems.append(f"{label}: {problem}")
            elif world_size == 2:
                measured_us = checked[0][0] * 1e6
        if problems:
            break
    if measured_us is not None:
        busbw = bench.busbw_GBps("all_reduce", nbytes, measured_us, 2)
        notes.append(f"measured: all_reduce of {human_bytes(nbytes)} on 2 Gloo ranks, {measured_us:,.0f} µs per "
                     f"call (algbw = busbw = {busbw:.2f} GB/s)")
    if not isinstance(predicted_us, (int, float)) or isinstance(predicted_us, bool) or not predicted_us > 0:
        problems.append(f"my_prediction_us is {predicted_us!r}: set it to the model's time for "
                        f"{nbytes:,} B, t = α + S/β in µs (β in GB/s is 1e3 bytes per µs)")
    elif measured_us is not None:
        ratio = predicted_us / measured_us
        notes.append(f"predicted: {predicted_us:,.0f} µs, {ratio:.2f}× the measurement")
        if not 1 / tolerance <= ratio <= tolerance:
            unit = next((name for factor, name in ((1e3, "ms"), (1e-3, "ms"), (1e6, "s"), (1e-6, "s"))
                         if 1 / 10 <= ratio / factor <= 10), None)   # a busy machine varies 3x and more
            hint = (f"a unit slip? It is off by about {'1e3' if unit == 'ms' else '1e6'}: α is in µs, "
                    f"S in bytes, β in GB/s = 1e3 bytes per µs" if unit else
                    "check t = α + S/β: α in µs, S in bytes, β in GB/s = 1e3 bytes per µs (if it still misses, "
                    "the machine may be busier now than during the sweep: run both again)")
            problems.append(f"your prediction is {ratio:.2f}× the measurement, more than {tolerance:g}× off: "
                            f"{hint}")
    return check.verdict()

