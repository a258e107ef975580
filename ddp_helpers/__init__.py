"""Helpers for the hands-on distributed PyTorch notebooks.

    from ddp_helpers import launch, spawn
    %load_ext ddp_helpers      # in a notebook: the %%ddp cell magic (%unload_ext ddp_helpers undoes it)
"""
import os as _os
import sys as _sys
from typing import Any as _Any


def _start_the_fork_server_in_a_kernel() -> None:
    """In a Jupyter kernel, which will launch ranks, start the fork server first, so that it imports
    torch while this kernel does too (`runtime.forkserver.start_at_import` says when). Anywhere else (a
    script, torchrun's workers of `python -m ddp_helpers.train`, the fork server itself) nothing of the
    launch machinery is imported until it is used: this cheap test spares them the fork server's module."""
    if "ipykernel" in _sys.modules or _os.environ.get("DDP_HELPERS_EARLY_FORKSERVER"):
        from .runtime import forkserver
        if forkserver.start_at_import():
            forkserver.start()


_start_the_fork_server_in_a_kernel()   # first, before anything else of the package

__all__ = ["launch", "spawn", "WorkerError", "WorkerTimeout", "load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str) -> object:
    """`from ddp_helpers import launch` imports the launcher then, not before: a module that needs no
    launching (`python -m ddp_helpers.train` under torchrun, say) loads none of its machinery."""
    if name in ("launch", "spawn", "WorkerError", "WorkerTimeout"):
        from . import launcher
        return getattr(launcher, name)
    raise AttributeError(f"module 'ddp_helpers' has no attribute {name!r}")


def load_ipython_extension(ipython: _Any) -> None:
    from .magic import register
    from .tutorials import enable
    register(ipython)
    enable()   # PyTorch's tutorials' mp.spawn / mp.Process lines run as written (tutorials.disable() undoes it)


def unload_ipython_extension(ipython: _Any) -> None:
    """`%unload_ext ddp_helpers`: stop the warm pool, remove %ddp/%%ddp, and put torch.multiprocessing
    back as torch ships it (`tutorials.disable()`); `%load_ext ddp_helpers` sets it all up again."""
    from . import tutorials
    from .magic import unregister
    try:
        unregister(ipython)
    finally:
        tutorials.disable()
        after_cell = getattr(tutorials, "_after_cell", None)   # enable()'s hook; enable() adds it again
        if after_cell in ipython.events.callbacks.get("post_run_cell", []):
            ipython.events.unregister("post_run_cell", after_cell)
