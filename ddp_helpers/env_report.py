"""What torchrun tells each worker: run under torchrun, every rank prints one line.

    torchrun --nproc-per-node=2 -m ddp_helpers.env_report
"""
import os

import torch
import torch.distributed as dist

# TORCHELASTIC_USE_AGENT_STORE: True when the workers' store is served by node 0's agent (torchrun's
# default), False with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (then the worker with RANK 0 serves it).
KEYS = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_USE_AGENT_STORE"]


def main():
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)  # proves every rank of every node is in one group
    seen = " ".join(f"{k}={os.environ[k]}" for k in KEYS)
    print(f"{seen} all_reduce(ones)={total.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
