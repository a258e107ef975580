"""Checkers for the notebooks' "Try it" exercises.

Each checker runs the learner's function on real ranks, for several world
sizes, and says exactly what is wrong (which world size, which rank, expected
vs got). The returned Verdict is true when every case passes.
Reference solutions are in `ddp_helpers.solutions`.
"""
from .launcher import WorkerError, WorkerTimeout, launch


class Verdict:
    """What a checker found. True when correct; shown as a short report in the notebook."""

    def __init__(self, title, problems):
        self.title, self.problems = title, problems

    def __bool__(self):
        return not self.problems

    def __repr__(self):
        if not self.problems:
            return f"✅ {self.title}: correct."
        lines = [f"❌ {self.title}: not yet."] + [f"   - {p}" for p in self.problems[:5]]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


def _report(title, problems):
    return Verdict(title, problems)


def _run_cases(fn, world_sizes, expected_for, args_for=lambda ws: (), hint=""):
    """Run fn on each world size; compare rank r's result with expected_for(ws, r)."""
    problems = []
    for ws in world_sizes:
        try:
            got = launch(fn, ws, args=args_for(ws), timeout=15, quiet=True)
        except WorkerTimeout as err:
            problems.append(f"world_size={ws}: rank(s) {err.unfinished_ranks} never finished. {hint}")
            continue
        except WorkerError as err:
            if err.exc_type == "NotImplementedError":
                return [f"{fn.__name__} still raises NotImplementedError: fill in the stub"]
            first_line = str(err).splitlines()[0]
            problems.append(f"world_size={ws}: {first_line[:300]} {hint}")
            continue
        for rank, value in enumerate(got):
            want = expected_for(ws, rank)
            if value != want:
                problems.append(f"world_size={ws}, rank {rank}: expected {want!r}, got {value!r}")
    return problems


def check_parity_group_sum(fn):
    """Notebook 01: each rank returns the sum of the ranks with its own parity,
    computed with an all_reduce inside a `new_group` of even or odd ranks."""
    def expected(ws, rank):
        return sum(r for r in range(ws) if r % 2 == rank % 2)
    hint = "Every rank must call dist.new_group for every group, in the same order, even groups it is not in."
    return _report("parity_group_sum", _run_cases(fn, [2, 3, 4], expected, hint=hint))


def check_rank_squares(fn):
    """Notebook 00: each rank returns its rank squared."""
    return _report("my_square", _run_cases(fn, [2, 4], lambda ws, rank: rank * rank))
