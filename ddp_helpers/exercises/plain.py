"""What travels from a rank to the kernel during a check: plain data, nothing that can run code.

A checker's code in a rank, and the learner's function it calls there, may return anything. The
kernel reads only numbers, strings, tensors, and lists, tuples and dicts of them:

- `to_plain(value)`, inside the rank, describes a value with Python's builtin types only: a tensor
  by its dtype, shape and bytes (a tensor subclass read as the plain tensor it holds, whatever its
  methods say), a number or string subclass by its value. Anything else (an object of the learner's
  class, a set, a tensor that has no plain data) travels as its type's name and its repr.
- `loads(data)`, in the kernel, unpickles what a rank wrote refusing every class or function
  reference in it (`NotPlain`): however the rank's pickling was changed, nothing runs.
- `from_plain(description)`, in the kernel, builds the value again with exact types
  (`type(x) is torch.Tensor`, `int`, `float`, ...); what was not plain comes back as a `Foreign`,
  equal to nothing.

So an answer whose `__eq__` says yes, a tensor subclass whose `!=` says no, or an object whose
`__reduce__` would run code when unpickled, is judged by its data or named, and runs nothing here.
`plain_error(exc)`, inside the rank, does the same for an exception: its type's name, message and
traceback as plain text (a message that is a str subclass could run code when unpickled).
"""
from __future__ import annotations

import io
import pickle

import torch

__all__ = ["Foreign", "NotPlain", "to_plain", "from_plain", "loads", "plain_error", "type_name"]

MAX_DEPTH = 32            # lists in lists ... deeper than this (or a list that contains itself) are not plain
MAX_ITEMS = 1_000_000     # items in one value, all levels together
_SCALARS = (type(None), bool, int, float, str, bytes)
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class NotPlain(ValueError):
    """What a rank sent is not a description `to_plain` makes (a class or function reference in the
    pickle, or a shape of data it never writes)."""


class Foreign:
    """A value a rank returned that is not plain data: its type's name and its repr (at most 80
    characters), made in the rank. Equal to nothing but itself."""

    def __init__(self, type_name: str, text: str, why: str = ""):
        self.type_name, self.text, self.why = type_name, text, why

    def __repr__(self) -> str:
        return self.text

    def describe(self) -> str:
        """'a Liar object (<...>)': for a verdict's line."""
        article = "an" if self.type_name[:1].lower() in "aeiou" else "a"
        return f"{article} {self.type_name} object" + (f" ({self.why})" if self.why else "")


def type_name(value) -> str:
    """The name of a value's type, as a verdict says it (a Foreign's: the type it had in the rank)."""
    return value.type_name if isinstance(value, Foreign) else type(value).__name__


# ---- inside the rank ----------------------------------------------------------------------------

def _text(value, default: str = "?") -> str:
    """An exact str from a str or a str subclass (str.__str__ copies; nothing the subclass defines runs)."""
    return str.__str__(value) if issubclass(type(value), str) else default


def _foreign(value, why: str = "") -> tuple:
    try:
        name = _text(type(value).__name__)
    except Exception:
        name = "?"
    try:
        text = _text(repr(value))[:80]
    except Exception:
        text = f"<{name}>"
    return ("foreign", name, text, why)


def _tensor(value) -> tuple:
    """A tensor as ("tensor", dtype, shape, bytes), read as the plain tensor it is or holds."""
    try:
        with torch._C.DisableTorchFunctionSubclass():   # a subclass's __torch_function__ does not run
            t = value if type(value) is torch.Tensor else torch.Tensor.as_subclass(value, torch.Tensor)
            t = t.detach()
            if type(t) is not torch.Tensor or t.layout != torch.strided:
                return _foreign(value, "a tensor the checker cannot read: return a plain torch.Tensor")
            t = t.cpu().resolve_conj().resolve_neg().contiguous()
            if type(t) is not torch.Tensor:
                return _foreign(value, "a tensor the checker cannot read: return a plain torch.Tensor")
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return ("tensor", str(t.dtype), [int(n) for n in t.shape], raw)
    except Exception as err:   # a tensor without data (meta, sparse, a wrapper subclass), a quantized one
        return _foreign(value, f"a tensor the checker cannot read: {_text(str(err), type(err).__name__)[:80]}")


def to_plain(value, _depth: int = 0, _budget: list | None = None):
    """`value` described with builtin types only (see the module's docstring). Inside the rank."""
    budget = [MAX_ITEMS] if _budget is None else _budget
    budget[0] -= 1
    kind = type(value)
    if kind in _SCALARS:
        return value
    if _depth >= MAX_DEPTH or budget[0] < 0:
        return _foreign(value, "nested too deeply, or too many items")
    try:
        if issubclass(kind, torch.Tensor):
            return _tensor(value)
        if issubclass(kind, int) and not issubclass(kind, bool):
            return int.__int__(value)            # its value; an overridden __eq__ does not travel
        if issubclass(kind, float):
            return float.__float__(value)
        if issubclass(kind, str):
            return str.__str__(value)
        if issubclass(kind, list):
            return ("list", [to_plain(v, _depth + 1, budget) for v in list.__iter__(value)])
        if issubclass(kind, tuple):                 # named tuples and torch.Size too
            return ("tuple", [to_plain(v, _depth + 1, budget) for v in tuple.__iter__(value)])
        if issubclass(kind, dict):
            return ("dict", [(to_plain(k, _depth + 1, budget), to_plain(v, _depth + 1, budget))
                             for k, v in dict.items(value)])
        if kind.__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            return to_plain(value.item(), _depth + 1, budget)   # a NumPy scalar: its Python number
    except Exception as err:
        return _foreign(value, f"could not be read: {_text(str(err), type(err).__name__)[:80]}")
    return _foreign(value)


def plain_error(exc: BaseException) -> BaseException:
    """An exception that says what `exc` says, made of exact strings only, with `exc`'s traceback:
    the same type when it is one of Python's own, else a class of the same name made here. Inside
    the rank, for the launcher's record of the error (a message that is a str subclass, or a class
    whose name or module is not a plain string, could run code when that record is unpickled)."""
    import builtins
    try:
        name = _text(type(exc).__name__, "Exception")
    except Exception:
        name = "Exception"
    try:
        message = _text(str(exc), f"<str() of this {name} failed>")
    except Exception:
        message = f"<str() of this {name} failed>"
    cls = getattr(builtins, name, None)
    try:
        if not (type(exc) is cls and issubclass(cls, BaseException)):
            raise TypeError
        plain = cls(message)
    except Exception:   # not Python's own, or one that takes other arguments (UnicodeDecodeError)
        plain = type(name, (Exception,), {"__module__": "builtins"})(message)
    return plain.with_traceback(exc.__traceback__)


# ---- in the kernel -------------------------------------------------------------------------------

class _NoReferences(pickle.Unpickler):
    """Unpickles builtin values only: any class or function reference is refused, so nothing runs."""

    def find_class(self, module, name):
        raise NotPlain(f"a reference to {module}.{name}")


def loads(data: bytes):
    """What a rank wrote, unpickled without running anything (NotPlain if it names a class or function)."""
    try:
        return _NoReferences(io.BytesIO(data)).load()
    except NotPlain:
        raise
    except Exception as err:
        raise NotPlain(f"unreadable ({type(err).__name__}: {err})") from None


def load(file):
    """`loads` of a file's content (pickle.load's signature)."""
    return loads(file.read())


def from_plain(node, _depth: int = 0):
    """The value a `to_plain` description stands for, with exact types. In the kernel."""
    kind = type(node)
    if kind in _SCALARS:
        return node
    if _depth >= MAX_DEPTH + 1 or kind is not tuple or not node or type(node[0]) is not str:
        raise NotPlain(f"a {kind.__name__} where plain data was expected")
    tag, rest = node[0], node[1:]
    if tag in ("list", "tuple") and len(rest) == 1 and type(rest[0]) is list:
        items = [from_plain(v, _depth + 1) for v in rest[0]]
        return items if tag == "list" else tuple(items)
    if tag == "dict" and len(rest) == 1 and type(rest[0]) is list:
        out = {}
        for pair in rest[0]:
            if type(pair) is not tuple or len(pair) != 2:
                raise NotPlain("a dict entry that is not a pair")
            key = from_plain(pair[0], _depth + 1)
            try:
                out[key] = from_plain(pair[1], _depth + 1)
            except TypeError:
                raise NotPlain(f"a dict key of type {type(key).__name__}") from None
        return out
    if tag == "tensor" and len(rest) == 3:
        return _tensor_from(*rest)
    if tag == "foreign" and len(rest) == 3 and all(type(x) is str for x in rest):
        return Foreign(*rest)
    raise NotPlain(f"an unknown description {tag[:20]!r}")


def _tensor_from(dtype_name, shape, raw) -> torch.Tensor:
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if (dtype is None or type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape)
            or type(raw) is not bytes):
        raise NotPlain("a tensor description that is not one")
    out = torch.empty(shape, dtype=dtype)
    if len(raw) != out.numel() * out.element_size():
        raise NotPlain(f"a tensor of shape {tuple(shape)} and {dtype} with {len(raw)} bytes")
    if raw:
        out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return out
