"""Checkers for notebook 10's exercises (re-exported by `ddp_helpers.exercises`).

check_one_f_one_b: the learner writes the order of a 1F1B pipeline schedule,
`fn(forward, backward, m, rank, p)`, calling forward(i) and backward(i) for each micro-batch.
The checker runs it on real Gloo ranks (p stages of the tiny transformer, one block each) and
checks, in this order: the gradients equal one process's; every rank ran each micro-batch's
forward and backward once, in micro-batch order; the messages (recorded by wrapping
send/recv/isend/irecv in each rank, as the point-to-point checkers do) are one activation forward
and one gradient back per micro-batch, to the neighbours only; the activations a rank held at once
(counted in micro-batches from its order, and in bytes with saved_tensors_hooks) are at most
min(m, p - rank), which is what 1F1B is for; and the order, replayed on an ideal clock (forward 1
slot, backward 2), leaves the bubble of a full pipeline, (p-1)/(m+p-1), so a schedule that never
fills the pipeline is named too. GPipe's order gives the right gradients, messages and bubble,
and is rejected for its memory. A last case, drawn when the checker runs (`runner.unseen`), has a
number of stages and micro-batches no public case has.
"""
from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import runner
from .collectives import run_counting_p2p
from .traffic import Traffic
from .verdict import Verdict, difference

__all__ = ["check_one_f_one_b", "counting_sends"]

# (stages, micro-batches): m = p, m > p, and m not a multiple of p
_CASES = [(2, 4), (3, 3), (3, 5), (4, 6)]
_BATCH = 1   # sequences per micro-batch


class _Stage(nn.Module):
    def __init__(self, model, s, p):
        super().__init__()
        per = len(model.blocks) // p
        self.first, self.last = s == 0, s == p - 1
        self.tok, self.pos = (model.tok, model.pos) if self.first else (None, None)
        self.blocks = model.blocks[s * per:(s + 1) * per]
        self.norm, self.head = (model.norm, model.head) if self.last else (None, None)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _Saved:
    """Bytes autograd holds for backward (parameters and the token batch left out), and the peak."""

    def __init__(self, leave_out):
        self.leave_out = {t.untyped_storage().data_ptr() for t in leave_out}
        self.refs, self.now, self.peak = {}, 0, 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        return t if key in self.leave_out else _Held(self, t, key)

    @staticmethod
    def unpack(saved):
        return saved.t if isinstance(saved, _Held) else saved


class _Held:
    def __init__(self, counter, t, key):
        self.counter, self.t, self.key = counter, t, key
        counter.refs[key] = counter.refs.get(key, 0) + 1
        if counter.refs[key] == 1:
            counter.now += t.untyped_storage().nbytes()
            counter.peak = max(counter.peak, counter.now)

    def __del__(self):
        c = self.counter
        c.refs[self.key] -= 1
        if not c.refs[self.key]:
            del c.refs[self.key]
            c.now -= self.t.untyped_storage().nbytes()


def _setup(p, m):
    from ..tiny_transformer import Config, TinyTransformer, batch
    cfg = Config(layers=p)
    model = TinyTransformer(cfg)
    tokens, targets = batch(cfg, _BATCH * m)
    return cfg, model, tokens, targets


def _reference(p, m):
    """One process: the gradients, and each stage's saved bytes for one micro-batch."""
    cfg, model, tokens, targets = _setup(p, m)
    _loss(model(tokens), targets).backward()
    grads = {name: q.grad for name, q in model.named_parameters()}
    cfg, model, tokens, targets = _setup(p, m)
    x, units = tokens[:_BATCH], []
    for s in range(p):
        counter = _Saved([*model.parameters(), tokens])
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            x = _Stage(model, s, p)(x.detach() if s else x)
            if s == p - 1:
                _loss(x, targets[:_BATCH])
        units.append(counter.peak)
    return grads, units


def _pipeline_in_rank(fn, p, m):
    """Inside a rank: the learner's order, with forward(i)/backward(i) as notebook 10 writes them."""
    rank = dist.get_rank()
    cfg, model, tokens, targets = _setup(p, m)
    stage = _Stage(model, rank, p)
    tokens, targets = tokens.chunk(m), targets.chunk(m)
    shape = (_BATCH, cfg.seq_len, cfg.dim)
    inputs, outputs, sends, order = {}, {}, [], []
    counter = _Saved([*model.parameters(), *tokens])

    def forward(i):
        order.append(("F", int(i)))
        if rank == 0:
            x = tokens[i]
        else:
            x = torch.empty(shape)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if rank == p - 1:
            y = _loss(y, targets[i]) / m
        else:
            sends.append((y, dist.isend(y.detach(), dst=rank + 1)))
        inputs[i], outputs[i] = x, y

    def backward(i):
        order.append(("B", int(i)))
        if i not in outputs:
            raise RuntimeError(f"backward({i}) on rank {rank} before forward({i}) (or a second time)")
        grad = None
        if rank < p - 1:
            grad = torch.empty(shape)
            dist.recv(grad, src=rank + 1)
        outputs.pop(i).backward(grad)
        x = inputs.pop(i)
        if rank > 0:
            sends.append((x.grad, dist.isend(x.grad, dst=rank - 1)))

    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        fn(forward, backward, m, rank, p)
    for _, work in sends:
        work.wait()
    grads = {name: q.grad for name, q in model.named_parameters() if q.grad is not None}
    return grads, order, counter.peak


def _replay(orders, f=1, b=2):
    """Each rank's (kind, micro-batch) order on an ideal clock; None if it cannot go on."""
    p = len(orders)
    done, free, position = {}, [0] * p, [0] * p
    busy = [0] * p
    while any(position[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            kind, i = orders[r][position[r]]
            need = (("F", r - 1, i) if r > 0 else None) if kind == "F" else \
                (("B", r + 1, i) if r < p - 1 else ("F", r, i))
            if need is None or need in done:
                start = max(free[r], done.get(need, 0))
                free[r] = done[(kind, r, i)] = start + (f if kind == "F" else b)
                busy[r] += f if kind == "F" else b
                position[r] += 1
                moved = True
        if not moved:
            return None
    end = max(free)
    return [1 - Fraction(busy[r], end) for r in range(p)]


def _order_problem(orders, p, m):
    for r, order in enumerate(orders):
        for kind, name in (("F", "forward"), ("B", "backward")):
            seen = [i for k, i in order if k == kind]
            if sorted(seen) != list(range(m)):
                missing = sorted(set(range(m)) - set(seen))
                twice = sorted({i for i in seen if seen.count(i) > 1})
                what = f"never ran {name}({missing[0]})" if missing else f"ran {name}({twice[0]}) twice" \
                    if twice else f"ran {name} for micro-batches {seen}"
                return f"rank {r} {what}: each micro-batch gets one forward and one backward on every stage"
            if seen != list(range(m)):
                return (f"rank {r} ran its {name}s in the order {seen}: a pipeline keeps micro-batch order "
                        f"(micro-batch i's message must meet the neighbour's i-th receive)")
    return None


def _message_problem(traffic, p, m, nbytes):
    for r in range(p):
        want = {}
        if r < p - 1:
            want[r + 1] = m
        if r > 0:
            want[r - 1] = m
        got = {}
        for (src, dst, _), size in traffic.message_bytes.items():
            if src == r:
                got[dst] = got.get(dst, 0) + 1
                if size != nbytes:
                    return (f"rank {r} sent a message of {size} bytes to rank {dst}; a stage sends one "
                            f"micro-batch's activations or their gradient, {nbytes} bytes")
        if got != want:
            return (f"rank {r} sent {got or 'nothing'} (messages per rank); a stage sends each micro-batch's "
                    f"activations to the next rank and its input gradient to the one before: {want}")
    return None


def counting_sends(fn: Callable, *args) -> tuple:
    """Inside a rank: `fn(*args)` with send/isend/recv/irecv recorded (batch_isend_irecv too, as the
    point-to-point checkers record them). Returns (what fn returned, bytes this rank sent)."""
    result, events = run_counting_p2p(fn, lambda rank, world_size: args, ())
    return result, sum(nbytes for kind, _, _, nbytes in events if kind == "send")


def _draw_case(rng):
    """(stages, micro-batches) that no public case has: an order looked up by (p, m) has none for it."""
    return rng.choice([(p, m) for p in (2, 3, 4) for m in range(p, p + 5) if (p, m) not in _CASES])


def check_one_f_one_b(fn: Callable[[Callable, Callable, int, int, int], None]) -> Verdict:
    """Notebook 10: `fn(forward, backward, m, rank, p)` runs this rank's forward(i) and backward(i),
    i = 0..m-1, in 1F1B order. Checked on 2, 3 and 4 real ranks (see the module's docstring)."""
    title = "my_1f1b"
    unseen = runner.unseen(_draw_case)
    references = {case: _reference(*case) for case in _CASES + unseen}   # before any of the learner's code runs
    check = runner.Checker(title, fn)
    forbidden = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier")

    def plan(case):
        p, m = case
        return run_counting_p2p, p, (_pipeline_in_rank, lambda r, n: (fn, p, m), forbidden)

    for p, m in check.each(_CASES, unseen, plan):
        label = check.label(f"p={p} stages, m={m} micro-batches")
        grads_ref, units = references[p, m]
        got = check.run(
            *check.planned, label,
            never_finished="a backward(i) waits for the next stage's backward(i), which needs forward(i) to "
                           "have gone through every stage first")
        if got is None:
            continue
        results = [value for value, _ in got]
        traffic = Traffic([events for _, events in got])
        orders = [order for _, order, _ in results]
        problem = _order_problem(orders, p, m)
        if not problem:
            for r, (grads, _, _) in enumerate(results):
                for name, grad in grads.items():
                    if difference(grads_ref[name], grad, rtol=1e-4, atol=1e-6):
                        problem = (f"rank {r}: the gradient of {name} differs from one process's "
                                   f"(largest difference {(grad - grads_ref[name]).abs().max().item():.2g})")
                        break
                if problem:
                    break
        if not problem:
            problem = _message_problem(traffic, p, m, 4 * _BATCH * 16 * 32)
        if not problem:
            for r, (order, (_, _, peak)) in enumerate(zip(orders, results)):
                held, most = 0, 0
                for kind, _ in order:
                    held += 1 if kind == "F" else -1
                    most = max(most, held)
                limit = min(m, p - r)
                if most > limit or peak > limit * units[r]:
                    problem = (f"rank {r} held {most} micro-batches' activations at once ({peak:,} bytes "
                               f"saved for backward, {units[r]:,} per micro-batch): that is GPipe's memory. "
                               f"1F1B runs at most p - rank = {limit} forwards before each backward, so a "
                               f"stage holds at most {limit} ({limit * units[r]:,} bytes)")
                    break
        if not problem:
            idle = _replay(orders)
            want = Fraction(p - 1, m + p - 1)
            if idle is None:
                problem = "replayed, this order cannot go on: some backward comes before its inputs exist"
            elif max(idle) > want:
                r = max(range(p), key=lambda k: idle[k])
                problem = (f"replayed on an ideal clock (forward 1 slot, backward 2), rank {r} idles "
                           f"{float(idle[r]):.0%} of the step; a full pipeline idles (p-1)/(m+p-1) = "
                           f"{float(want):.0%}. Let stage r run p - r - 1 forwards before its first "
                           f"backward, so the pipeline fills")
        if problem:
            check.problems.append(f"{label}: {problem}")
            break   # the other cases would say the same
    return check.verdict()
