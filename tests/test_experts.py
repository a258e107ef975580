"""Notebook 13's checker (the dispatch and combine of expert parallelism) accepts the solution and names
each wrong answer by its rank, its token or its collective: also the answers whose numbers are right
(an all-gather of every token), so a checker that only compared results would fail these tests."""
import torch
import torch.distributed as dist
from checker_cases import decisive

from ddp_helpers import launch, solutions
from ddp_helpers.exercises import experts
from ddp_helpers.exercises.experts import check_dispatch_combine

# The checker stops at the first case that is wrong: a wrong answer meets the first case only (the
# solution meets every case).
FIRST = (experts.CASES[0],)


def test_the_solution_is_accepted():
    verdict = check_dispatch_combine(solutions.dispatch, solutions.combine)
    assert verdict and repr(verdict) == "✅ my_dispatch, my_combine: correct.", repr(verdict)


def my_dispatch(x, expert, n_experts):
    raise NotImplementedError("Try it: fill in my_dispatch")


def my_combine(y, weight, state):
    raise NotImplementedError("Try it: fill in my_combine")


def test_the_stubs_are_named_the_dispatch_first():
    with decisive(FIRST):
        verdict = check_dispatch_combine(my_dispatch, my_combine)
    text = repr(verdict)
    assert not verdict and text.endswith("- my_dispatch still raises NotImplementedError: fill in the stub"), text


def test_a_stub_combine_is_named_after_a_right_dispatch():
    with decisive(FIRST):
        verdict = check_dispatch_combine(solutions.dispatch, my_combine)
    text = repr(verdict)
    assert not verdict and "- my_combine still raises NotImplementedError: fill in the stub" in text, text
    assert "(dispatch passed: its collectives, splits and rows are right)" in text, text


# ---- right numbers, wrong traffic: every token to every rank ---------------------------------------

def gather_everything(x, expert, n_experts):
    """Every rank gets every rank's tokens and choices, and keeps the rows for its experts."""
    n, r = dist.get_world_size(), dist.get_rank()
    m = n_experts // n
    xs, es = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(expert) for _ in range(n)]
    dist.all_gather(xs, x)
    dist.all_gather(es, expert)
    rows = [xs[s][t] for e in range(r * m, r * m + m) for s in range(n) for t in range(len(x))
            if (es[s][t] == e).any()]
    received = torch.stack(rows) if rows else x.new_empty(0, x.shape[1])
    return received, (xs, es, m)


def sum_everything(y, weight, state):
    """Each rank adds its experts' weighted outputs into every rank's tokens; one all-reduce sums them."""
    xs, es, m = state
    n, r = dist.get_world_size(), dist.get_rank()
    ws = [torch.empty_like(weight) for _ in range(n)]
    dist.all_gather(ws, weight)
    tokens = len(xs[0])
    out, i = torch.zeros(n * tokens, y.shape[1]), 0
    for e in range(r * m, r * m + m):
        for s in range(n):
            for t in range(tokens):
                hit = (es[s][t] == e).nonzero()
                if len(hit):
                    out[s * tokens + t] += ws[s][t, hit[0, 0]] * y[i]
                    i += 1
    dist.all_reduce(out)
    return out[r * tokens:(r + 1) * tokens]


def test_an_all_gather_of_every_token_gives_the_right_numbers_and_is_named_for_its_traffic():
    with decisive(FIRST):
        verdict = check_dispatch_combine(gather_everything, sum_everything)
    text = repr(verdict)
    assert not verdict, text
    assert "rank 0: dispatch called all_gather on a (6, 4) tensor of rows" in text, text
    assert "right numbers, wrong traffic" in text and "one all_to_all_single" in text, text


def test_the_all_gather_answer_really_gives_the_right_numbers():
    """What makes the test above a test of traffic: the same answer's outputs equal one process's."""
    case, seed = experts.CASES[0], 13
    want = experts._expected(case, seed)

    def outputs():
        r = dist.get_rank()
        ranks, _ = experts._case_data(case, seed)
        x, expert, weight = ranks[r]
        received, state = gather_everything(x, expert, case[3])
        assert torch.equal(received, want[r]["received"])
        return sum_everything(want[r]["y"], weight, state)
    for r, out in enumerate(launch(outputs, case[0], quiet=True)):
        torch.testing.assert_close(out, want[r]["out"])


# ---- splits in the wrong order ----------------------------------------------------------------------

def reversed_splits(x, expert, n_experts):
    """The rows sorted by expert, the counts exchanged, but input_split_sizes listed from the last rank."""
    n = dist.get_world_size()
    m = n_experts // n
    token, slot = (expert >= 0).nonzero(as_tuple=True)
    order = expert[token, slot].argsort(stable=True)
    token, slot = token[order], slot[order]
    counts = torch.bincount(expert[token, slot], minlength=n_experts)
    from_each = torch.empty_like(counts)
    dist.all_to_all_single(from_each, counts)
    in_splits = counts.view(n, m).sum(1).tolist()[::-1]         # wrong: rank n-1's count first
    out_splits = from_each.view(n, m).sum(1).tolist()
    arrived = x.new_empty(sum(out_splits), x.shape[1])
    dist.all_to_all_single(arrived, x[token], out_splits, in_splits)
    blocks = torch.arange(len(arrived)).split(from_each.tolist())
    by_expert = torch.cat([blocks[s * m + e] for e in range(m) for s in range(n)])
    return arrived[by_expert], (token, slot, in_splits, out_splits, by_expert)


def test_splits_in_the_wrong_order_are_named_with_the_rank_and_the_splits():
    with decisive(FIRST):
        verdict = check_dispatch_combine(reversed_splits, solutions.combine)
    text = repr(verdict)
    assert not verdict, text
    assert "rank 0:" in text and "input_split_sizes [" in text, text
    assert "split j is the number of rows for rank j, in rank order" in text, text


def rows_in_token_order(x, expert, n_experts):
    """Right splits, but the rows are not sorted by expert: the wrong tokens go to each rank."""
    n = dist.get_world_size()
    m = n_experts // n
    token, slot = (expert >= 0).nonzero(as_tuple=True)            # token order, never sorted
    chosen = expert[token, slot]
    counts = torch.bincount(chosen, minlength=n_experts)
    from_each = torch.empty_like(counts)
    dist.all_to_all_single(from_each, counts)
    in_splits = counts.view(n, m).sum(1).tolist()
    out_splits = from_each.view(n, m).sum(1).tolist()
    arrived = x.new_empty(sum(out_splits), x.shape[1])
    dist.all_to_all_single(arrived, x[token], out_splits, in_splits)
    blocks = torch.arange(len(arrived)).split(from_each.tolist())
    by_expert = torch.cat([blocks[s * m + e] for e in range(m) for s in range(n)])
    return arrived[by_expert], (token, slot, in_splits, out_splits, by_expert)


def test_rows_not_sorted_by_expert_are_named_by_rank_and_token_where_they_are_sent():
    with decisive(FIRST):
        verdict = check_dispatch_combine(rows_in_token_order, solutions.combine)
    text = repr(verdict)
    assert not verdict, text
    r, t, e = experts._expected(experts.CASES[0], 13)[0]["sent_labels"][0]    # rank 0's first row, sorted
    assert (r, e) == (0, 0) and t > 0                                        # token 0 did not choose expert 0
    assert ("rank 0: the rows its all_to_all_single sent are out of order: row 0 is token 0 of rank 0 "
            "(kept experts") in text, text
    assert f"expected token {t} of rank 0 (for expert 0)" in text and "sorted by expert" in text, text


# ---- the rows left in the order they arrived (ep_moe's order), and a combine that keeps its order -------

def rows_as_they_arrived(x, expert, n_experts):
    """Counts, splits and rows right, but returned as the all-to-all delivers them: by source rank."""
    n = dist.get_world_size()
    m = n_experts // n
    token, slot = (expert >= 0).nonzero(as_tuple=True)
    order = expert[token, slot].argsort(stable=True)
    token, slot = token[order], slot[order]
    counts = torch.bincount(expert[token, slot], minlength=n_experts)
    from_each = torch.empty_like(counts)
    dist.all_to_all_single(from_each, counts)
    in_splits = counts.view(n, m).sum(1).tolist()
    out_splits = from_each.view(n, m).sum(1).tolist()
    received = x.new_empty(sum(out_splits), x.shape[1])
    dist.all_to_all_single(received, x[token], out_splits, in_splits)
    return received, (token, slot, in_splits, out_splits, torch.arange(len(received)))


def test_rows_left_in_the_order_they_arrived_are_named_with_the_rank_and_row():
    with decisive(FIRST):
        verdict = check_dispatch_combine(rows_as_they_arrived, solutions.combine)
    text = repr(verdict)
    assert not verdict, text
    want = experts._expected(experts.CASES[0], 13)[0]
    i = next(i for i, (a, b) in enumerate(zip(want["arrival"], want["labels"])) if a != b)   # first row out of place
    s, t, e = want["labels"][i]
    assert (f"rank 0: dispatch returned the rows in the order they arrived (by source rank, then expert): "
            f"row {i} is") in text, text
    assert f"expected token {t} of rank {s} (for expert {e})" in text, text
    assert "Regroup them by expert, then source rank" in text, text


def combine_in_given_order(y, weight, state):
    """The outputs sent home in the order dispatch returned the rows (by expert), never put back."""
    token, slot, in_splits, out_splits, _ = state
    back = y.new_empty(sum(in_splits), y.shape[1])
    dist.all_to_all_single(back, y.contiguous(), in_splits, out_splits)
    return torch.zeros(weight.shape[0], y.shape[1]).index_add(0, token, weight[token, slot, None] * back)


def test_a_combine_that_sends_the_outputs_by_expert_is_named_with_the_row_and_token():
    with decisive(FIRST):
        verdict = check_dispatch_combine(solutions.dispatch, combine_in_given_order)
    text = repr(verdict)
    assert not verdict, text
    want = experts._expected(experts.CASES[0], 13)[0]
    i = next(i for i, (a, b) in enumerate(zip(want["arrival"], want["labels"])) if a != b)
    (s, t, e), (s2, t2, e2) = want["arrival"][i], want["labels"][i]
    assert (f"rank 0: combine's all_to_all_single sent the outputs in the order it was given them (by expert, "
            f"then source rank): its row {i} is the output for token {t2} of rank {s2} (expert {e2}); expected "
            f"the output for token {t} of rank {s} (expert {e})") in text, text
    assert "Put the outputs back in the order the rows arrived" in text, text


# ---- no counts exchange: Gloo aborts a rank --------------------------------------------------------

def no_counts_exchange(x, expert, n_experts):
    """The classic mistake: no counts exchanged, so each rank takes its own splits for what it receives."""
    n = dist.get_world_size()
    m = n_experts // n
    token, slot = (expert >= 0).nonzero(as_tuple=True)
    order = expert[token, slot].argsort(stable=True)
    token, slot = token[order], slot[order]
    in_splits = torch.bincount(expert[token, slot], minlength=n_experts).view(n, m).sum(1).tolist()
    received = x.new_empty(sum(in_splits), x.shape[1])
    dist.all_to_all_single(received, x[token], in_splits, in_splits)     # wrong: output splits unknown
    return received, (token, slot, in_splits, in_splits, torch.arange(len(received)))


def test_forgetting_the_counts_exchange_is_named_in_the_first_case():
    with decisive(FIRST):
        verdict = check_dispatch_combine(no_counts_exchange, solutions.combine)
    text = repr(verdict)
    assert not verdict, text
    first = text.splitlines()[1]
    assert first.startswith("   - world_size=2, 4 experts, top-2, 6 tokens per rank: rank "), text
    assert "output_split_sizes" in first and "only the counts, exchanged first" in first, text
    assert "Received data size doesn't match expected size" in first, text


# ---- a combine without the router's weights --------------------------------------------------------

def unweighted_combine(y, weight, state):
    token, slot, in_splits, out_splits, by_expert = state
    arrived = torch.empty_like(y)
    arrived[by_expert] = y
    back = y.new_empty(sum(in_splits), y.shape[1])
    dist.all_to_all_single(back, arrived, in_splits, out_splits)
    return torch.zeros(weight.shape[0], y.shape[1]).index_add(0, token, back)    # no weight


def test_a_combine_that_forgets_the_router_weights_is_named_with_the_token():
    with decisive(FIRST):
        verdict = check_dispatch_combine(solutions.dispatch, unweighted_combine)
    text = repr(verdict)
    assert not verdict, text
    assert "rank 0, token 0: got the plain sum of its experts' outputs" in text, text
    assert "multiply each by its router weight" in text, text


# ---- dropped tokens counted twice -------------------------------------------------------------------

def dispatch_keeping_x(x, expert, n_experts):
    received, state = solutions.dispatch(x, expert, n_experts)
    return received, (state, x, expert)


def passthrough_combine(y, weight, state):
    """A dropped token (every choice over capacity) returned as itself: the residual adds it again."""
    state, x, expert = state
    out = solutions.combine(y, weight, state)
    dropped = (expert < 0).all(dim=1)
    return torch.where(dropped[:, None], x, out)


def test_a_dropped_token_returned_as_itself_is_counted_twice_and_named():
    with decisive(FIRST):
        verdict = check_dispatch_combine(dispatch_keeping_x, passthrough_combine)
    text = repr(verdict)
    assert not verdict, text
    assert "every choice of it was dropped" in text and "counts it twice" in text, text
    ranks, _ = experts._case_data(experts.CASES[0], 13)
    first = [(r, t) for r, (_, expert, _) in enumerate(ranks) for t in range(len(expert)) if (expert[t] < 0).all()]
    assert f"rank {first[0][0]}, token {first[0][1]}:" in text, (first, text)


def sending_dropped_choices(x, expert, n_experts):
    """Dropped choices (-1) sent anyway, to the last expert's rank: each counted in a split."""
    return solutions.dispatch(x, expert.where(expert >= 0, n_experts - 1), n_experts)


def test_dropped_choices_sent_anyway_are_named_by_their_splits():
    with decisive(FIRST):
        verdict = check_dispatch_combine(sending_dropped_choices, solutions.combine)
    text = repr(verdict)
    assert not verdict, text
    assert "rank 0: the all_to_all_single of rows had input_split_sizes" in text, text
    assert "expert -1 was dropped and is not sent" in text, text


# ---- the byte counter the notebook uses --------------------------------------------------------------

def _uneven_all_to_all():
    r, n = dist.get_rank(), dist.get_world_size()
    ins = [r + 1 + j for j in range(n)]                 # rows of 3 float32 to each rank
    outs = [s + 1 + r for s in range(n)]
    with experts.CollectiveLog() as log:
        dist.all_to_all_single(torch.empty(sum(outs), 3), torch.ones(sum(ins), 3), outs, ins)
        dist.all_reduce(torch.ones(5))
    return log.calls, log.sent()


def test_the_collective_log_counts_split_sizes_and_bytes_to_other_ranks():
    results = launch(_uneven_all_to_all, 3, quiet=True)
    for r, (calls, sent) in enumerate(results):
        ins = [r + 1 + j for j in range(3)]
        assert [c["op"] for c in calls] == ["all_to_all", "all_reduce"]
        assert calls[0]["in_splits"] == ins and calls[0]["out_splits"] == [s + 1 + r for s in range(3)]
        assert sent == (sum(ins) - ins[r]) * 12 and calls[1]["nbytes"] == 20 and calls[1]["group"] == 3


# ---- an error in the combine, and a list all-to-all -------------------------------------------------

def unswapped_combine(y, weight, state):
    """The combine's all-to-all with the dispatch's splits as they were, not swapped: it raises."""
    token, slot, in_splits, out_splits, by_expert = state
    arrived = torch.empty_like(y)
    arrived[by_expert] = y
    back = y.new_empty(sum(out_splits), y.shape[1])
    dist.all_to_all_single(back, arrived, out_splits, in_splits)
    return torch.zeros(weight.shape[0], y.shape[1]).index_add(0, token, weight[token, slot, None] * back)


def test_an_error_in_the_combine_is_named_as_the_combines_with_its_splits():
    with decisive(FIRST):
        verdict = check_dispatch_combine(solutions.dispatch, unswapped_combine)
    text = repr(verdict)
    assert not verdict and "dispatch raised" not in text, text
    assert "rank 0: combine's all_to_all_single had input_split_sizes" in text, text
    assert "(dispatch's, swapped); the all-to-all failed on it" in text, text


def list_all_to_all(x, expert, n_experts):
    """The rows sent with dist.all_to_all, a list of tensors, one per rank (Gloo's needs equal shapes)."""
    n = dist.get_world_size()
    m = n_experts // n
    token, slot = (expert >= 0).nonzero(as_tuple=True)
    order = expert[token, slot].argsort(stable=True)
    token, slot = token[order], slot[order]
    counts = torch.bincount(expert[token, slot], minlength=n_experts)
    from_each = torch.empty_like(counts)
    dist.all_to_all_single(from_each, counts)
    in_splits = counts.view(n, m).sum(1).tolist()
    out_splits = from_each.view(n, m).sum(1).tolist()
    outs = [x.new_empty(s, x.shape[1]) for s in out_splits]
    dist.all_to_all(outs, list(x[token].split(in_splits)))
    blocks = torch.arange(sum(out_splits)).split(from_each.tolist())
    by_expert = torch.cat([blocks[s * m + e] for e in range(m) for s in range(n)])
    return torch.cat(outs)[by_expert], (token, slot, in_splits, out_splits, by_expert)


def test_a_list_all_to_all_is_named_and_pointed_to_all_to_all_single():
    with decisive(FIRST):
        verdict = check_dispatch_combine(list_all_to_all, solutions.combine)
    text = repr(verdict)
    assert not verdict, text
    assert "rank 0: dispatch called dist.all_to_all with a list of tensors" in text, text
    assert "one dist.all_to_all_single with input_split_sizes and output_split_sizes" in text, text
