"""What this machine has: CPU cores, GPUs, distributed backends, versions.

GPUs are counted without initialising CUDA in the calling process (torch asks
NVML first), so a notebook kernel can check for GPUs and still start workers
that use CUDA themselves.
"""
import os
import platform
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist


def cpu_count():
    """CPU cores this process may run on (respects taskset/cgroup affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_count():
    """Number of CUDA GPUs visible to this process, 0 without CUDA.

    Does not initialise CUDA here: `torch.cuda.device_count()` counts through
    NVML when it can and never creates a CUDA context (`torch.cuda.is_initialized()`
    stays False), so forking or starting workers afterwards stays safe.
    """
    if not torch.backends.cuda.is_built():
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver counts as no GPU
        return 0


def available_backends():
    """The torch.distributed backends compiled into this torch build."""
    found = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    return [name for name, ok in found.items() if ok]


def nccl_version():
    """NCCL version as 'major.minor.patch', or None without NCCL."""
    if not dist.is_nccl_available() or not torch.backends.cuda.is_built():
        return None
    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:
        return None


def gpu_topology():
    """`nvidia-smi topo -m` (how the GPUs are linked), or None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def gpu_names():
    """Names of the visible GPUs (read through NVML by nvidia-smi, no CUDA context)."""
    if gpu_count() == 0 or shutil.which("nvidia-smi") is None:
        return []
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def describe():
    """One dict with everything notebook 00 shows about this machine."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch built with)": torch.version.cuda,
        "nccl": nccl_version(),
        "backends": available_backends(),
        "cpu cores": cpu_count(),
        "gpus": gpu_count(),
        "gpu names": gpu_names(),
        "platform": f"{platform.system()} {platform.machine()}",
    }


def summary_line():
    """The one line every notebook prints first, so each output reads in context."""
    gpus = gpu_count()
    gpu_text = f"{gpus} GPU(s): {', '.join(sorted(set(gpu_names())))}" if gpus else "no GPU"
    return (f"This machine: {cpu_count()} CPU cores, {gpu_text}; torch {torch.__version__}, "
            f"Python {platform.python_version()} ({sys.platform})")

