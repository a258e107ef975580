"""Notebook 13's exercise and its byte counter: the dispatch and combine of expert parallelism.

`check_dispatch_combine(dispatch, combine)`: the learner writes the two all-to-alls of a mixture-of-
experts layer split over ranks (rank r holds experts r*m ... r*m+m-1, m = n_experts / world_size), with
the rows each rank receives grouped by expert (each expert's rows one block, as a grouped matrix
multiply takes them), not by source rank as the all-to-all delivers them:

    received, state = dispatch(x, expert, n_experts)   # x (T, d) this rank's tokens; expert (T, k) the
                                                       # experts each token chose, -1 where dropped
    out = combine(y, weight, state)                    # y: the experts' output for each received row,
                                                       # in its order; weight (T, k): the router's weights

The checker routes random tokens itself (top-k with a capacity, so some choices are dropped), runs both
functions on real Gloo ranks with its own experts between them, and checks, in this order: what each
rank's dispatch called (the counts first, then ONE all_to_all_single of rows; an all-gather of the tokens
gives the right numbers and is named for its traffic), the split sizes of that all-to-all, the rows it
sent (sorted by expert, in token order), the rows it returned (by expert, then source rank, in token
order: the row that went wrong is named by its rank and token, and rows left in the order they arrived
are named as such), the combine's one all-to-all with the splits swapped and the rows it sent (back in
the order they arrived), and each token's output against one process (a combine without the router's
weights, or one that returns a dropped token itself, is named). Split sizes that do not match between
ranks make Gloo abort a rank; that case is named too (the counts exchange). A last case, drawn when the
checker runs (`runner.unseen`), has random sizes and data.

`CollectiveLog` (from `collective_log`, re-exported here for the notebook) records what each rank's
dispatch and combine called.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .collective_log import Call, CollectiveLog, _plain
from .verdict import Verdict

__all__ = ["check_dispatch_combine", "CollectiveLog", "Call", "route", "CASES"]

# (world_size, tokens per rank, width, experts, k, capacity factor): every case drops some choices
CASES = [(2, 6, 4, 4, 2, 1.0), (4, 5, 3, 8, 2, 1.0), (2, 7, 4, 2, 1, 1.0)]


# ---- the checker's own layer: routing and experts ----------------------------------------------

def route(x: torch.Tensor, router: torch.Tensor, k: int, capacity_factor: float | None):
    """Notebook 13's router: softmax, top-k, then each expert takes its first `capacity` choices (first
    choices first, in token order); the others are dropped (-1). Returns (expert, weight)."""
    probs = (x @ router.T).softmax(dim=-1)
    weight, expert = probs.topk(k, dim=-1)
    if capacity_factor is not None:
        n_experts = router.shape[0]
        capacity = math.ceil(capacity_factor * x.shape[0] * k / n_experts)
        queue = torch.nn.functional.one_hot(expert, n_experts).transpose(0, 1).reshape(-1, n_experts)
        place = (queue.cumsum(0) * queue).sum(-1).reshape(k, -1).T - 1
        expert = expert.masked_fill(place >= capacity, -1)
    return expert, weight


def _case_data(case, seed):
    """Every rank's tokens, routing and the checker's experts, from one seed: the same in every process."""
    world_size, tokens, width, n_experts, k, capacity_factor = case
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(n_experts, width, generator=g)
    mats = torch.randn(n_experts, width, width, generator=g)
    ranks = []
    for _ in range(world_size):
        x = torch.randn(tokens, width, generator=g)
        expert, weight = route(x, router, k, capacity_factor)
        ranks.append((x, expert, weight))
    return ranks, mats


def _apply_expert(mats, e, rows):
    return torch.tanh(rows @ mats[e]) + 0.1 * (e + 1)


def _expected(case, seed):
    """Per rank: the rows it must send (`sent_labels`: (rank, token, expert) for each, sorted by
    expert), those it receives in the order they arrive (`arrival`: by source rank, then expert) and in
    the order dispatch returns them (`labels`: by expert, then source rank), its splits, the experts'
    output on its rows (`y`, in `labels` order; `y_arrival`, in arrival order) and the one-process
    output of its tokens."""
    world_size, tokens, width, n_experts, k, _ = case
    ranks, mats = _case_data(case, seed)
    m = n_experts // world_size
    per_rank = []
    for r in range(world_size):
        arrival, counts = [], torch.zeros(world_size, m, dtype=torch.long)
        for s, (_x, expert, _) in enumerate(ranks):
            for e in range(r * m, r * m + m):
                for t in range(tokens):
                    if (expert[t] == e).any():          # (top-k: an expert at most once per token)
                        arrival.append((s, t, e))
                        counts[s, e - r * m] += 1
        labels = sorted(arrival, key=lambda label: (label[2], label[0]))   # stable: tokens stay in order
        stack = lambda rows: torch.stack(rows) if rows else torch.empty(0, width)
        received = stack([ranks[s][0][t] for s, t, _ in labels])
        y = stack([_apply_expert(mats, e, ranks[s][0][t:t + 1])[0] for s, t, e in labels])
        y_arrival = stack([y[labels.index(label)] for label in arrival])
        x, expert, weight = ranks[r]
        sent_labels = [(r, t, e) for e in range(n_experts) for t in range(tokens) if (expert[t] == e).any()]
        out = torch.zeros(tokens, width)
        for t in range(tokens):
            for j in range(k):
                if expert[t, j] >= 0:
                    out[t] += weight[t, j] * _apply_expert(mats, int(expert[t, j]), x[t:t + 1])[0]
        kept = expert[expert >= 0]
        in_splits = [int(((kept >= q * m) & (kept < q * m + m)).sum()) for q in range(world_size)]
        per_rank.append(dict(labels=labels, arrival=arrival, sent_labels=sent_labels, received=received,
                             arrived=stack([ranks[s][0][t] for s, t, _ in arrival]),
                             sent=stack([x[t] for _, t, _ in sent_labels]), y=y, y_arrival=y_arrival, out=out,
                             in_splits=in_splits, out_splits=counts.sum(1).tolist(), x=x, expert=expert,
                             weight=weight, mats=mats))
    return per_rank


def _in_rank(dispatch, combine, case, seed, rows, ys):
    """Inside a rank: dispatch, the checker's experts (where the rows are right), combine."""
    rank = dist.get_rank()
    ranks, _ = _case_data(case, seed)
    x, expert, weight = ranks[rank]
    result = {"error": None, "stage": "dispatch", "received": None, "out": None, "stub": None}
    with CollectiveLog(keep_rows=True) as log:
        try:
            got = dispatch(x.clone(), expert.clone(), case[3])
        except NotImplementedError:
            result["stub"] = "dispatch"
        except Exception as err:
            result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    result["dispatch_calls"] = log.calls
    if result["error"] or result["stub"]:
        return result
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        result["error"] = f"returned {type(got).__name__}, expected (received, state)"
        return result
    received, state = got
    result["received"] = _plain(received)
    ok = torch.tensor([int(result["received"] is not None and tuple(received.shape) == tuple(ys[rank].shape)
                           and torch.equal(result["received"], rows[rank]))])
    try:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)      # combine only where every rank's rows are right
    except Exception:
        return result
    if not ok.item():
        return result
    result["stage"] = "combine"
    with CollectiveLog(keep_rows=True) as log:
        try:
            out = combine(ys[rank].clone(), weight.clone(), state)
        except NotImplementedError:
            result["stub"], out = "combine", None
        except Exception as err:
            result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            out = None
    result["combine_calls"], result["out"] = log.calls, _plain(out)
    return result


# ---- what went wrong, in words -----------------------------------------------------------------

LIST_ALL_TO_ALL = ("called dist.all_to_all with a list of tensors: Gloo's needs them all the same shape, and "
                   "the rows for each rank differ in number. Send them with one dist.all_to_all_single with "
                   "input_split_sizes and output_split_sizes")

SIZES_DIFFER = ("a rank got more rows than its output_split_sizes made room for. Rank i's "
                "output_split_sizes[j] must equal rank j's input_split_sizes[i]: only the counts, exchanged "
                "first with an all_to_all_single of n_experts integers, tell rank i how many rows each rank "
                "sends it")


def _who(labels, received, want, ranks, i) -> str:
    """Row i of a rank's received rows: which token it is, and which it should have been."""
    s, t, e = labels[i] if i < len(labels) else (None, None, None)
    row = received[i]
    found = [(q, u) for q, (x, _, _) in enumerate(ranks) for u in range(len(x)) if torch.equal(x[u], row)]
    should = f"token {t} of rank {s} (for expert {e})" if s is not None else "nothing (no more rows)"
    if not found:
        return f"row {i} is no token of any rank; expected {should}"
    q, u = found[0]
    chose = [int(c) for c in ranks[q][1][u] if c >= 0]
    return f"row {i} is token {u} of rank {q} (kept experts {chose}); expected {should}"


def _first_wrong_row(got, want) -> int | None:
    """The first row where two tensors of rows differ (the shorter one's end counts), or None."""
    for i in range(max(len(got), len(want))):
        if i >= len(got) or i >= len(want) or not torch.equal(got[i], want[i]):
            return i
    return None


def _dispatch_problem(r, res, want, case, ranks):
    world_size, tokens, width, n_experts, k, _ = case
    error = res["error"] if res["stage"] == "dispatch" else None    # (not the combine's)
    calls = res["dispatch_calls"]
    rows = [c for c in calls if c['op'] == "all_to_all" and len(c['shape']) == 2 and "float" in c['dtype']]
    floats = [c for c in calls if len(c['shape']) == 2 and "float" in c['dtype'] and c['op'] != "all_to_all"]
    wanted = sum(want['in_splits']) - want['in_splits'][r]
    if floats:
        c = floats[0]
        return (f"dispatch called {c['op']} on a ({', '.join(map(str, c['shape']))}) tensor of rows: every rank gets "
                f"every token (right numbers, wrong traffic: {c['to_others'] or c['nbytes']} bytes to other ranks). "
                f"Send each kept choice's row only to its expert's rank, with one all_to_all_single: "
                f"{wanted * width * 4} bytes")
    if any(c['in_splits'] is None for c in rows):
        return "dispatch " + LIST_ALL_TO_ALL
    if rows:
        problem = _split_problem(rows[0], want, world_size)
        if problem:
            return problem + ("; the all-to-all failed on it" if error else "")
    if error:
        return f"dispatch raised {error}"
    if not rows:
        return "dispatch made no all_to_all_single of rows (a 2-D tensor of tokens): that is how rows travel"
    if len(rows) > 1:
        return f"dispatch made {len(rows)} all_to_all_single calls of rows: one carries every row"
    if not any(len(c['shape']) == 1 for c in calls[:calls.index(rows[0])]):
        return ("dispatch sent rows without exchanging the counts first: a rank cannot know its "
                "output_split_sizes (how many rows each rank sends it) without them")
    sent = rows[0].get("rows")
    i = _first_wrong_row(sent, want["sent"]) if isinstance(sent, torch.Tensor) else None
    if i is not None:
        who = _who(want['sent_labels'], sent, want, ranks, i)
        return (f"the rows its all_to_all_single sent are out of order: {who}: each rank sends the rows of "
                f"split j to rank j, so its kept choices must be sorted by expert "
                f"(stably: each expert's in token order) to match its splits")
    return None


def _received_problem(r, res, want, ranks):
    """After every rank's dispatch sent the right rows: the rows it returned, in their order."""
    got = res["received"]
    if got is None:
        return "dispatch returned no tensor of received rows"
    if tuple(got.shape) != tuple(want["received"].shape):
        return f"received rows of shape {tuple(got.shape)}; expected {tuple(want['received'].shape)}"
    i = _first_wrong_row(got, want["received"])
    if i is None:
        return None
    if torch.equal(got, want["arrived"]):
        return (f"dispatch returned the rows in the order they arrived (by source rank, then expert): "
                f"{_who(want['labels'], got, want, ranks, i)}. Regroup them by expert, then source rank "
                f"(the counts say where the block of each source rank and expert starts), and let combine "
                f"put the outputs back in the order the rows arrived")
    return (f"{_who(want['labels'], got, want, ranks, i)}: dispatch returns each expert's rows as one "
            f"block, in expert order; in a block, rank 0's rows first, then rank 1's, ..., each in token order")


def _split_problem(c, want, world_size):
    if c['in_splits'] != want["in_splits"]:
        hint = " (split j is the number of rows for rank j, in rank order)" \
            if sorted(c['in_splits']) == sorted(want["in_splits"]) else \
            " (count only the kept choices: expert -1 was dropped and is not sent)" \
            if sum(c['in_splits']) > sum(want["in_splits"]) else ""
        return (f"the all_to_all_single of rows had input_split_sizes {c['in_splits']}: this rank keeps "
                f"{want['in_splits']} rows for ranks 0..{world_size - 1}'s experts{hint}")
    if c['out_splits'] != want["out_splits"]:
        return (f"the all_to_all_single of rows had output_split_sizes {c['out_splits']}: ranks 0..{world_size - 1} "
                f"send this rank {want['out_splits']} rows (the counts exchanged first say so)")
    return None


def _combine_problem(r, res, want, case):
    world_size, tokens, width, n_experts, k, _ = case
    calls = [c for c in res["combine_calls"] if len(c['shape']) == 2 or c['op'] != "all_to_all"]
    a2a = [c for c in calls if c['op'] == "all_to_all"]
    others = [c for c in calls if c['op'] != "all_to_all"]
    failed = "; the all-to-all failed on it" if res["error"] else ""
    if any(c['in_splits'] is None for c in a2a):
        return "combine " + LIST_ALL_TO_ALL
    if len(a2a) == 1 and (a2a[0]['in_splits'] != want['out_splits'] or a2a[0]['out_splits'] != want['in_splits']):
        c = a2a[0]
        return (f"combine's all_to_all_single had input_split_sizes {c['in_splits']} and output_split_sizes "
                f"{c['out_splits']}; the rows go back the way they came: {want['out_splits']} and "
                f"{want['in_splits']} (dispatch's, swapped){failed}")
    if res["error"]:
        return f"combine raised {res['error']}"
    if others:
        return (f"combine called {others[0]['op']}: the experts' outputs go back to their tokens' ranks with one "
                f"all_to_all_single, the dispatch's splits swapped")
    if len(a2a) != 1:
        return f"combine made {len(a2a)} all_to_all_single calls of rows; one sends every row home"
    sent = a2a[0].get("rows")
    i = _first_wrong_row(sent, want["y_arrival"]) if isinstance(sent, torch.Tensor) else None
    if i is not None:
        given = "the outputs in the order it was given them (by expert, then source rank)" \
            if torch.equal(sent, want["y"]) else "rows in another order"
        s, t, e = want["arrival"][i] if i < len(want["arrival"]) else (None, None, None)
        found = [label for j, label in enumerate(want["labels"])
                 if i < len(sent) and torch.equal(want["y"][j], sent[i])]
        was = f"the output for token {found[0][1]} of rank {found[0][0]} (expert {found[0][2]})" if found else \
            "no output of this rank's experts" if i < len(sent) else "nothing"
        return (f"combine's all_to_all_single sent {given}: its row {i} is {was}; expected the output for token "
                f"{t} of rank {s} (expert {e}). Put the outputs back in the order the rows arrived (by source rank, "
                f"then expert) before sending them home: split j goes back to rank j")
    out = res["out"]
    if out is None or tuple(out.shape) != (tokens, width):
        return f"combine returned {'no tensor' if out is None else tuple(out.shape)}; expected ({tokens}, {width})"
    x, expert, weight = want["x"], want["expert"], want["weight"]
    for t in range(tokens):
        if torch.allclose(out[t], want["out"][t], rtol=1e-5, atol=1e-6):
            continue
        chose = [int(e) for e in expert[t] if e >= 0]
        unweighted = sum((_apply_expert(want["mats"], e, x[t:t + 1])[0] for e in chose), torch.zeros(width))
        if not chose and torch.allclose(out[t], x[t], atol=1e-6):
            return (f"token {t}: every choice of it was dropped (its experts were full), so the layer's output "
                    f"for it is 0 and the residual connection carries it on; combine returned the token "
                    f"itself, so the block counts it twice")
        if chose and torch.allclose(out[t], want["out"][t] + x[t], rtol=1e-5, atol=1e-6):
            return f"token {t}: the output has the token itself added: the residual connection adds it already"
        if chose and torch.allclose(out[t], unweighted, rtol=1e-5, atol=1e-6):
            return (f"token {t}: got the plain sum of its experts' outputs; multiply each by its router weight "
                    f"({', '.join(f'{float(w):.3f}' for w, e in zip(weight[t], expert[t]) if e >= 0)}) first")
        return (f"token {t} (experts {chose}): expected {[round(float(v), 4) for v in want['out'][t][:3]]}..., "
                f"got {[round(float(v), 4) for v in out[t][:3]]}...")
    return None


def _stub_problem(results, dispatch, combine):
    """Which of the two functions is still the stub (combine runs only after a right dispatch)."""
    stubs = {res["stub"] for res in results} - {None}
    if "dispatch" in stubs:
        return f"{runner.name_of(dispatch)} still raises NotImplementedError: fill in the stub"
    if "combine" in stubs:
        return (f"{runner.name_of(combine)} still raises NotImplementedError: fill in the stub "
                f"({runner.name_of(dispatch)} passed: its collectives, splits and rows are right)")
    return None


def _draw_case(rng):
    """A case no answer can have looked up: sizes and data drawn when the checker runs."""
    world_size, per_rank = rng.choice((2, 3)), rng.choice((1, 2))
    n_experts = world_size * per_rank
    case = (world_size, rng.randint(4, 9), rng.randint(3, 6), n_experts, rng.choice((1, 2)) if n_experts > 1 else 1,
            rng.choice((1.0, 1.25)))
    return case, rng.randrange(2**31)


def check_dispatch_combine(dispatch: Callable, combine: Callable) -> Verdict:
    """Notebook 13: `dispatch(x, expert, n_experts) -> (received, state)` and `combine(y, weight, state) ->
    out`, the two all-to-alls of expert parallelism. Checked on 2 and 4 real ranks, with dropped choices,
    for their collectives, split sizes, bytes, the rows each rank received and each token's output (see
    the module's docstring)."""
    title = "my_dispatch, my_combine"
    for fn, what in ((dispatch, "dispatch(x, expert, n_experts)"), (combine, "combine(y, weight, state)")):
        wrong = runner.not_a_function(title, fn, what)
        if wrong:
            return wrong
    cases, unseen = [(case, 13 + i) for i, case in enumerate(CASES)], runner.unseen(_draw_case)
    wants = {key: _expected(*key) for key in cases + unseen}   # before any of the learner's code runs
    check = runner.Checker(title, who=f"{runner.name_of(dispatch)} / {runner.name_of(combine)}")
    def plan(case_seed):
        case, seed = case_seed
        want = wants[case, seed]
        return _in_rank, case[0], (dispatch, combine, case, seed, [w["received"] for w in want],
                                   [w["y"] for w in want])

    for case, seed in check.each(cases, unseen, plan):
        world_size, tokens, width, n_experts, k, cf = case
        label = check.label(f"world_size={world_size}, {n_experts} experts, top-{k}, {tokens} tokens per rank")
        want = wants[case, seed]
        results = check.run(
            *check.planned, label,
            never_finished="they wait in an all-to-all another rank never joined, or with sizes that do "
                           "not match (every rank calls the same collectives, and rank j's "
                           "output_split_sizes[i] equals rank i's input_split_sizes[j])",
            partner_left=": another rank left the all-to-all (its split sizes did not match)",
            size_mismatch=SIZES_DIFFER)
        if results is None:
            continue
        ranks, _ = _case_data(case, seed)
        problem = _stub_problem(results, dispatch, combine)
        for r, res in enumerate(results if not problem else []):
            problem = _dispatch_problem(r, res, want[r], case, ranks)
            if problem:
                problem = f"rank {r}: {problem}"
                break
        for r, res in enumerate(results if not problem else []):    # every rank sent the right rows
            problem = _received_problem(r, res, want[r], ranks)
            if problem:
                problem = f"rank {r}: {problem}"
                break
        if not problem:
            for r, res in enumerate(results):
                problem = _combine_problem(r, res, want[r], case)
                if problem:
                    problem = f"rank {r}, {problem}" if problem.startswith("token") else f"rank {r}: {problem}"
                    break
        if problem and "NotImplementedError" in problem:
            check.problems.append(problem)
            check.stop()
        elif problem:
            check.problems.append(f"{label}: {problem}")
            check.stop()
    return check.verdict()
