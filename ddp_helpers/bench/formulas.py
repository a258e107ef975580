"""nccl-tests' arithmetic, and the checks of what a measurement is asked for: no process, no tensor moved.

Definitions (nccl-tests `doc/PERFORMANCE.md`), n ranks, t seconds per call:
- S, the "size" column, is the largest buffer of the call: the whole vector for
  all_reduce, broadcast, reduce and sendrecv; the gathered (all_gather), scattered
  (reduce_scatter) or exchanged (all_to_all) vector of all ranks for the others.
- algbw = S / t, busbw = algbw * factor, GB = 1e9 bytes. The factor turns algbw
  into the bytes each link must carry, so busbw is comparable with the hardware's
  peak whatever the collective: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
  reduce_scatter, all_to_all, 1 for broadcast, reduce, sendrecv.
"""
from __future__ import annotations

import re

import torch

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


# ------------------------------------------------------------------ the formulas
def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' factor from algbw to busbw for n = world_size ranks."""
    check_collective(collective)
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in SPLIT:
        return (n - 1) / n
    return 1.0


def plan(collective: str, nbytes: int, elem_size: int, world_size: int) -> tuple[int, int]:
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


def algbw_GBps(nbytes: float, time_us: float) -> float:
    """Algorithm bandwidth S / t in GB/s (1e9 bytes per second)."""
    return nbytes / (time_us * 1e-6) / 1e9


def busbw_GBps(collective: str, nbytes: float, time_us: float, world_size: int) -> float:
    """Bus bandwidth: algbw times nccl-tests' factor for this collective."""
    return algbw_GBps(nbytes, time_us) * bus_factor(collective, world_size)


def compare(rows: list[dict], baseline: list[dict], key: str = "algbw_GBps") -> list[dict]:
    """rows[key] / baseline[key] at each message size both have, e.g. NCCL against Gloo:
    a list of {"bytes", "ours", "baseline", "ratio"}."""
    base = {r["bytes"]: r[key] for r in baseline}
    return [{"bytes": r["bytes"], "ours": r[key], "baseline": base[r["bytes"]], "ratio": r[key] / base[r["bytes"]]}
            for r in rows if base.get(r["bytes"])]


# ------------------------------------------------------------------ input checks
def check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}: choose one of {', '.join(COLLECTIVES)}")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 or a name ('float', 'half', 'bfloat16', ...) -> torch.dtype."""
    if isinstance(dtype, torch.dtype) and dtype in NCCL_TYPE_NAMES:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


def check_setup(backend: str, device: str, cuda_graph: bool, collective: str | None = None) -> None:
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


def check_counts(iters: int, warmup: int) -> None:
    if not (isinstance(iters, int) and iters >= 1 and isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"iters must be an int >= 1 and warmup an int >= 0, got {iters!r}, {warmup!r}")


# ------------------------------------------------------------------ sizes
def parse_size(text: str | int) -> int:
    """'8', '64K', '1M', '1G' -> bytes (K = 1024, as nccl-tests' -b/-e)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read size {text!r}: use bytes, or a number with K, M or G (powers of 1024)")
    return int(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " ")


def size_range(min_bytes: str | int, max_bytes: str | int, factor: int = 2) -> list[int]:
    """min_bytes, min_bytes*factor, ... up to max_bytes, like nccl-tests -b -e -f."""
    min_bytes, max_bytes = parse_size(min_bytes), parse_size(max_bytes)
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def memory_per_rank(max_bytes: int, dtype: torch.dtype | str) -> float:
    """Bytes a rank holds at once at its largest size: the buffers, and the int64 arithmetic that makes
    and checks the patterns. Measured peaks (ru_maxrss, 2 Gloo ranks, CPU) were 5.2x the size for
    float64, 8.2x for float32, 14.2x for bfloat16 and 26.2x for int8: 2 + 24 / element size."""
    return max_bytes * (2 + 24 / resolve_dtype(dtype).itemsize)


def human(nbytes: float) -> str:
    """1099511627776 -> '1 TiB', 24107876352 -> '22.5 GiB' (powers of 1024, as the sizes are given)."""
    for power, unit in reversed(list(enumerate(("B", "KiB", "MiB", "GiB", "TiB", "PiB")))):
        if nbytes >= 1024 ** power or power == 0:
            return f"{nbytes / 1024 ** power:.1f}".removesuffix(".0") + f" {unit}"
