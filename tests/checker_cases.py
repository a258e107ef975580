"""`decisive(*cases)`: a checker meets a wrong answer with only the case(s) that show it wrong.

Every case of a checker costs ranks (the cases of one world size share a launch). The reference
answer meets every case, in each checker's own test; a wrong answer needs only the case whose
verdict the test asserts, so a test says which it is:

    with decisive((3, 4)):      # world_size=3, length=4
        verdict = exercises.check_tree_broadcast(only_first_hop)

A case is named by its first items, as the checker lists it (`(2,)` for world_size=2); the cases
drawn at random are left out. A name that matches no case is an error, so a test cannot go quiet
when a checker's cases change.
"""
import contextlib
from unittest import mock

from ddp_helpers.exercises import runner


def _named(case, name) -> bool:
    if not isinstance(name, tuple):
        return case == name
    return case == name or (isinstance(case, tuple) and case[:len(name)] == name)


@contextlib.contextmanager
def decisive(*names):
    """While the block runs, checkers walk only their public cases that `names` name."""
    each = runner.Checker.each

    def only(self, cases, unseen=(), plan=None):
        cases = list(cases)
        kept = [case for case in cases if any(_named(case, name) for name in names)]
        missing = [name for name in names if not any(_named(case, name) for case in cases)]
        assert not missing, f"no case {missing} among the checker's {cases}"
        return each(self, kept, (), plan)

    with mock.patch.object(runner.Checker, "each", only):
        yield
