"""The environment a rank runs in: what the kernel gives it (`worker_env`), and the threads it uses.

Built in the kernel by the supervisor (checked before anything starts), read in the rank by
`rank_setup.setup_worker_process`.
"""
from __future__ import annotations

import os

from ..compat import loopback_interface
from ..machine import cpu_count


def worker_env(world_size: int, master_port: int, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment each worker gets: the kernel's own, plus what torchrun sets.

    RANK, LOCAL_RANK, GROUP_RANK and ROLE_RANK differ per rank; the worker adds them.
    A bad OMP_NUM_THREADS (the kernel's or in extra_env) is a ValueError here.
    """
    env = dict(os.environ)
    env.update(extra_env or {})
    threads = max(1, cpu_count() // world_size)
    env.setdefault("OMP_NUM_THREADS", str(threads))  # torchrun would use 1; share the cores instead
    omp_threads(env["OMP_NUM_THREADS"])
    lo = loopback_interface()
    env.setdefault("GLOO_SOCKET_IFNAME", lo)   # Gloo and NCCL talk over loopback only
    env.setdefault("NCCL_SOCKET_IFNAME", lo)
    env.update({
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        # Like torchrun: workers connect to the store the launcher hosts instead of rank 0 creating one.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "ddp_helpers",
    })
    env.update(extra_env or {})
    return env


def omp_threads(value: str) -> int:
    """The threads a rank uses, from OMP_NUM_THREADS: a positive whole number, or one per level
    of nested parallelism ("4,2", OpenMP's syntax), of which the first applies here."""
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a positive whole number of threads per rank "
                         "(set it in the notebook's environment or in launch's env=)")
    return int(first)
