"""The fork server that every rank is forked from: what it imports, and starting it early.

Ranks start with multiprocessing's *forkserver* method: a fresh Python process (never a fork of the
notebook kernel, which may have touched CUDA) imports torch and the rest of PRELOAD once, and each
rank is a fork of it, with all of that already imported. Only the first launch waits for the
server to import; later launches fork it at once.

Inside a Jupyter kernel, `import ddp_helpers` starts the server (`start`), before the kernel
imports torch itself: both import at the same time, and the first launch finds the server ready
or nearly so. This module imports nothing heavy, so that it can run first.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

# What each rank finds imported, in this order. preload_training: torch._dynamo (the first optimizer or
# DDP of a process imports it, over a second in every rank of every launch that trains, where importing
# it once here costs about as much once) and torchvision (ResNet-18 and the per-image transforms), left
# out on a fresh machine that keeps bytecode in the private cache. A name that fails to import is
# skipped. First and last, two modules of ours: while the server imports, the garbage collector is off
# (a quarter of the import's CPU time went to collections); at the end what it imported is frozen
# (gc.freeze: the ranks' collections skip it, and leave its memory shared) and collection is on again.
# Between them, the ranks' own modules: a rank's setup (rank_setup, which brings the error record, the
# tutorial shims and the rest of a rank's side), launch's target (worker), running a cell
# (cell_exec), the pool's (serve), and the store's process (store_host).
PRELOAD = ["ddp_helpers.runtime.forkserver", "torch", "torch.distributed", "ddp_helpers.runtime.preload_training",
           "cloudpickle", "psutil", "ddp_helpers.runtime.rank_setup", "ddp_helpers.runtime.worker",
           "ddp_helpers.runtime.cell_exec", "ddp_helpers.runtime.serve", "ddp_helpers.runtime.store_host",
           "ddp_helpers.runtime.forkserver_ready"]


def start_method() -> str:
    """"forkserver", with PRELOAD set for the server (which takes it when it starts)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return "forkserver"


def start() -> None:
    """Start the fork server unless it runs already, and return at once: it imports in the background.
    Launches wait for it to be ready. It ends when this process ends."""
    start_method()
    os.environ[_IN_SERVER] = "1"   # the server inherits it: importing ddp_helpers there starts no other
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[_IN_SERVER]


def start_at_import() -> bool:
    """Should `import ddp_helpers` start the fork server? In a Jupyter kernel, which will launch ranks, yes;
    in the server itself, ranks, torchrun's workers and scripts, no. The environment variable
    DDP_HELPERS_EARLY_FORKSERVER says otherwise: 1 (yes, in any program), 0 (never)."""
    if os.environ.get(_IN_SERVER):
        return False
    choice = os.environ.get(EARLY_ENV_VAR, "")
    if choice in ("0", "1"):
        return choice == "1"
    return "ipykernel" in sys.modules


@contextlib.contextmanager
def main_script_not_rerun() -> Iterator[None]:
    """multiprocessing re-runs the main script in every new process (as `__mp_main__`), so that the
    functions it pickled by name can be found there. A rank needs none of it: the function and
    everything it uses travel by value. So a script that calls `launch` without the
    `if __name__ == "__main__":` guard works (each rank re-ran it and launched again), and a script
    read from standard input (`python - < script.py`, a "<stdin>" that is no file) starts too.
    The ranks and the store's process are started under it."""
    real = multiprocessing.spawn.get_preparation_data

    def without_main(name: str) -> dict[str, Any]:
        data = real(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = real


EARLY_ENV_VAR = "DDP_HELPERS_EARLY_FORKSERVER"
_IN_SERVER = "DDP_HELPERS_IN_FORKSERVER"

# In the fork server: None if its ranks have a network of their own, else why not.
NETWORK: str | None = "not the fork server"
BYTECODE_CACHE: str | None = None  # in the fork server: the private bytecode folder it uses (bytecode_cache), if any

if os.environ.get(_IN_SERVER):   # this is the fork server, importing PRELOAD; forkserver_ready undoes both
    from . import private_net
    NETWORK = private_net.enter()   # first, while this process has one thread: see private_net
    from . import bytecode_cache
    BYTECODE_CACHE = bytecode_cache.use()   # before torch: compiled once per machine, not per server
    gc.disable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the Interrupt button (sent to the kernel's process group)
                                                   # is for the cell: the server ignores it once it serves
