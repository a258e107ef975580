"""What `launch`, `spawn`, the warm `Pool` and `%%ddp` check before any process starts.

Each check returns the value to use, or raises a TypeError or ValueError that says what to write
instead: a bad argument is a clear error in the cell, with nothing started and nothing left behind.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist

from . import compat, gpu_leases
from .runtime.cells import dumps, dumps_with_sources

BACKENDS = ("gloo", "nccl", "auto")
MAX_WORLD_SIZE = 64          # one machine; past this use torchrun across nodes
MAX_TIMEOUT_S = 30 * 24 * 3600   # 30 days; far larger ones overflow torch's timeouts in the workers
MAX_SEED = 2**63 - 1         # a rank's torch seed is seed + rank, and torch takes 64-bit seeds
# What the launcher sets in every rank, as torchrun does: refused in env= (see check_env).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def check_world_size(world_size: int, name: str = "world_size") -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"{name} must be an int, got {world_size!r} ({type(world_size).__name__})")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"{name} must be between 1 and {MAX_WORLD_SIZE} on one machine, got {world_size}"
                         + (f". {NO_GPU_ZERO}" if world_size == 0 else ""))
    return world_size


# Where a 0 usually comes from: a tutorial's `world_size = torch.cuda.device_count()`.
NO_GPU_ZERO = ("A 0 usually comes from torch.cuda.device_count() on a machine without a GPU: "
               "use a number of CPU ranks instead, e.g. 2, with backend='gloo'")


def check_seed(seed: int | None) -> int | None:
    """None, or a whole number from 0 to MAX_SEED (each rank's torch seed is seed + rank)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be None or a whole number, got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed <= MAX_SEED - MAX_WORLD_SIZE:
        raise ValueError(f"seed must be between 0 and {MAX_SEED - MAX_WORLD_SIZE} (2**63 - 65), got {seed}")
    return seed


def resolve_backend(backend: str, world_size: int, env: dict | None = None) -> str:
    """Check the backend name and, for "auto", pick NCCL only if every rank gets a GPU (of those
    CUDA_VISIBLE_DEVICES leaves visible, in env= or this process's environment)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(map(repr, BACKENDS))}")
    if backend == "gloo":
        return backend
    gpus = len(gpu_leases.visible_gpus(env if isinstance(env, dict) else None))
    if backend == "auto":
        return "nccl" if compat.one_gpu_per_rank(world_size, gpus) else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend='nccl' is not available in this torch build; use 'gloo'")
        if not compat.one_gpu_per_rank(world_size, gpus):
            raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} "
                             f"but this machine has {gpus} GPU(s). Use backend='gloo' or 'auto'.")
    return backend


def pickle_job(fn: Callable, args: Sequence, kwargs: dict | None) -> tuple[bytes, dict]:
    """cloudpickle fn and its arguments now, so a bad one fails before any process starts.
    Returns the bytes and the sources of the notebook cells their code comes from."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    bad_keys = [k for k in (kwargs or {}) if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"kwargs keys must be strings (they become keyword argument names), got {bad_keys!r}")
    for what, value in (("the function", fn), ("args", tuple(args)), ("kwargs", kwargs or {})):
        try:
            dumps(value)
        except Exception as exc:
            raise TypeError(
                f"cannot send {what} to the workers: {type(exc).__name__}: {exc}. Everything a "
                "worker needs is pickled (with cloudpickle); open files, locks, sockets, "
                "generators and live process groups cannot be. Create them inside the function."
            ) from None
    return dumps_with_sources((fn, tuple(args), kwargs or {}))


def check_gpu_wait(seconds: float | None) -> float:
    seconds = gpu_leases.default_wait() if seconds is None else seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_TIMEOUT_S:
        raise ValueError(f"gpu_wait must be a number of seconds from 0 to {MAX_TIMEOUT_S}, got {seconds!r}")
    return float(seconds)


def check_timeout(timeout: float) -> float:
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_TIMEOUT_S):  # also rejects nan and inf
        raise ValueError(f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S} "
                         f"({MAX_TIMEOUT_S // 86400} days), got {timeout!r}")
    return float(timeout)


def check_env(env: dict[str, str] | None) -> dict[str, str]:
    """The extra environment for the ranks: strings only, and none of the variables the launcher
    sets in each rank as torchrun does (one there made the ranks wait for ranks that never come)."""
    env = dict(env or {})
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"env keys and values must be strings, got {bad!r}")
    for name in env:
        if name in TORCHRUN_VARIABLES or name.startswith("TORCHELASTIC_"):
            raise ValueError(f"env={{{name!r}: ...}}: the launcher sets {name} in every rank, as torchrun "
                             f"does ({_set_by_the_launcher(name)}); leave it out of env")
    return env


def _set_by_the_launcher(name: str) -> str:
    if name.endswith("WORLD_SIZE"):
        return "the number of ranks is world_size= (nprocs= for spawn, -n for %%ddp)"
    if name.endswith("RANK"):
        return "each rank gets its own, 0 to world_size - 1"
    if name.startswith("MASTER_"):
        return "each launch has a rendezvous store of its own, on a port the OS picks"
    return "torchrun's own bookkeeping"
