"""Helpers for the hands-on distributed PyTorch notebooks.

    from ddp_helpers import launch
    %load_ext ddp_helpers      # in a notebook: the %%ddp cell magic
"""
from .launcher import WorkerError, WorkerTimeout, launch

__all__ = ["launch", "WorkerError", "WorkerTimeout", "load_ipython_extension"]


def load_ipython_extension(ipython):
    from .magic import register
    register(ipython)
