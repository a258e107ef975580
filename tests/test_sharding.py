"""Notebook 08's plumbing: the shard-and-reassemble checker (it accepts the solution and
names what is wrong in wrong answers) and the memory accounting (storages counted once,
padding included, DTensors by their local shard)."""
import torch
import torch.distributed as dist
import torch.nn as nn
from checker_cases import decisive

from ddp_helpers import exercises, launch, sharding, solutions
from ddp_helpers.exercises.sharding import expected_shard, full_tensor
from ddp_helpers.sharding import all_gather_single

# ---------------------------------------------------------------- the checker

def test_solution_passes():
    verdict = exercises.check_shard_and_reassemble(solutions.solution_shard, solutions.solution_reassemble)
    assert verdict, repr(verdict)
    assert "correct" in repr(verdict)


def test_stubs_say_fill_in():
    def stub_shard(full, rank, world_size):
        raise NotImplementedError

    with decisive((2, (6, 3))):
        verdict = exercises.check_shard_and_reassemble(stub_shard, solutions.solution_reassemble)
    assert not verdict and "NotImplementedError" in repr(verdict)


def unpadded_shard(full, rank, world_size):          # torch.chunk alone: no padding
    chunks = full.chunk(world_size)
    return chunks[rank] if rank < len(chunks) else full[:0]


def wrong_rows_shard(full, rank, world_size):         # floor instead of ceil: the last rows go missing
    rows = full.shape[0] // world_size or 1
    shard = torch.zeros((-(-full.shape[0] // world_size),) + tuple(full.shape[1:]))
    mine = full[rank * rows:(rank + 1) * rows]
    shard[:len(mine)] = mine
    return shard


def reassemble_with_all_reduce(shard, rows):           # right result, wrong algorithm (N times the bytes)
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros((shard.shape[0] * n,) + tuple(shard.shape[1:]))
    out[r * shard.shape[0]:(r + 1) * shard.shape[0]] = shard
    dist.all_reduce(out)
    return out[:rows]


def reassemble_keeping_padding(shard, rows):
    out = torch.empty((shard.shape[0] * dist.get_world_size(),) + tuple(shard.shape[1:]))
    all_gather_single(out, shard)
    return out


def reassemble_per_row(shard, rows):                   # one all-gather per row: right values, many calls
    n = dist.get_world_size()
    parts = []
    for i in range(shard.shape[0]):
        out = torch.empty((n,) + tuple(shard.shape[1:]))
        all_gather_single(out, shard[i:i + 1].contiguous())
        parts.append(out)
    if not parts:
        return shard
    stacked = torch.stack(parts, dim=1).reshape((n * shard.shape[0],) + tuple(shard.shape[1:]))
    return stacked[:rows]


def test_unpadded_shard_is_named():
    with decisive((2, (5, 2))):
        problems = repr(exercises.check_shard_and_reassemble(unpadded_shard, solutions.solution_reassemble))
    assert "rank 1" in problems and "expected shape" in problems and "pad with zeros" in problems, problems


def test_wrong_rows_name_rank_and_element():
    with decisive((2, (5, 2))):
        problems = repr(exercises.check_shard_and_reassemble(wrong_rows_shard, solutions.solution_reassemble))
    assert "world_size=2, shape (5, 2), rank 0: my_shard: element (2, 0): expected 5, got 0" in problems, problems


def test_all_reduce_is_rejected_although_the_result_is_right():
    with decisive((2, (6, 3))):
        problems = repr(exercises.check_shard_and_reassemble(solutions.solution_shard, reassemble_with_all_reduce))
    assert "dist.all_reduce" in problems and "one all-gather" in problems, problems


def test_padding_left_in_is_named():
    with decisive((2, (5, 2))):
        problems = repr(exercises.check_shard_and_reassemble(solutions.solution_shard, reassemble_keeping_padding))
    assert "world_size=2, shape (5, 2), rank 0: my_reassemble: expected shape (5, 2), got (6, 2)" in problems, problems


def test_several_all_gathers_are_rejected():
    with decisive((2, (6, 3))):
        problems = repr(exercises.check_shard_and_reassemble(solutions.solution_shard, reassemble_per_row))
    assert "all-gather 3 times" in problems, problems


def test_expected_shard_matches_fully_shard():
    """The checker's idea of a shard is what FSDP2 really keeps (values, and the padded storage)."""
    def shard_like_fsdp():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        layer = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            layer.weight.copy_(full_tensor((3, 2)))
        fully_shard(layer, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        local = layer.weight.to_local()
        return local.clone(), local.untyped_storage().nbytes()

    for rank, (local, nbytes) in enumerate(launch(shard_like_fsdp, 2)):
        want = expected_shard(full_tensor((3, 2)), rank, 2)
        assert torch.equal(local, want[:len(local)]) and nbytes == want.numel() * 4


# ---------------------------------------------------------------- memory accounting

def test_storage_bytes_counts_each_storage_once_with_padding():
    flat = torch.zeros(10)
    views = [flat[:3], flat[3:7]]                       # 7 of 10 floats used: the 3 spare count too
    assert sharding.storage_bytes(views) == 40
    assert sharding.storage_bytes([torch.zeros(5), torch.zeros(5, dtype=torch.float64), None]) == 60
    seen = set()
    assert sharding.storage_bytes(views, seen) == 40 and sharding.storage_bytes([flat], seen) == 0


def test_rank_memory_of_adam():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    held = sharding.rank_memory(model, optimizer)
    params = 4 * (12 + 3 + 3 + 3)                       # weight, bias, BN weight, BN bias
    assert held == {"parameters": params, "gradients": params,
                    "optimizer state": 2 * params + 4 * 4,   # exp_avg, exp_avg_sq, a float32 step per tensor
                    "buffers": 4 * 3 * 2 + 8}               # running mean and var, num_batches_tracked (int64)


def test_rank_memory_counts_a_shard_view_once():
    flat = torch.zeros(8)
    model = nn.Linear(3, 2)                             # 8 parameters
    model.weight.data, model.bias.data = flat[:6].view(2, 3), flat[6:]
    shard = nn.Parameter(flat[4:])                      # a view, as the ZeRO-1 cell makes it
    optimizer = torch.optim.Adam([shard])
    shard.grad = torch.ones(4)
    optimizer.step()
    held = sharding.rank_memory(model, optimizer)
    assert held["parameters"] == 32 and held["gradients"] == 16 and held["optimizer state"] == 2 * 16 + 4


def test_format_table_lists_theory_and_every_rank():
    row = {"scheme": "DDP", "N": 2, "theory": {"parameters": 4, "gradients": 4, "optimizer state": 8},
           "held": [dict.fromkeys(sharding.CATEGORIES, 1), dict.fromkeys(sharding.CATEGORIES, 2)]}
    text = sharding.format_table([row])
    assert "theory" in text and "rank 1" in text and text.splitlines()[1].rstrip().endswith("16")


def test_a_collective_held_in_a_variable_is_seen():
    """As in the notebook: the learner's function calls the collective through a variable that
    holds torch's own function (defined in the kernel, pickled by value), not through dist.<name>."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce = dist.all_reduce

    def reassemble(shard, rows):
        out = torch.empty((shard.shape[0] * dist.get_world_size(),) + tuple(shard.shape[1:]))
        gather(out, shard)
        return out[:rows]

    def reassemble_all_reduce(shard, rows):
        n, r = dist.get_world_size(), dist.get_rank()
        out = torch.zeros((shard.shape[0] * n,) + tuple(shard.shape[1:]))
        out[r * shard.shape[0]:(r + 1) * shard.shape[0]] = shard
        reduce(out)
        return out[:rows]

    verdict = exercises.check_shard_and_reassemble(solutions.solution_shard, reassemble)
    assert verdict, repr(verdict)
    problems = repr(exercises.check_shard_and_reassemble(solutions.solution_shard, reassemble_all_reduce))
    assert "dist.all_reduce" in problems, problems


def test_format_table_merges_ranks_that_hold_the_same():
    same, other = dict.fromkeys(sharding.CATEGORIES, 1), dict.fromkeys(sharding.CATEGORIES, 2)
    row = {"scheme": "FSDP2", "N": 4, "theory": dict.fromkeys(sharding.CATEGORIES[:3], 1),
           "held": [same, same, same, other]}
    lines = sharding.format_table([row]).splitlines()
    assert len(lines) == 4 and "ranks 0-2" in lines[2] and "rank 3" in lines[3], lines
    assert all(len(line) <= 100 for line in lines)


# ---------------------------------------------------------------- FsdpTrace: what FSDP2 does, in order

def _fsdp_trace(prefetch, policy=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    if prefetch:
        model[0].set_modules_to_forward_prefetch([model[1], model[2]])
    with sharding.FsdpTrace() as trace:
        model(torch.ones(2, 4)).float().sum().backward()
    return trace.by_hook(), trace.collectives()


def test_fsdp_trace_records_which_hook_issued_each_all_gather():
    (default, sent), (prefetched, _) = launch(lambda: (_fsdp_trace(False), _fsdp_trace(True)), 2)[0]
    forward = [(module, gathered) for hook, module, gathered in default if hook == "pre_forward"]
    assert forward == [("0", ["0"]), ("1", ["1"]), ("2", ["2"])], default
    forward = [(module, gathered) for hook, module, gathered in prefetched if hook == "pre_forward"]
    assert forward == [("0", ["0", "1", "2"]), ("1", []), ("2", [])], prefetched
    backward = [module for hook, module, _ in default if hook == "pre_backward"]
    assert backward == ["2", "1", "0"], default
    # padded shards: 3 blocks of 4 x 4 + 4 (2 rows + 2 per rank) and 2 x 4 + 2 (1 row + 1), float32,
    # gathered in forward and again in backward; the reduce-scatters send whole padded gradients
    shard = 4 * (2 * 4 + 2) * 2 + 4 * (1 * 4 + 1)
    assert sent == {("all_gather", "float32"): 2 * shard, ("reduce_scatter", "float32"): 2 * shard}, sent


def test_fsdp_trace_sees_the_mixed_precision_dtypes():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, sent = launch(lambda: _fsdp_trace(False, policy), 2)[0]
    assert set(sent) == {("all_gather", "bfloat16"), ("reduce_scatter", "float32")}, sent
    assert 2 * sent["all_gather", "bfloat16"] == sent["reduce_scatter", "float32"], sent


def test_format_gather_order_fits_the_notebook():
    hooks = [("pre_forward", "layers.0", ["layers.0", "layers.1"]), ("pre_forward", "head", []),
             ("pre_backward", "head", ["head"])]
    text = sharding.format_gather_order({"default": hooks, "prefetch": hooks})
    assert "  default   layers.0: layers.0, layers.1 | head: -" in text, text
    assert "  prefetch  head: head" in text and text.splitlines()[0].startswith("forward"), text


def test_the_plots_return_their_figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    row = {"scheme": "DDP", "N": 2, "theory": dict.fromkeys(sharding.CATEGORIES, 4),
           "held": [dict.fromkeys(sharding.CATEGORIES, 4)] * 2}
    assert len(sharding.plot_zero_stages(4).axes) == 4
    assert len(sharding.plot_memory_table([row]).axes) == 1
    plt.close("all")


def test_the_checkers_shard_and_the_solutions_agree_on_every_case():
    """Computed two ways (torch.chunk and padding; slicing a zero tensor): the checker does not use the solution."""
    cases = [(2, (6, 3)), (2, (5, 2)), (3, (7,)), (4, (10, 3)), (4, (3, 5)), (4, (1, 2)), (3, (2, 2, 2))]
    for world_size, shape in cases:
        full = full_tensor(shape)
        for rank in range(world_size):
            want = expected_shard(full, rank, world_size)
            assert torch.equal(want, solutions.solution_shard(full, rank, world_size)), (world_size, shape, rank)
            assert want.shape[0] == -(-shape[0] // world_size)


# ---- the checker's shard is taken before the learner's code runs (issue 32): a my_shard that patches
# torch for good (new_zeros gives the whole tensor, item assignment does nothing) would otherwise turn
# the shard the checker hands my_reassemble into the whole tensor, and a my_reassemble that returns its
# input (one all-gather of the right size for show) would pass.
def shard_then_patch_torch(full, rank, world_size):
    shard = solutions.solution_shard(full, rank, world_size)
    torch.Tensor.new_zeros = lambda self, *args, **kwargs: self.clone()   # not restored
    torch.Tensor.__setitem__ = lambda self, index, value: None
    return shard


def reassemble_returns_its_input(shard, rows):
    n = dist.get_world_size()
    padded = torch.zeros((-(-rows // n),) + tuple(shard.shape[1:]))
    all_gather_single(torch.empty((n * padded.shape[0],) + tuple(shard.shape[1:])), padded)
    return shard[:rows]


def test_a_learner_patch_of_torch_cannot_change_the_shard_the_checker_hands_on():
    verdict = exercises.check_shard_and_reassemble(shard_then_patch_torch, reassemble_returns_its_input)
    assert not verdict and ("world_size=2, shape (6, 3), rank 0: my_reassemble: expected shape (6, 3), got (3, 3)"
                            in repr(verdict)), repr(verdict)
