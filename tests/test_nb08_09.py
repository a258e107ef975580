"""Notebooks 08 and 09, Going further: what their prose says about PyTorch is what the installed torch
says and does (HSDP's placements, the checkpoint variant the docs recommend, loss_parallel's
all-reduces). The cells themselves assert their equalities under nbval; these tests check the words
around them."""
import os
import re

import nbformat
import torch
import torch.distributed as dist

from conftest import REPO
from ddp_helpers import launch
from ddp_helpers.exercises.spies import replacing

NB08 = os.path.join(REPO, "notebooks", "08_sharding.ipynb")
NB09 = os.path.join(REPO, "notebooks", "09_tensor_and_sequence_parallel.ipynb")


def _going_further(path):
    """The cells after '## Summary', and the text of their markdown."""
    cells = nbformat.read(path, as_version=4).cells
    summary = next(i for i, c in enumerate(cells)
                   if c.cell_type == "markdown" and c.source.lstrip().startswith("## Summary"))
    rest = cells[summary + 1:]
    return rest, "\n".join(c.source for c in rest if c.cell_type == "markdown")


def _words(text):
    return " ".join(re.sub(r"[`*]", "", text).split())


def test_08_quotes_fully_shards_docstring_on_a_2d_mesh():
    from torch.distributed.fsdp import fully_shard
    cells, text = _going_further(NB08)
    assert "### HSDP" in text, "08's Going further has an HSDP section"
    section = text[text.index("### HSDP"):]
    quoted = re.search(r'"(parameters are sharded across[^"]+)"', section)
    assert quoted, "the HSDP section quotes fully_shard's docstring"
    assert _words(quoted.group(1)) in _words(fully_shard.__doc__)
    assert "(Replicate(), Shard(0))" in section and "(Replicate(), Shard(0))" in fully_shard.__doc__
    hsdp = next((c.source for c in cells if c.cell_type == "code" and "def hsdp_step" in c.source), "")
    assert 'init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))' in hsdp
    assert "all_reduce over replicate" in hsdp and "reduce_scatter over shard" in hsdp


def test_08_checkpoints_with_the_variant_torchs_docs_recommend():
    from torch.utils.checkpoint import checkpoint
    cells, text = _going_further(NB08)
    assert "use_reentrant=False, the variant its docs recommend" in _words(text)
    assert "recommended that you use use_reentrant=False" in _words(checkpoint.__doc__)
    code = next((c.source for c in cells if c.cell_type == "code" and "class Checkpointed" in c.source), "")
    assert "use_reentrant=False" in code and "saved_tensors_hooks" in code and "FlopCounterMode" in code


def _loss_parallel_all_reduces():
    """Inside 2 ranks: the shapes of the tensors loss_parallel's cross-entropy all-reduces (it calls
    torch.distributed._functional_collectives.all_reduce on each rank's local tensors)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    shapes, real = [], funcol.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 16), torch.randint(0, 16, (6,))     # 6 tokens, 16 classes
    sharded = distribute_tensor(logits, mesh, [Shard(1)])
    with loss_parallel(), replacing(funcol, {"all_reduce": all_reduce}):
        loss = torch.nn.functional.cross_entropy(sharded, targets)
    return shapes, loss.full_tensor().item(), torch.nn.functional.cross_entropy(logits, targets).item()


def test_09_loss_parallel_all_reduces_one_number_per_token_three_times():
    cells, text = _going_further(NB09)
    code = next((c.source for c in cells if c.cell_type == "code" and "loss_parallel()" in c.source), "")
    assert "loss_parallel()" in code, "09's Going further runs loss_parallel"
    assert 'assert "all_reduce ×3" in counted(forward)' in code and "assert_same_grads(model, one)" in code
    assert "3 all-reduces came in. Each all-reduce carries one number per token" in _words(text)
    for shapes, loss, one in launch(_loss_parallel_all_reduces, 2):
        assert len(shapes) == 3 and all(torch.Size(s).numel() == 6 for s in shapes), shapes
        assert abs(loss - one) < 1e-6
