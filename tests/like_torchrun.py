"""Run a module as torchrun's workers would, without torchrun's own store (which listens on
every interface): the store is hosted here on 127.0.0.1, each rank gets torchrun's environment."""
import subprocess
import sys

from conftest import REPO

from ddp_helpers.runtime.rank_env import worker_env
from ddp_helpers.runtime.store_host import Rendezvous


def run_module_like_torchrun(module, args, nproc=2, timeout=120):
    """`python -m module *args` once per rank; returns each rank's (returncode, stdout, stderr)."""
    with Rendezvous() as store:
        procs = []
        for rank in range(nproc):
            env = dict(worker_env(nproc, store.port), RANK=str(rank), LOCAL_RANK=str(rank), PYTHONPATH=REPO)
            procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env, cwd=REPO,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        try:
            outputs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
