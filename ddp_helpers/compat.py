"""What torch's versions and machines differ in, decided in one place.

- Two collectives were renamed in torch 2.14 (`renamed`).
- `dist.barrier()` under NCCL should name the rank's GPU (`barrier`).
- The loopback interface is 'lo' on Linux and 'lo0' on macOS (`loopback_interface`).
- NCCL needs a GPU of its own for every rank on a machine (`one_gpu_per_rank`).
- Two of DDP's arguments depend on the installed torch (`ddp_options`).
- A finished torchrun worker may abort in the interpreter's teardown (`exit_skipping_teardown`).

The trainer, the launcher, the benchmark and the speed layer all ask here.
"""
from __future__ import annotations

import inspect
import os
import socket
import sys

import torch
import torch.distributed as dist

from . import machine

# torch 2.14 renamed the one-tensor forms of two collectives (the old names still work there, with
# a FutureWarning); torch 2.11 has only the old names. Notebook 03 shows both names in its cells.
RENAMED = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def renamed(new_name: str):
    """dist.<new_name> where this torch has it, else the same collective under its old name."""
    return getattr(dist, new_name, None) or getattr(dist, RENAMED[new_name])


def barrier(device: torch.device | None = None, group=None) -> None:
    """dist.barrier(), naming this rank's GPU under NCCL (else NCCL guesses which GPU, and warns).

    device: the rank's torch.device; None means the current CUDA device.
    """
    if dist.get_backend(group) != "nccl":
        dist.barrier(group)
        return
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    dist.barrier(group, device_ids=[index])


def loopback_interface() -> str:
    """Name of the loopback network interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def one_gpu_per_rank(ranks: int, gpus: int | None = None) -> bool:
    """Can NCCL run `ranks` ranks on this machine? Only when this torch has NCCL and every rank gets
    a GPU of its own (NCCL refuses two ranks on one GPU). `gpus`: the machine's count, which by
    default is counted without initialising CUDA here (`machine.gpu_count`)."""
    if gpus is None:
        gpus = machine.gpu_count()
    return dist.is_nccl_available() and gpus >= ranks


def ddp_options(broadcast_buffers: bool = True, batched_grad_copy: bool = False) -> dict:
    """DDP arguments whose spelling or existence depends on the installed PyTorch.

    - Broadcasting rank 0's buffers before every forward: on by default; torch 2.13 renamed the
      argument from broadcast_buffers to forward_sync_buffers (the old name warns; torch 2.11 has
      only it). One difference: broadcast_buffers=False also skips the buffers' broadcast when DDP
      wraps the model, forward_sync_buffers=False does not (here every rank builds the same
      buffers, so both start equal).
    - batched_grad_copy (torch 2.12+): DDP's autograd hooks copy each new gradient into its bucket,
      one small kernel per parameter (62 for ResNet-18). With it, the copies of a bucket wait until
      the bucket is full and run as one foreach copy and one division: fewer, larger kernels.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    accepted = inspect.signature(DDP.__init__).parameters
    options = {}
    if not broadcast_buffers:
        options["forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"] = False
    if batched_grad_copy and "batched_grad_copy" in accepted:
        options["batched_grad_copy"] = True
    return options


def exit_skipping_teardown(code: int) -> None:
    """End a finished script (checkpoints written, process group destroyed) without the interpreter's
    teardown: after a torchrun restart it aborted finished workers in C++ thread destructors, failing a
    run that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
