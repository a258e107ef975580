"""What the glossary says of the backends holds for the installed torch."""
import os

import torch
import torch.distributed as dist
from conftest import REPO


def test_the_glossary_says_gloo_averages_as_the_installed_torch_does(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t = torch.tensor([4.0, 2.0])
        dist.all_reduce(t, op=dist.ReduceOp.AVG)     # raised "Cannot use ReduceOp.AVG with Gloo" before 2.x
        assert t.tolist() == [4.0, 2.0]
    finally:
        dist.destroy_process_group()
    glossary = open(os.path.join(REPO, "notebooks", "glossary.md"), encoding="utf-8").read()
    row = next(line for line in glossary.splitlines() if line.startswith("| reduce operation"))
    assert "AVG" in row and "NCCL only" not in row and "Gloo" in row, row
