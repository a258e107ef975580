"""Measure collectives the way NVIDIA's nccl-tests does: time, algbw, busbw, #wrong.

Inside ranks that already share a process group (from `launch` or `torchrun`):

    rows = sweep("all_reduce", [8, 1024, 2**20])          # one dict per message size

From a notebook, starting the ranks too:

    rows = measure("all_reduce", size_range(8, 2**20), world_size=2, backend="gloo", device="cpu")

From a shell, printing the `all_reduce_perf` table:

    torchrun --nproc-per-node=2 -m ddp_helpers.bench --collective all_reduce -b 8 -e 1G -f 2

Definitions (nccl-tests `doc/PERFORMANCE.md`), n ranks, t seconds per call:
- S, the "size" column, is the largest buffer of the call: the whole vector for
  all_reduce, broadcast, reduce and sendrecv; the gathered (all_gather), scattered
  (reduce_scatter) or exchanged (all_to_all) vector of all ranks for the others.
- algbw = S / t, busbw = algbw * factor, GB = 1e9 bytes. The factor turns algbw
  into the bytes each link must carry, so busbw is comparable with the hardware's
  peak whatever the collective: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
  reduce_scatter, all_to_all, 1 for broadcast, reduce, sendrecv.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from . import machine, reference
from .collectives import barrier, renamed

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
SPLIT = ("all_gather", "reduce_scatter", "all_to_all")   # S holds one chunk per rank
IN_PLACE = ("all_reduce", "broadcast", "reduce")         # torch has no out-of-place form of these
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum", "reduce": "sum", "sendrecv": "sum"}  # as nccl-tests prints
ROOT = {"broadcast": 0, "reduce": 0}                     # -1: no root
DTYPES = {"float": torch.float32, "float32": torch.float32, "half": torch.float16, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "double": torch.float64, "float64": torch.float64,
          "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
NCCL_TYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16",
                   torch.float64: "double", torch.int8: "int8", torch.uint8: "uint8",
                   torch.int32: "int32", torch.int64: "int64"}

# For cuda_graph=True: NCCL by default synchronises every captured call so that captured and
# uncaptured calls may run at the same time on one communicator; that costs about 5 µs a call
# (measured on 2 H200s: 10 -> 5 µs for small all_reduces). A sweep never runs both at once.
GRAPH_ENV = {"NCCL_GRAPH_MIXING_SUPPORT": "0"}



# ------------------------------------------------- formulas (no processes needed)
def bus_factor(collective, world_size):
    """nccl-tests' factor from algbw to busbw for n = world_size ranks."""
    check_collective(collective)
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in SPLIT:
        return (n - 1) / n
    return 1.0


def plan(collective, nbytes, elem_size, world_size):
    """(count, S) for a requested size, as nccl-tests rounds it: count is what the
    "count" column shows (per-rank chunk for all_gather / reduce_scatter / all_to_all),
    S the bytes the "size" column shows. nccl-tests also rounds each chunk down to
    16 bytes, which only changes sizes under 16 bytes per rank."""
    check_collective(collective)
    if nbytes < elem_size:
        raise ValueError(f"message size {nbytes} B is smaller than one element ({elem_size} B)")
    count = nbytes // elem_size
    if collective in SPLIT:
        count //= world_size
        if count == 0:
            raise ValueError(f"{collective} over {world_size} ranks needs at least {world_size} elements "
                             f"({world_size * elem_size} B), got {nbytes} B")
        return count, count * elem_size * world_size
    return count, count * elem_size


def algbw_GBps(nbytes, time_us):
    """Algorithm bandwidth S / t in GB/s (1e9 bytes per second)."""
    return nbytes / (time_us * 1e-6) / 1e9


def busbw_GBps(collective, nbytes, time_us, world_size):
    """Bus bandwidth: algbw times nccl-tests' factor for this collective."""
    return algbw_GBps(nbytes, time_us) * bus_factor(collective, world_size)


def compare(rows, baseline, key="algbw_GBps"):
    """rows[key] / baseline[key] at each message size both have, e.g. NCCL against Gloo:
    a list of {"bytes", "ours", "baseline", "ratio"}."""
    base = {r["bytes"]: r[key] for r in baseline}
    return [{"bytes": r["bytes"], "ours": r[key], "baseline": base[r["bytes"]], "ratio": r[key] / base[r["bytes"]]}
            for r in rows if base.get(r["bytes"])]


# ------------------------------------------------------------------ input checks
def check_collective(collective):
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}: choose one of {', '.join(COLLECTIVES)}")


def resolve_dtype(dtype):
    """torch.float32 or a name ('float', 'half', 'bfloat16', ...) -> torch.dtype."""
    if isinstance(dtype, torch.dtype) and dtype in NCCL_TYPE_NAMES:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


def check_setup(backend, device, cuda_graph, collective=None):
    """Refuse combinations that cannot work, with the reason."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("NCCL only moves CUDA tensors: use device='cuda', or backend='gloo' for CPU tensors")
    if backend == "gloo" and device == "cuda" and collective == "sendrecv":
        # PyTorch docs, backends table: Gloo has send/recv for CPU tensors only
        # (on 2 H200s, torch 2.11 it fails with "writev ...: Bad address")
        raise ValueError("Gloo cannot send/recv CUDA tensors: use device='cpu', or backend='nccl'")
    if cuda_graph and backend != "nccl":
        raise ValueError(f"cuda_graph=True needs backend='nccl': {backend} collectives run on the CPU "
                         "and cannot be captured in a CUDA graph")
    if cuda_graph and device != "cuda":
        raise ValueError("cuda_graph=True needs device='cuda'")


def check_counts(iters, warmup):
    if not (isinstance(iters, int) and iters >= 1 and isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"iters must be an int >= 1 and warmup an int >= 0, got {iters!r}, {warmup!r}")


def available_setups(world_size=2):
    """(backend, device) pairs this machine can run with world_size ranks.
    Counts GPUs without initialising CUDA here (safe in a notebook kernel)."""
    gpus = machine.gpu_count()
    setups = []
    if dist.is_gloo_available():
        setups.append(("gloo", "cpu"))
        if gpus >= 1:
            setups.append(("gloo", "cuda"))   # Gloo copies CUDA tensors through the host
    if dist.is_nccl_available() and gpus >= world_size:
        setups.append(("nccl", "cuda"))       # one GPU per rank
    return setups


# ------------------------------------------------------------ sizes and inputs
def parse_size(text):
    """'8', '64K', '1M', '1G' -> bytes (K = 1024, as nccl-tests' -b/-e)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read size {text!r}: use bytes, or a number with K, M or G (powers of 1024)")
    return int(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " ")


def size_range(min_bytes, max_bytes, factor=2):
    """min_bytes, min_bytes*factor, ... up to max_bytes, like nccl-tests -b -e -f."""
    min_bytes, max_bytes = parse_size(min_bytes), parse_size(max_bytes)
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def memory_per_rank(max_bytes, dtype):
    """Bytes a rank holds at once at its largest size: the buffers, and the int64 arithmetic that makes
    and checks the patterns. Measured peaks (ru_maxrss, 2 Gloo ranks, CPU) were 5.2x the size for
    float64, 8.2x for float32, 14.2x for bfloat16 and 26.2x for int8: 2 + 24 / element size."""
    return max_bytes * (2 + 24 / resolve_dtype(dtype).itemsize)


def check_memory(max_bytes, dtype, ranks, device, gpu_free=None):
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


def gpu_free_bytes():
    """Free bytes of each visible GPU (torch.cuda.mem_get_info), read in a child process so that CUDA
    is not initialised here (a notebook's kernel); [] without GPUs."""
    if not machine.gpu_count():
        return []
    code = "import torch; print([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 and done.stdout else []


def human(nbytes):
    """1099511627776 -> '1 TiB', 24107876352 -> '22.5 GiB' (powers of 1024, as the sizes are given)."""
    for power, unit in reversed(list(enumerate(("B", "KiB", "MiB", "GiB", "TiB", "PiB")))):
        if nbytes >= 1024 ** power or power == 0:
            return f"{nbytes / 1024 ** power:.1f}".removesuffix(".0") + f" {unit}"


def pattern(count, seed, dtype, device, offset=0):
    """Small integers (0..6) that differ by rank and position: sums of up to ~36
    ranks stay exact even in bfloat16, so results can be compared exactly."""
    i = torch.arange(offset, offset + count, device=device)
    return ((i + 3 * seed) % 7).to(dtype)


def _sum_over_ranks(count, n, dtype, device, offset=0):
    total = pattern(count, 0, dtype, device, offset)
    for seed in range(1, n):
        total += pattern(count, seed, dtype, device, offset)
    return total


def prepare(collective, count, dtype, device):
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


# ------------------------------------------------------------------- timing
def _device(device):
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but this process sees no CUDA GPU")
    index = int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def time_calls(call, iters, warmup, device, cuda_graph=False):
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


def count_wrong(collective, count, dtype, device):
    """nccl-tests' #wrong on this rank: run once on fresh inputs, count elements that differ."""
    call, out, expected = prepare(collective, count, dtype, device)
    call()
    want = expected()
    return 0 if want is None else int((out != want).sum())


def hardware_name(device):
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


# -------------------------------------------------------------------- sweep
def warm_up(collective, counts, dtype, device, calls, timed, cuda_graph=False):
    """Untimed calls before a sweep, as nccl-tests' TimeTest does (`src/common.cu`: its warm-up
    iterations at the largest size, then at the smallest): the first calls of a process pay one-time
    costs (the connections' first use, buffers and pages touched for the first time, NCCL's
    communicator) that would otherwise land on the first size timed. Each size runs through `timed`,
    its result thrown away, so that a timer of one's own (and a CUDA graph) is warmed up too."""
    for count in counts:
        call = prepare(collective, count, dtype, device)[0]
        timed(call, 1, calls, device, cuda_graph)
        del call


def sweep(collective, sizes, dtype=torch.float32, device="cpu", iters=20, warmup=5, cuda_graph=False,
          verbose=False, timer=None):
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
    dev = _device(device)
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
        call, _, _ = prepare(collective, count, dtype, dev)
        seconds = timed(call, iters, warmup, dev, cuda_graph)
        del call  # frees the timed buffers before the check makes its own
        wrong = count_wrong(collective, count, dtype, dev)
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


def measure(collective="all_reduce", sizes=(8, 1024, 2**20), world_size=2, backend="gloo", device="cpu",
            dtype=torch.float32, iters=20, warmup=5, cuda_graph=False, env=None, timeout=300, verbose=False,
            timer=None):
    """Start `world_size` ranks with `launch`, run `sweep` there, return rank 0's rows.

    Checks the arguments here first, so a mistake fails before any process starts.
    env: extra environment for the ranks, e.g. {"NCCL_P2P_DISABLE": "1"}; with
         cuda_graph, GRAPH_ENV is added for what neither env nor os.environ sets.
    verbose: print the nccl-tests table live (otherwise the ranks stay quiet).
    timer: how to time each size, as in `sweep` (it travels to the ranks with cloudpickle).
    """
    from .launcher import launch
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


# ------------------------------------------------------------ table and CSV
def _fixed(value, width):
    """A number in `width` characters, as nccl-tests' getFloatStr prints it."""
    for spec in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{spec}}"
        if len(text) <= width:
            return text
    return f"{value:{width}.{1 if width >= 7 else 0}e}"


def header(info):
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
        "# %10s  %12s  %8s  %6s  %6s           %s" % ("", "", "", "", "", placement),
        cols % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"),
        cols % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""),
    ])


def format_row(row):
    """One line of the table, in nccl-tests' `all_reduce_perf` layout."""
    return ("%12d  %12d  %8s  %6s  %6s" % (row["bytes"], row["count"], row["dtype"], row["redop"], row["root"])
            + "  %7s  %6s  %6s  %6d" % (_fixed(row["time_us"], 7), _fixed(row["algbw_GBps"], 6),
                                        _fixed(row["busbw_GBps"], 6), row["wrong"]))


# ------------------------------------------------------------- command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.bench", description=__doc__.splitlines()[0])
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
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))) if "RANK" in os.environ else args.nproc
    args.local_ranks = ranks
    gpus = machine.gpu_count()
    one_gpu_each = gpus >= ranks and dist.is_nccl_available()
    if args.backend == "nccl" and not one_gpu_each:
        p.error(f"--backend nccl needs one GPU per rank: {ranks} ranks here, {gpus} GPU(s)")
    chosen = [name for name in ("device", "backend") if getattr(args, name) is None]
    args.device = args.device or ("cuda" if one_gpu_each or args.backend == "nccl" else "cpu")
    args.backend = args.backend or ("nccl" if args.device == "cuda" and one_gpu_each else "gloo")
    why = f"{ranks} rank(s), {gpus} GPU(s)" + ("" if one_gpu_each or not gpus else ": NCCL needs one GPU per rank")
    args.chosen = f"# chose {' and '.join(f'{n} {getattr(args, n)}' for n in chosen)} ({why})" if chosen else None
    return args


def main(argv=None):
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


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:  # bad input: one clear line, not a traceback
        sys.exit(f"error: {exc}")
