"""Checkers for notebook 06's exercises (re-exported by `ddp_helpers.exercises`).

check_exact_accuracy: the test accuracy of a whole test set that was split with a
DistributedSampler, whose padding repeats a few images: the learner's function runs on real
Gloo ranks with every collective wrapped, and the checker looks at the value each rank returns
and at the collectives each rank called (one all_reduce, SUM, of the counts).
(check_steps_per_epoch, the notebook's earlier exercise, stays in `ddp_helpers.exercises`.)
"""
import torch
import torch.distributed as dist

from . import _COLLECTIVES, _STILL_A_STUB, HANG_TIMEOUT_S, Verdict, _launch_case, _noting_calls, _op_name

__all__ = ["check_exact_accuracy", "sampler_share"]

# (test images, ranks, shuffle): world sizes that do not divide the set (padding), one that does
_ACCURACY_CASES = [(10, 4, False), (11, 3, True), (9, 2, True), (12, 3, True)]


def _truth(n_images):
    """Whether "the model" classified each test image right: fixed, about 60% right."""
    return torch.rand(n_images, generator=torch.Generator().manual_seed(n_images)) < 0.6


def sampler_share(n_images, world_size, rank, shuffle=True, seed=0):
    """The test-set indices `DistributedSampler` gives `rank` (its default drop_last=False: padded)."""
    from torch.utils.data import DistributedSampler
    return list(DistributedSampler(range(n_images), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                   seed=seed))


def _describe(name, args, kwargs):
    """A collective call as (name, op, numbers): what the checker compares."""
    tensor = args[0] if args else kwargs.get("tensor")
    op = kwargs.get("op", args[1] if len(args) > 1 and name == "all_reduce" else None)
    return (name, _op_name(op) if op is not None else "SUM" if name == "all_reduce" else None,
            tensor.numel() if isinstance(tensor, torch.Tensor) else None)


def _accuracy_in_rank(fn, n_images, shuffle):
    """Inside a rank: fn(correct, n_images), where `correct` says for each sample of this rank's
    DistributedSampler share (padding included) whether the model got it right. Returns (what fn
    returned: ("number", x) or ("other", repr, type), the collectives it called)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    correct = _truth(n_images)[sampler_share(n_images, world_size, rank, shuffle)]
    with _noting_calls(_COLLECTIVES, _describe) as calls:
        got = fn(correct.clone(), n_images)
    if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.dtype == torch.bool:
        got = got.item()
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        return ("number", float(got)), calls
    return ("other", repr(got)[:80], type(got).__name__), calls


def _wrong_value_hint(got, n_images, world_size, shuffle):
    """What a wrong accuracy most likely came from."""
    truth = _truth(n_images)
    shares = [_truth(n_images)[sampler_share(n_images, world_size, r, shuffle)] for r in range(world_size)]
    real = [share[:len(range(r, n_images, world_size))] for r, share in enumerate(shares)]
    padded = sum(int(s.sum()) for s in shares) / sum(len(s) for s in shares)
    near = lambda a, b: abs(a - b) < 1e-6
    if near(got, padded):
        total = sum(len(s) for s in shares)
        return (f"that is the accuracy over the {total} samples of the padded shares: the sampler repeats "
                f"{total - n_images} image(s) to give every rank {len(shares[0])}; count only positions "
                f"rank + j·world_size < n_images")
    for name, parts in (("padded", shares), ("real", real)):
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


def check_exact_accuracy(fn):
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
        return Verdict(title, [f"expected a function exact_accuracy(correct, n_images), got {type(fn).__name__}"])
    problems = []
    for n_images, world_size, shuffle in _ACCURACY_CASES:
        label = f"{n_images} test images on {world_size} ranks"
        want = int(_truth(n_images).sum()) / n_images
        runs, problem, _ = _launch_case(
            _accuracy_in_rank, world_size, (fn, n_images, shuffle), label, timeout=HANG_TIMEOUT_S,
            never_finished="they wait in a collective another rank never calls: every rank must make the "
                           "same calls (is a collective inside `if dist.get_rank() == 0`?)",
            partner_left=": its partner had left. Does every rank call the same collectives?")
        if problem is _STILL_A_STUB:
            return Verdict(title, [f"{getattr(fn, '__name__', 'fn')} still raises NotImplementedError: "
                                   f"fill in the stub"])
        if problem:
            problems.append(problem)
            break   # one case says what is wrong; the others would say it again
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
            if abs(value[0] - want) > 1e-6:   # float32 arithmetic is fine
                hint = "" if calls_problem else _wrong_value_hint(value[0], n_images, world_size, shuffle)
                problems.append(f"{label}, rank {rank}: expected accuracy {want:.6g}, got {value[0]:.6g}"
                                + (f": {hint}" if hint else ""))
                break
        if calls_problem:
            problems.insert(0, calls_problem)
        if problems:
            break   # one case says what is wrong; the others would say it again
    return Verdict(title, problems)
