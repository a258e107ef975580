"""Helpers for the hands-on distributed PyTorch notebooks.

    from ddp_helpers import launch, spawn
    %load_ext ddp_helpers      # in a notebook: the %%ddp cell magic
"""
from .runtime import forkserver as _forkserver

if _forkserver.start_at_import():  # first, so that it imports torch while this kernel does too
    _forkserver.start()

from .launcher import WorkerError, WorkerTimeout, launch, spawn

__all__ = ["launch", "spawn", "WorkerError", "WorkerTimeout", "load_ipython_extension"]


def load_ipython_extension(ipython):
    from .magic import register
    from .tutorials import enable
    register(ipython)
    enable()   # PyTorch's tutorials' mp.spawn / mp.Process lines run as written (tutorials.disable() undoes it)
