"""What a checker says, and the one test of "equal" and "close" every checker uses.

`Verdict` is what every `check_*` returns: true when correct, shown in the notebook as a short
report. `difference(expected, got)` is the single comparison of an expected value with what a
learner's code returned (numbers, tensors, lists of them; exact, or within a tolerance): None
when they agree, else one short sentence naming the first thing that differs (type, length,
shape, dtype, or the element with its index). `close` and `near` are its yes/no forms.

It compares exact types only: `==` between Python's own numbers and strings, element by element
between plain `torch.Tensor`s. What a rank sent that is not plain data (`plain.Foreign`), or a
value of any other type, differs from everything, whatever its own `==` or `!=` would say.
"""
from __future__ import annotations

import math
import textwrap
from typing import Any

import torch

from .plain import Foreign


class Verdict:
    """What a checker found. True when correct; shown as a short report in the notebook."""

    def __init__(self, title: str, problems: list[str], notes=()):
        self.title, self.problems, self.notes = title, problems, list(notes)

    def __bool__(self) -> bool:
        return not self.problems

    def __repr__(self) -> str:
        if not self.problems:
            lines = [f"✅ {self.title}: correct."]
        else:
            lines = [f"❌ {self.title}: not yet."] + [f"   - {p}" for p in self.problems[:5]]
        return "\n".join(lines + [f"   {note}" for note in self.notes])

    def _repr_pretty_(self, printer, cycle):
        """In a notebook: lines wrapped at 100 characters, between words (JupyterLab would cut words)."""
        lines = []
        for line in repr(self).splitlines():
            indent = " " * (len(line) - len(line.lstrip(" -")))
            lines += textwrap.wrap(line, 100, subsequent_indent=indent, break_on_hyphens=False) or [""]
        printer.text("\n".join(lines))


def _index(i: int, shape) -> Any:
    """Element i of a flattened tensor of `shape`: a plain number in 1-D, else a tuple."""
    if len(shape) <= 1:
        return i
    return tuple(int(k) for k in torch.unravel_index(torch.tensor(i), tuple(shape)))


def _is_number(x) -> bool:
    return type(x) in (int, float)


def _plain_types(x) -> bool:
    return type(x) in (int, float, bool, str, bytes, type(None))


def _what(got) -> str:
    """What a value is, for "expected ..., got <what>": a type's name, or 'an X object' for what a
    rank sent that is not plain data."""
    return got.describe() if isinstance(got, Foreign) else type(got).__name__


def difference(expected, got, *, rtol: float = 0.0, atol: float = 0.0, dtype: bool = False,
               zero: str = "") -> str | None:
    """None when `got` equals `expected` (within atol + rtol·|expected| for tensors, as torch.allclose;
    within atol + rtol·max(|a|, |b|) for numbers, as math.isclose), else what differs first.

    Lists and tuples are compared item by item ("item 1: ..."); tensors by type, shape, dtype (when
    `dtype`), then element ("element (2, 0): expected 5, got 0"). `zero`, if given, names what an
    expected 0 is (e.g. "padding")."""
    if isinstance(expected, (list, tuple)):
        if type(got) not in (list, tuple) or len(got) != len(expected):
            return f"expected a list of {len(expected)} tensors, got {_what(got)}" + (
                f" of length {len(got)}" if type(got) in (list, tuple) else "")
        for i, (e, g) in enumerate(zip(expected, got)):
            problem = difference(e, g, rtol=rtol, atol=atol, dtype=dtype, zero=zero)
            if problem:
                return f"item {i}: {problem}"
        return None
    if isinstance(expected, torch.Tensor):
        if type(got) is not torch.Tensor:
            return f"expected a tensor, got {_what(got)}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if dtype and got.dtype != expected.dtype:
            return f"expected dtype {expected.dtype}, got {got.dtype}"
        want, have = expected.detach().flatten(), got.detach().flatten()
        if not (rtol or atol) and want.dtype == have.dtype and torch.equal(want, have):
            return None
        if rtol or atol:
            want, have = want.double(), have.double()
            wrong = ~((have - want).abs() <= atol + rtol * want.abs())
        else:
            wrong = have != want
        wrong = wrong.nonzero()
        if len(wrong):
            i = int(wrong[0])
            w, g = want[i].item(), have[i].item()
            note = f" ({zero})" if zero and w == 0 else ""
            return f"element {_index(i, expected.shape)}: expected {w:g}{note}, got {g:g}"
        return None
    if _is_number(expected) and _is_number(got):
        if math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) if (rtol or atol) else got == expected:
            return None
        return f"expected {expected:g}, got {got:g}" if (rtol or atol) else f"expected {expected!r}, got {got!r}"
    if isinstance(got, Foreign):
        return f"expected {expected!r}, got {got.describe()}"
    if _plain_types(expected) and type(got) is type(expected) and got == expected:
        return None
    return f"expected {expected!r}, got {got!r}"


def close(expected, got, *, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Whether `got` agrees with `expected` (see `difference`)."""
    return difference(expected, got, rtol=rtol, atol=atol) is None


def near(a: float, b: float, rel: float = 1e-6) -> bool:
    """Two numbers within `rel` of the larger of them (a number-only `close`)."""
    return close(a, b, rtol=rel)
