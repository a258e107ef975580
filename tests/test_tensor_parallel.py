"""Notebook 09's plumbing: the row-parallel checker (it accepts the solution and rejects wrong answers,
including right numbers reached by another algorithm) and the placement picture."""
import matplotlib
import torch
import torch.distributed as dist
from checker_cases import decisive

from ddp_helpers import exercises, parallel_plots, solutions

matplotlib.use("Agg")


def _reduce_scatter_tokens(partial):
    n = dist.get_world_size()
    by_tokens = partial.transpose(0, 1).contiguous()
    mine = torch.empty_like(by_tokens.chunk(n)[0])
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, by_tokens)
    return mine.transpose(0, 1)


def gather_everything(x_shard, w_shard, bias, sequence_parallel):
    """Right numbers, wrong algorithm: all-gather the inputs and the weights, compute it all on every rank."""
    n = dist.get_world_size()
    xs = [torch.empty_like(x_shard) for _ in range(n)]
    ws = [torch.empty_like(w_shard) for _ in range(n)]
    dist.all_gather(xs, x_shard.contiguous())
    dist.all_gather(ws, w_shard.contiguous())
    full = torch.cat(xs, -1) @ torch.cat(ws, 1).T + bias
    return full.chunk(n, dim=1)[dist.get_rank()] if sequence_parallel else full


def bias_before_the_sum(x_shard, w_shard, bias, sequence_parallel):
    partial = x_shard @ w_shard.T + bias                 # every rank adds the bias: n times in the sum
    if sequence_parallel:
        return _reduce_scatter_tokens(partial)
    dist.all_reduce(partial)
    return partial


def all_reduce_then_slice(x_shard, w_shard, bias, sequence_parallel):
    """Right numbers, wrong algorithm for sequence parallelism: an all-reduce, then keep my tokens."""
    partial = x_shard @ w_shard.T
    dist.all_reduce(partial)
    full = partial + bias
    return full.chunk(dist.get_world_size(), dim=1)[dist.get_rank()] if sequence_parallel else full


def scatter_the_batch(x_shard, w_shard, bias, sequence_parallel):
    """Reduce-scatters dim 0 (the batch) instead of the tokens."""
    partial = x_shard @ w_shard.T
    if not sequence_parallel:
        dist.all_reduce(partial)
        return partial + bias
    n = dist.get_world_size()
    mine = torch.empty_like(partial.chunk(n)[0])
    dist.reduce_scatter(mine, [c.contiguous() for c in partial.chunk(n)])
    return mine + bias


def one_all_reduce_per_half(x_shard, w_shard, bias, sequence_parallel):
    partial = x_shard @ w_shard.T
    halves = [h.contiguous() for h in partial.chunk(2, dim=0)]
    for h in halves:
        dist.all_reduce(h)
    full = torch.cat(halves) + bias
    return full.chunk(dist.get_world_size(), dim=1)[dist.get_rank()] if sequence_parallel else full


def still_a_stub(*args):
    raise NotImplementedError("Try it")


def test_the_solution_is_accepted():
    verdict = exercises.check_row_parallel(solutions.row_parallel)
    assert verdict and repr(verdict) == "✅ my_row_parallel: correct.", repr(verdict)


def test_the_list_form_of_reduce_scatter_is_accepted_too():
    def list_form(x_shard, w_shard, bias, sequence_parallel):
        partial = x_shard @ w_shard.T
        if not sequence_parallel:
            dist.all_reduce(partial)
            return partial + bias
        chunks = [c.contiguous() for c in partial.chunk(dist.get_world_size(), dim=1)]
        mine = torch.empty_like(chunks[0])
        dist.reduce_scatter(mine, chunks)
        return mine + bias
    verdict = exercises.check_row_parallel(list_form)
    assert verdict, repr(verdict)


def test_gathering_the_inputs_is_rejected_though_the_numbers_are_right():
    with decisive(((2, 2, 4, 6, 5),)):
        problems = repr(exercises.check_row_parallel(gather_everything))
    assert "world_size=2, sequence_parallel=False, rank 0: called dist.all_gather" in problems, problems
    assert "local matmul" in problems


def test_the_bias_added_on_every_rank_is_named():
    with decisive(((2, 2, 4, 6, 5),)):
        problems = repr(exercises.check_row_parallel(bias_before_the_sum))
    assert "sequence_parallel=False, rank 0: the bias is in the result 2 times" in problems, problems


def test_an_all_reduce_for_sequence_parallelism_is_rejected_though_the_numbers_are_right():
    with decisive(((2, 2, 4, 6, 5),)):
        problems = repr(exercises.check_row_parallel(all_reduce_then_slice))
    assert "sequence_parallel=False" not in problems, problems
    assert ("world_size=2, sequence_parallel=True, rank 0: called dist.all_reduce: the row-parallel forward "
            "needs one reduce-scatter") in problems, problems


def test_scattering_the_batch_is_named():
    with decisive(((2, 2, 4, 6, 5),)):
        problems = repr(exercises.check_row_parallel(scatter_the_batch))
    assert "world_size=2, sequence_parallel=True, rank 0: expected shape (2, 2, 5), got (1, 4, 5)" in problems
    assert "slice of the batch" in problems, problems


def test_two_collectives_are_rejected_though_the_numbers_are_right():
    with decisive(((2, 2, 4, 6, 5),)):
        problems = repr(exercises.check_row_parallel(one_all_reduce_per_half))
    assert "world_size=2, sequence_parallel=False, rank 0: made 2 all_reduce calls" in problems, problems


def test_the_stub_is_recognised():
    with decisive(((2, 2, 4, 6, 5),)):
        verdict = exercises.check_row_parallel(still_a_stub)
    assert not verdict and "still raises NotImplementedError" in repr(verdict)


def test_digit_ranks_reads_who_is_in_a_value():
    assert parallel_plots.digit_ranks(30, 4) == [1]
    assert parallel_plots.digit_ranks(1111, 4) == [0, 1, 2, 3]
    assert parallel_plots.digit_ranks(2020, 4) == [1, 3]


def test_show_placements_draws_a_chain():
    import matplotlib.pyplot as plt
    per_rank = [[torch.tensor([[1.0, 2.0]]) * 10 ** r, torch.tensor([[1.0, 2.0], [10.0, 20.0]]), torch.tensor([11.0])]
                for r in range(2)]
    fig = parallel_plots.show_placements(per_rank, ["Shard(0)", "Replicate()", "sum"], "test", ["", "all_gather", ""])
    assert len(fig.axes) == 6
    plt.close(fig)
