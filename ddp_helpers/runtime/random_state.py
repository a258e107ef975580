"""A rank's random state: its own, as a process that torchrun starts has its own.

Every rank is a fork of the same fork server, so without this each rank (and each launch) would
start from the server's random state: `torch.rand(1)` would give the same number on every rank,
launch after launch. A fresh Python process, as torchrun starts one, seeds itself from the operating
system's entropy (torch's CPU generator, NumPy's global generator, Python's `random`; torch's CUDA
generators are made, and seeded, when CUDA first starts in the process). `reseed` gives a rank that.

    reseed(rank, None)   # fresh entropy: different on every rank and in every launch (the default)
    reseed(rank, 0)      # reproducible: seed + rank for torch, NumPy and `random` (what Accelerate's
                         # set_seed(seed, device_specific=True) does): ranks differ, runs repeat

torch's CUDA generators are seeded lazily (`torch.seed` and `torch.manual_seed` queue the seed for
when CUDA starts), so reseeding never starts CUDA in a rank that does not use it.
"""
from __future__ import annotations

import random
import sys
from typing import Any

import torch

NUMPY_SEEDS = 2 ** 32   # NumPy's legacy global generator takes seeds below this


def reseed(rank: int, seed: int | None) -> int:
    """Reseed torch (CPU and, lazily, every GPU), NumPy's global generator and Python's `random`
    in this process. `seed=None`: from fresh entropy; an int: `seed + rank` (NumPy: modulo 2**32).
    Returns torch's new seed (`torch.initial_seed()`)."""
    if seed is None:
        torch_seed = torch.seed()   # fresh entropy for the CPU generator, the same value for the GPUs
        random.seed()               # fresh entropy from os.urandom
        numpy = sys.modules.get("numpy")   # not imported yet: its first import seeds it afresh anyway
        if numpy is not None:
            numpy.random.seed()
        return torch_seed
    torch_seed = seed + rank
    torch.manual_seed(torch_seed)
    random.seed(torch_seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(torch_seed % NUMPY_SEEDS)
    return torch_seed


def _numpy() -> Any:
    """NumPy, imported if it can be (a seeded run must seed it even before the learner imports it)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy
