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
    torch.distributed._functional_collectives.all_reduce on each rank's local tensors), its loss and
    one process's, and CommDebugMode's counts of the collectives its backward runs."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    shapes, real = [], funcol.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 16), torch.randint(0, 16, (6,))     # 6 tokens, 16 classes
    sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        with replacing(funcol, {"all_reduce": all_reduce}):
            loss = torch.nn.functional.cross_entropy(sharded, targets)
        with CommDebugMode() as backward:
            loss.backward()
    one = torch.nn.functional.cross_entropy(logits, targets).item()
    return shapes, loss.full_tensor().item(), one, {str(op): n for op, n in backward.get_comm_counts().items()}


def test_09_loss_parallel_all_reduces_one_number_per_token_three_times():
    cells, text = _going_further(NB09)
    code = next((c.source for c in cells if c.cell_type == "code" and "loss_parallel()" in c.source), "")
    assert "loss_parallel()" in code, "09's Going further runs loss_parallel"
    assert "assert_same_grads(model, one)" in code
    assert "3 all-reduces came in. Each all-reduce carries one number per token" in _words(text)
    for shapes, loss, one, _ in launch(_loss_parallel_all_reduces, 2):
        assert len(shapes) == 3 and all(torch.Size(s).numel() == 6 for s in shapes), shapes
        assert abs(loss - one) < 1e-6


def _cell(cells, needle, kind="code"):
    return next((c for c in cells if c.cell_type == kind and needle in c.source), None)


def test_09_loss_parallel_asserts_its_gathers_against_sequence_parallel_and_backward_unchanged():
    cells, text = _going_further(NB09)
    code = _cell(cells, "loss_parallel()").source
    sp = _cell(nbformat.read(NB09, as_version=4).cells, "sp_plan(cfg))\nwith CommDebugMode()").source
    # the SP cell keeps its counts; loss_parallel's forward is them less one all-gather plus 3 all-reduces
    assert "sp_forward, sp_backward = counts(forward), counts(backward)" in sp
    assert 'sp_forward - Counter(all_gather=1) + Counter(all_reduce=3)' in code
    assert "CommDebugMode() as backward" in code and "counts(backward) == sp_backward" in code
    assert "backward gains no collective" in _words(text) and "loss.py" in text
    for _, _, _, backward in launch(_loss_parallel_all_reduces, 2):
        assert backward == {}, f"loss_parallel's backward ran collectives: {backward}"


def _group_trace():
    """Inside 4 ranks: GroupTrace's record of collectives on 2 subgroups and on the world group."""
    from ddp_helpers import sharding
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[dist.get_rank() // 2]
    with sharding.GroupTrace() as trace:
        dist.all_reduce(torch.ones(3), group=mine)
        out = torch.empty(4 * 2)
        dist.all_gather_into_tensor(out, torch.ones(2))
    return trace.calls, trace.totals({(0, 1): "pair", (2, 3): "pair", (0, 1, 2, 3): "world"})


def test_group_trace_names_each_collectives_group_by_its_ranks():
    for rank, (calls, (counts, sent)) in enumerate(launch(_group_trace, 4)):
        pair = (0, 1) if rank < 2 else (2, 3)
        assert calls == [("all_reduce", pair, 12), ("all_gather", (0, 1, 2, 3), 8)], calls
        assert counts == {"all_reduce over pair": 1, "all_gather over world": 1}
        assert sent == {"all_reduce over pair": 12, "all_gather over world": 8}


def test_08_hsdp_cell_keeps_its_plumbing_in_ddp_helpers_and_prints_the_placements():
    cells, _ = _going_further(NB08)
    hsdp = _cell(cells, "def hsdp_step")
    for plumbing in ("class ", "ScriptObject", "unbox", "DispatchSpy", "spies"):
        assert plumbing not in hsdp.source, f"08's HSDP cell has {plumbing!r} inline"
    assert "sharding.GroupTrace()" in hsdp.source and "mesh.get_group(" in hsdp.source
    assert "model.layers[0].weight.placements" in hsdp.source
    printed = "".join(o.get("text", "") for o in hsdp.outputs)
    assert "(Replicate(), Shard(dim=0))" in printed


def test_08_checkpointing_links_selective_checkpointing_and_adds_up_what_it_keeps():
    import torch.utils.checkpoint as ckpt
    cells, text = _going_further(NB08)
    assert hasattr(ckpt, "create_selective_checkpoint_contexts")
    link = "(https://docs.pytorch.org/docs/stable/checkpoint.html#torch.utils.checkpoint.create_selective_checkpoint_contexts)"
    assert "[Selective checkpointing]" + link in text
    kept = _words(text[text.index("the rest is the same"):].split("\n\n")[0])
    assert "3 blocks' 64 × 10 outputs" in kept
    printed = "".join(o.get("text", "") for o in _cell(cells, "class Checkpointed").outputs)
    total = re.search(r"checkpointed +([\d,]+) B", printed).group(1)
    terms = re.findall(r"(?:(\d+) × )?([\d,]+) B\b", kept.split(f"{total} B")[0])
    assert terms and sum(int(n or 1) * int(b.replace(",", "")) for n, b in terms) == int(total.replace(",", ""))


def test_08_dcp_cell_leaves_the_rank_0_torch_save_to_its_own_cell():
    cells, _ = _going_further(NB08)
    dcp_cells = [c.source for c in cells if c.cell_type == "code" and "dcp." in c.source]
    assert any("dcp.save(" in c for c in dcp_cells) and any("dcp.load(" in c for c in dcp_cells)
    for code in dcp_cells:
        assert "torch.save" not in code and "torch.load" not in code
        assert len(code.splitlines()) <= 50, "a DCP cell over 50 lines"
    full = _cell(cells, "torch.save(").source
    assert "full_state_dict=True" in full and "cpu_offload=True" in full
