"""The one case runner: a checker's code on real ranks, and what went wrong there, in words.

`run_case` launches `in_rank(*args)` on `world_size` Gloo ranks and turns every way that can fail
into one line for the verdict: ranks that never finished (a hang: `never_finished` says what the
learner most likely did), a rank that raised or died (with `partner_left` where Gloo says its peer
went away, `size_mismatch` where Gloo said a rank received more data than it expected, and
`on_error` always), the learner's function still being the stub, a function that cannot be sent to a
rank. Every checker's cases go through it.

What the ranks send back is plain data (`plain`): the rank's result is described with builtin types
inside the rank, an error as plain text, and the launcher reads what the ranks wrote refusing any
class or function reference in it. So no object of the learner's is ever unpickled in the kernel,
and the checker compares exact types (`verdict.difference`).

A checker's public cases may be looked up by an answer; `unseen` draws more at check time, from the
operating system's entropy, and `Checker.each` runs them after the public ones have passed.

A launch costs far more than a case: given a `plan` (what each case launches), `Checker.each` runs the
cases of one world size in one launch (`run_cases`), one after another in the same ranks. Where that
launch goes wrong in any way (a rank raised, hung, died, or sent something not plain), its cases run
again one launch each, so what the verdict says is what one launch per case says.
"""
from __future__ import annotations

import contextlib
import pickle
import random
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from unittest import mock

from .. import launcher
from ..launcher import WorkerError, WorkerTimeout, launch
from ..runtime.run_dirs import rank_file
from . import plain
from .verdict import Verdict

HANG_TIMEOUT_S = 10   # a learner's ranks that have not finished by then are stuck (a send without its recv)
DRAWN = " (a case drawn at random now)"   # said after the label of an unseen case
# Gloo's words when a rank receives more bytes than it posted room for (sizes that differ between
# the ranks of one collective): it aborts that rank's process, so they are found in its log.
GLOO_SIZE_MISMATCH = "Received data size doesn't match expected size"
SIZE_MISMATCH = ("the ranks gave one collective sizes that do not match (in an all-to-all, rank i's "
                 "output_split_sizes[j] must equal rank j's input_split_sizes[i])")
LOG_TAIL_BYTES = 16384
NOT_PLAIN = ("the ranks sent something other than plain data ({}): the checker reads numbers, strings and "
             "tensors, and lists, tuples and dicts of them")


@dataclass
class Outcome:
    """What one case gave: `results` by rank, or `problem` (one line) with `kind` saying which:
    "timeout" (the ranks hung), "error" (a rank raised or died), "stub" (NotImplementedError),
    "unsendable" (the function could not be sent to a rank)."""
    results: list | None = None
    problem: str | None = None
    kind: str = "ok"
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0].split(". This is typically")[0][:300] if str(err) else type(err).__name__


def _gloo_said(err: WorkerError, world_size: int, words: str) -> bool:
    """Whether Gloo's `words` are in the error or near the end of a rank's log (a rank Gloo aborted
    wrote them there; its error says only which signal killed it)."""
    if words in str(err):
        return True
    for rank in range(world_size if err.log_dir else 0):
        try:
            with open(rank_file(err.log_dir, rank, "log"), "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                if words in f.read().decode("utf-8", "replace"):
                    return True
        except OSError:
            continue
    return False


def _plain_in_rank(in_rank: Callable, args: tuple):
    """Inside a rank: in_rank(*args), its result described with builtin types before it leaves the
    rank (plain.to_plain), an error it raises as plain text (plain.plain_error)."""
    try:
        result = in_rank(*args)
    except BaseException as exc:   # NotImplementedError (the stub) keeps its name
        raise plain.plain_error(exc) from None
    return plain.to_plain(result)


class _PlainPickle:
    """`pickle` as the launcher sees it while a checker's ranks run: what they wrote (results, error
    records) is read with plain.load, which refuses any class or function reference instead of
    running it, even where the learner's code changed how its rank pickles."""
    load = staticmethod(plain.load)
    loads = staticmethod(plain.loads)

    def __getattr__(self, name):
        return getattr(pickle, name)


@contextlib.contextmanager
def _reading_plain_data_only() -> Iterator[None]:
    with mock.patch.object(launcher, "pickle", _PlainPickle()):
        yield


def run_case(in_rank: Callable, world_size: int, args: tuple, label: str, *, timeout: float | None = None,
             never_finished: str = "", partner_left: str = "", size_mismatch: str = "", on_error: str = "",
             init: bool = True) -> Outcome:
    """`in_rank(*args)` on `world_size` Gloo ranks, at most `timeout` seconds (HANG_TIMEOUT_S by default).
    The results are plain data: exact builtin types and exact tensors, or `plain.Foreign`. Where Gloo
    said a rank received more data than it expected, the line says so, then `size_mismatch` (or
    SIZE_MISMATCH)."""
    return _run(_plain_in_rank, plain.from_plain, in_rank, world_size, tuple(args), label, timeout=timeout,
                never_finished=never_finished, partner_left=partner_left, size_mismatch=size_mismatch,
                on_error=on_error, init=init)


def _run(target: Callable, read: Callable, in_rank: Callable, world_size: int, args, label: str, *,
         timeout: float | None, never_finished: str = "", partner_left: str = "", size_mismatch: str = "",
         on_error: str = "", init: bool = True) -> Outcome:
    """run_case's work: `target(in_rank, args)` in the ranks, `read` of what each rank sent."""
    try:
        with _reading_plain_data_only():
            sent = launch(target, world_size, args=(in_rank, args),
                          timeout=HANG_TIMEOUT_S if timeout is None else timeout, init=init, quiet=True)
        results = [read(value) for value in sent]
    except plain.NotPlain as err:
        return Outcome(problem=f"{label}: {NOT_PLAIN.format(err)}".lstrip(": "), kind="error", error=err)
    except WorkerTimeout as err:
        return Outcome(problem=f"{label}: rank(s) {err.unfinished_ranks} never finished: {never_finished}".rstrip(": "),
                       kind="timeout", error=err)
    except WorkerError as err:
        if err.exc_type == "NotImplementedError":
            return Outcome(problem="still raises NotImplementedError", kind="stub", error=err)
        line = _first_line(err)
        hint = partner_left if "gloo" in line.lower() or "closed" in line.lower() else ""
        if _gloo_said(err, world_size, GLOO_SIZE_MISMATCH):
            head, _, logs = line.partition(". Full logs: ")
            line = f'{head} (Gloo: "{GLOO_SIZE_MISMATCH}"): {size_mismatch or SIZE_MISMATCH}' + \
                (f". Full logs: {logs}" if logs else "")
            hint = ""
        return Outcome(problem=f"{label}: {line}{hint}" + (f" {on_error}" if on_error else ""), kind="error",
                       error=err)
    except Exception as err:   # the function could not be sent to a rank (pickling)
        return Outcome(problem=f"could not run it on the ranks: {str(err)[:300] or type(err).__name__}",
                       kind="unsendable", error=err)
    return Outcome(results=results)


def _cases_in_rank(in_rank: Callable, args_list: list) -> list:
    """Inside a rank: in_rank(*args) for each case's args, one after another, each result described
    with builtin types (plain.to_plain); the first error ends the launch (as plain text)."""
    return [_plain_in_rank(in_rank, tuple(args)) for args in args_list]


def _read_cases(count: int) -> Callable:
    def read(sent):
        if type(sent) is not list or len(sent) != count:
            raise plain.NotPlain(f"{plain.type_name(sent)} where one result per case was expected")
        return [plain.from_plain(value) for value in sent]
    return read


def run_cases(in_rank: Callable, world_size: int, args_list: list, *, timeout: float | None = None,
              init: bool = True) -> list[list] | Outcome:
    """`in_rank(*args)` for every args of `args_list`, in order, in one launch of `world_size` Gloo ranks:
    each case's results by rank, or the Outcome that says what went wrong, with no label (which case it
    was is found by running the cases alone: see Checker.run). `timeout` is one case's (HANG_TIMEOUT_S by
    default); the launch may take a quarter of it more for each further case."""
    one = HANG_TIMEOUT_S if timeout is None else timeout
    outcome = _run(_cases_in_rank, _read_cases(len(args_list)), in_rank, world_size, list(args_list), "",
                   timeout=one * (1 + (len(args_list) - 1) / 4), init=init)
    if not outcome.ok:
        return outcome
    return [[by_rank[i] for by_rank in outcome.results] for i in range(len(args_list))]


class Checker:
    """One checker's walk through its cases: `for case in check.each(cases)`, `results =
    check.run(...)` (None when the case went wrong: its problem is noted), then `check.verdict()`.
    The walk stops after a hang (the other cases would hang the same way), after a function that cannot
    be sent to the ranks (nor could it for the next case), after any failed case
    with `stop_after_error`, or when the learner's function is still the stub (the verdict says so).

    With `check.each(cases, unseen, plan=...)`, plan(case) gives what the case launches, (in_rank,
    world_size, args); the loop runs it with `check.run(*check.planned, label, **how)`. The first such
    run launches every case still to come of that in_rank and world size at once (`run_cases`, unseen
    ones too). A case's results come from ranks where every earlier case passed: after a case that
    went wrong, the later ones are launched again; where a launch went wrong (a rank raised, hung, died,
    sent something not plain), each of its cases runs alone, as without a plan."""

    def __init__(self, title: str, fn=None, who: str | None = None, stub: str | None = None,
                 stop_after_error: bool = False):
        self.title, self.problems, self.notes = title, [], []
        self._stub_message = stub or f"{who or name_of(fn)} still raises NotImplementedError: fill in the stub"
        self._stub = self._stopped = False
        self._stop_after_error = stop_after_error
        self.drawn = False   # True while the unseen cases run
        self._plan: list[tuple] = []
        self._at = -1                       # the position of the case the walk is at, in the plan
        self._ran: dict[int, tuple] = {}    # a position's (launch, results) from a launch of several cases
        self._alone: set[int] = set()       # positions whose launch of several cases went wrong
        self._launches = 0                  # launches of several cases so far
        self._handed: dict[int, int] = {}   # a launch: the problems noted when its last results were handed out

    def each(self, cases: Iterable, unseen: Iterable = (), plan: Callable | None = None) -> Iterator:
        """The public cases, then, only when every one of them passed, the `unseen` ones (drawn at
        check time: see `unseen`), with `drawn` True."""
        cases, unseen = list(cases), list(unseen)
        self._plan = [plan(case) for case in cases + unseen] if plan else []
        for self._at, case in enumerate(cases):
            if self._stub or self._stopped:
                return
            yield case
        self.drawn = True
        for self._at, case in enumerate(unseen, len(cases)):
            if self._stub or self._stopped or self.problems:
                return
            yield case

    @property
    def planned(self) -> tuple:
        """What the current case launches: (in_rank, world_size, args), from each's plan."""
        return self._plan[self._at]

    def label(self, text: str) -> str:
        """A case's label, which says so when the case was drawn at random now."""
        return text + DRAWN if self.drawn else text

    def stop(self) -> None:
        """No more cases (one case said what is wrong; the others would say it again)."""
        self._stopped = True

    def run(self, in_rank: Callable, world_size: int, args: tuple, label: str, **how) -> list | None:
        """run_case(in_rank, world_size, args, label, **how): the results by rank, or None."""
        if self._plan and 0 <= self._at < len(self._plan) and self._plan[self._at][2] is args \
                and self._at not in self._alone:
            launch_id = self._ran.get(self._at, (None,))[0]
            if launch_id is not None and len(self.problems) > self._handed.get(launch_id, len(self.problems)):
                # a case of that launch went wrong: the cases after it in the same ranks may have
                # been thrown off by it, so they run again, in ranks of their own
                self._ran = {at: ran for at, ran in self._ran.items() if ran[0] != launch_id}
            if self._at not in self._ran:
                self._run_together(how.get("timeout"), how.get("init", True))
            if self._at in self._ran:
                launch_id, results = self._ran.pop(self._at)
                self._handed[launch_id] = len(self.problems)
                return results
            if self._stub:
                return None
        outcome = run_case(in_rank, world_size, args, label, **how)
        if outcome.kind == "stub":
            self._stub = True
            return None
        if not outcome.ok:
            self.problems.append(outcome.problem)
            self._stopped = outcome.kind in ("timeout", "unsendable") or self._stop_after_error
            return None
        return outcome.results

    def _run_together(self, timeout: float | None, init: bool) -> None:
        """The current case and every later one with its in_rank and world size, in one launch."""
        in_rank, world_size, _ = self._plan[self._at]
        together = [i for i in range(self._at, len(self._plan))
                    if self._plan[i][0] is in_rank and self._plan[i][1] == world_size and i not in self._alone]
        if len(together) == 1:   # one case: its own launch, as without a plan
            self._alone.add(self._at)
            return
        got = run_cases(in_rank, world_size, [self._plan[i][2] for i in together], timeout=timeout, init=init)
        if isinstance(got, Outcome):
            if got.kind == "stub":
                self._stub = True
            self._alone.update(together)
            return
        self._launches += 1
        self._ran.update((at, (self._launches, results)) for at, results in zip(together, got))

    def still_a_stub(self) -> None:
        """The learner's function raised NotImplementedError inside the checker's own code."""
        self._stub = True

    def verdict(self) -> Verdict:
        if self._stub:
            return Verdict(self.title, [self._stub_message])
        return Verdict(self.title, self.problems, self.notes)


def unseen(draw: Callable[[random.Random], object], count: int = 1) -> list:
    """`count` cases made by `draw(rng)` now, at check time, with a generator seeded from the operating
    system's entropy: no answer can have looked them up (the public cases it can)."""
    rng = random.Random(secrets.randbits(64))
    return [draw(rng) for _ in range(count)]


def name_of(fn, default: str = "the function") -> str:
    return getattr(fn, "__name__", default)


def stub_verdict(title: str, fn=None, who: str | None = None) -> Verdict:
    """The verdict for a learner's function that is still the stub."""
    who = who or name_of(fn)
    return Verdict(title, [f"{who} still raises NotImplementedError: fill in the stub"])


def not_a_function(title: str, fn, signature: str) -> Verdict | None:
    """A verdict when `fn` is not callable (None when it is)."""
    if callable(fn):
        return None
    return Verdict(title, [f"expected a function {signature}, got {type(fn).__name__}"])
