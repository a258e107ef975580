"""Checkers for notebook 06's exercises (re-exported by `ddp_helpers.exercises`).

check_exact_accuracy: the test accuracy of a whole test set that was split with a
DistributedSampler, whose padding repeats a few images: the learner's function runs on real
Gloo ranks with every collective wrapped, and the checker looks at the value each rank returns
and at the collectives each rank called (one all_reduce, SUM, of the counts).
check_steps_per_epoch: the number of training steps per epoch with a DistributedSampler and
drop_last=True, checked in a process of its own (an endless loop, sys.exit or a patch of the
loaders is a verdict); the expected values come from torch's DataLoader there, before fn runs.
Both end with cases drawn when the checker runs (`runner.unseen`): a test set whose right answers are
drawn at random, epochs of random sizes; an answer that looks the public cases up fails them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import runner
from .spies import COLLECTIVES, noting_calls, op_name
from .verdict import Verdict, close

__all__ = ["check_exact_accuracy", "check_steps_per_epoch", "sampler_share"]

# (test images, ranks, shuffle): world sizes that do not divide the set (padding), one that does
_ACCURACY_CASES = [(10, 4, False), (11, 3, True), (9, 2, True), (12, 3, True)]


def _truth(n_images, seed=None):
    """Whether "the model" classified each test image right: about 60% right, fixed by the number of
    images (or by `seed`, for a case drawn at random)."""
    generator = torch.Generator().manual_seed(n_images if seed is None else seed)
    return torch.rand(n_images, generator=generator) < 0.6


def _draw_accuracy_case(rng):
    """(test images, ranks, shuffle, seed): most world sizes do not divide the set, and the accuracy
    differs from the one the public truth of that many images gives."""
    while True:
        n_images, seed = rng.randint(5, 40), rng.randrange(2**40)
        if int(_truth(n_images, seed).sum()) != int(_truth(n_images).sum()):
            return n_images, rng.randint(2, 4), True, seed


def sampler_share(n_images: int, world_size: int, rank: int, shuffle: bool = True, seed: int = 0) -> list[int]:
    """The test-set indices `DistributedSampler` gives `rank` (its default drop_last=False: padded)."""
    from torch.utils.data import DistributedSampler
    return list(DistributedSampler(range(n_images), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                   seed=seed))


def _describe(name, args, kwargs):
    """A collective call as (name, op, numbers): what the checker compares."""
    tensor = args[0] if args else kwargs.get("tensor")
    op = kwargs.get("op", args[1] if len(args) > 1 and name == "all_reduce" else None)
    return (name, op_name(op) if op is not None else "SUM" if name == "all_reduce" else None,
            tensor.numel() if isinstance(tensor, torch.Tensor) else None)


def _accuracy_in_rank(fn, n_images, shuffle, seed=None):
    """Inside a rank: fn(correct, n_images), where `correct` says for each sample of this rank's
    DistributedSampler share (padding included) whether the model got it right. Returns (what fn
    returned: ("number", x) or ("other", repr, type), the collectives it called)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    correct = _truth(n_images, seed)[sampler_share(n_images, world_size, rank, shuffle)]
    with noting_calls(COLLECTIVES, _describe) as calls:
        got = fn(correct.clone(), n_images)
    if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.dtype == torch.bool:
        got = got.item()
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        return ("number", float(got)), calls
    return ("other", repr(got)[:80], type(got).__name__), calls


def _wrong_value_hint(got, n_images, world_size, shuffle, seed=None):
    """What a wrong accuracy most likely came from."""
    truth = _truth(n_images, seed)
    shares = [truth[sampler_share(n_images, world_size, r, shuffle)] for r in range(world_size)]
    real = [share[:len(range(r, n_images, world_size))] for r, share in enumerate(shares)]
    padded = sum(int(s.sum()) for s in shares) / sum(len(s) for s in shares)

    def near(a, b):
        return close(b, a, atol=1e-6)
    if near(got, padded):
        total = sum(len(s) for s in shares)
        return (f"that is the accuracy over the {total} samples of the padded shares: the sampler repeats "
                f"{total - n_images} image(s) to give every rank {len(shares[0])}; count only positions "
                f"rank + j·world_size < n_images")
    for _name, parts in (("padded", shares), ("real", real)):
        if near(got, sum(int(p.sum()) / len(p) for p in parts if len(p)) / world_size):
            return ("that is the mean of the ranks' own accuracies, but the ranks score different numbers of "
                    "images: sum the counts (right, and scored) over the ranks, then divide")
    for r, part in enumerate(real):
        if len(part) and near(got, int(part.sum()) / len(part)):
            return (f"that is rank {r}'s own accuracy: sum the counts over the ranks with dist.all_reduce")
    if near(got, float(truth.sum())) or near(got, float(sum(int(s.sum()) for s in shares))):
        return "that is a count of right answers: divide it by the number of images scored"
    return ""


def _calls_problem(calls, label):
    """What is wrong with one rank's collectives, or None."""
    others = sorted({name for name, _, _ in calls if name != "all_reduce"})
    reduces = [call for call in calls if call[0] == "all_reduce"]
    if "reduce" in others:
        return (f"{label}: dist.reduce leaves the sum on one rank only, and every rank needs the accuracy: "
                f"dist.all_reduce")
    if others:
        return (f"{label}: you called dist.{', dist.'.join(others)}: one all_reduce of two numbers (right, "
                f"scored) is all it takes; gathering sends every rank's data to every rank")
    if not reduces:
        return (f"{label}: no collective was called, yet each rank holds only its own share: sum the counts "
                f"over the ranks with dist.all_reduce")
    if len(reduces) > 1:
        return (f"{label}: {len(reduces)} all_reduce calls: put both counts in one tensor and all-reduce it "
                f"once; every call pays the fixed cost α (notebook 04)")
    _, op, numbers = reduces[0]
    if op != "SUM":
        return f"{label}: all_reduce with op={op}: counts add up: use dist.ReduceOp.SUM (the default)"
    return None


def check_exact_accuracy(fn: Callable[[torch.Tensor, int], float]) -> Verdict:
    """Notebook 06: `fn(correct, n_images)`, run on every rank, returns the accuracy over the whole
    test set of `n_images` images, the same on every rank, where `correct` (bool, one per sample)
    says which samples of this rank's `DistributedSampler` share the model got right. The share is
    padded: samples at positions rank + j·world_size >= n_images repeat the first images.

    Runs fn on 2, 3 and 4 Gloo ranks, test sets the world size does not divide (and one it does),
    with every collective wrapped: each rank must return the exact accuracy (the padding not counted,
    counts summed, not accuracies averaged), after exactly one dist.all_reduce (SUM) and no other
    collective. Reference solution: ddp_helpers/solutions.py, exact_accuracy."""
    title = "exact_accuracy"
    if not callable(fn):
        return runner.not_a_function(title, fn, "exact_accuracy(correct, n_images)")
    cases = [case + (None,) for case in _ACCURACY_CASES]
    unseen = runner.unseen(_draw_accuracy_case)
    wants = {case: int(_truth(case[0], case[3]).sum()) / case[0] for case in cases + unseen}
    check = runner.Checker(title, who=runner.name_of(fn, "fn"), stop_after_error=True)
    problems = check.problems
    for n_images, world_size, shuffle, seed in check.each(
            cases, unseen, lambda case: (_accuracy_in_rank, case[1], (fn, case[0], *case[2:]))):
        label = check.label(f"{n_images} test images on {world_size} ranks")
        want = wants[n_images, world_size, shuffle, seed]
        runs = check.run(
            *check.planned, label,
            never_finished="they wait in a collective another rank never calls: every rank must make the "
                           "same calls (is a collective inside `if dist.get_rank() == 0`?)",
            partner_left=": its partner had left. Does every rank call the same collectives?")
        if runs is None:
            continue   # (the walk stops: one case says what is wrong, the others would say it again)
        sequences = [[name for name, _, _ in calls] for _, calls in runs]
        odd = next((r for r, seq in enumerate(sequences) if seq != sequences[0]), None)
        if odd is not None:
            problems.append(f"{label}: rank 0 called {sequences[0] or 'no collective'}, rank {odd} called "
                            f"{sequences[odd] or 'no collective'}: every rank must call the same collectives "
                            f"(a mismatch hangs, or mixes up data)")
            break
        calls_problem = _calls_problem(runs[0][1], label)
        for rank, ((kind, *value), _) in enumerate(runs):
            if kind != "number":
                problems.append(f"{label}, rank {rank}: expected the accuracy as a number (a float), got "
                                f"{value[0]} ({value[1]})")
                break
            if not close(want, value[0], atol=1e-6):   # float32 arithmetic is fine
                hint = "" if calls_problem else _wrong_value_hint(value[0], n_images, world_size, shuffle, seed)
                problems.append(f"{label}, rank {rank}: expected accuracy {want:.6g}, got {value[0]:.6g}"
                                + (f": {hint}" if hint else ""))
                break
        if calls_problem:
            problems.insert(0, calls_problem)
        if problems:
            break   # one case says what is wrong; the others would say it again
    return check.verdict()


_STEP_CASES = [(10_000, 128, 1), (10_000, 128, 2), (998, 111, 3), (50_000, 256, 8), (1_000, 64, 7),
               (1_000, 64, 2), (11, 3, 4)]   # 500/64 = 7.8: rounding is not the rule; 11 on 4 ranks: padding


STEPS_TIMEOUT_S = 20   # the learner's steps_per_epoch is arithmetic: this is an endless loop


def _draw_step_case(rng):
    """(images, batch per rank, ranks): at least one step per epoch."""
    world_size, batch = rng.randint(1, 8), rng.randint(8, 256)
    return rng.randint(world_size * batch, 60_000), batch, world_size


def _steps_in_rank(fn, cases):
    """Inside a rank, a fresh process that nothing the notebook patched reaches: first the expected
    steps per epoch of every case, from torch's DataLoader over a DistributedSampler as notebook 06
    builds them (drop_last=True), before any learner code runs; then fn for each case. Returns
    [(want, what fn did)]: ("int", steps), ("other", repr, type name) or ("raised", type, message),
    or None when fn is still the stub."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    wants = []
    for n, batch, world_size in cases:
        images = TensorDataset(torch.zeros(n, 1, dtype=torch.uint8))
        sampler = DistributedSampler(images, num_replicas=world_size, rank=0, shuffle=True, seed=0)
        wants.append(len(DataLoader(images, batch, sampler=sampler, drop_last=True)))
    found = []
    for (n, batch, world_size), want in zip(cases, wants):
        try:
            got = fn(n, batch, world_size)
        except NotImplementedError:
            return None
        except (Exception, SystemExit) as exc:
            found.append((want, ("raised", type(exc).__name__, str(exc)[:200])))
            continue
        if isinstance(got, int) and not isinstance(got, bool):
            found.append((want, ("int", int(got))))
        else:
            found.append((want, ("other", repr(got)[:100], type(got).__name__)))
    return found


def check_steps_per_epoch(fn: Callable[[int, int, int], int]) -> Verdict:
    """Notebook 06: `fn(n_images, batch_per_rank, world_size)` is the number of training steps
    per epoch each rank takes with DistributedSampler and DataLoader(..., drop_last=True).

    fn runs in a rank of its own (one `launch`, at most STEPS_TIMEOUT_S): an endless loop, sys.exit
    or a crash is a verdict, and what fn patches stays there. The expected values come from torch's
    DataLoader and DistributedSampler, in that rank, before fn runs."""
    title = "steps_per_epoch"
    name = runner.name_of(fn)
    if not callable(fn):
        return runner.not_a_function(title, fn, "steps_per_epoch(n_images, batch_per_rank, world_size)")
    unseen = runner.unseen(_draw_step_case, 2)
    outcome = runner.run_case(_steps_in_rank, 1, (fn, _STEP_CASES + unseen), "", timeout=STEPS_TIMEOUT_S,
                              init=False)
    if outcome.kind == "timeout":
        return Verdict(title, [f"{name} did not return within {STEPS_TIMEOUT_S:g} s (an endless loop?)"])
    if outcome.kind == "unsendable":
        return Verdict(title, [f"could not run {name}: {outcome.problem.split(': ', 1)[1]}"])
    if not outcome.ok:   # (its stub is caught in the rank)
        return Verdict(title, [f"{name} ended its process: {outcome.problem.lstrip(': ')}"])
    found = outcome.results[0]
    if found is None:
        return runner.stub_verdict(title, fn)
    problems = []
    for i, ((n, batch, world_size), (want, (kind, *what))) in enumerate(zip(_STEP_CASES + unseen, found)):
        drawn = i >= len(_STEP_CASES)
        if drawn and problems:
            break   # the cases drawn now are for answers that pass the public ones
        label = f"{n} images, {batch} per rank, {world_size} ranks" + (runner.DRAWN if drawn else "")
        if kind == "raised":
            exc_type, message = what
            exit_hint = ": return the number instead of ending the program" if exc_type == "SystemExit" else ""
            problems.append(f"{label}: {name} raised {exc_type}: {message}{exit_hint}")
        elif kind == "other":
            shown, type_name = what
            problems.append(f"{label}: expected a whole number of steps (an int), got {shown} "
                            f"({type_name}): use // for whole divisions")
        elif what[0] != want:
            got = what[0]
            per_rank = -(-n // world_size)
            hint = ("; each rank gets ceil(n / world_size) = "
                    f"{per_rank} images (DistributedSampler pads), and the last incomplete batch is dropped"
                    if got in (round(n / world_size / batch), n // world_size // batch, -(-per_rank // batch)) else "")
            problems.append(f"{label}: expected {want} steps, got {got!r}{hint}")
    return Verdict(title, problems)
