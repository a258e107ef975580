"""Running notebook cells on ranks, kernel side: which notebook variables a cell
needs (they are sent along with cloudpickle), and how per-rank values are shown.
The worker side (executing the cell) is `worker.exec_cell`."""
import builtins
import sys
import types

import cloudpickle

# Names the notebook kernel defines for itself; never sent to the workers.
_KERNEL_NAMES = {"In", "Out", "get_ipython", "exit", "quit"}
# Names every rank's namespace starts with; the notebook's own never replace them.
_RANK_NAMES = {"torch", "dist", "rank", "world_size"}


class PerRank(list):
    """One value per rank, shown as `[rank N] value` lines."""

    def __repr__(self):
        return "\n".join(f"[rank {r}] {_indent(repr(v))}" for r, v in enumerate(self))

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


def _indent(text):
    return text.replace("\n", "\n" + " " * 9)


def names_used(source):
    """Every global name the cell's code (and code nested in it) may read."""
    try:
        code = compile(source, "<cell>", "exec")
    except SyntaxError:
        return set()
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def globals_to_send(source, user_ns, warn=None):
    """The notebook variables the cell uses that can travel (cloudpickle) to the workers."""
    sent = {}
    for name in sorted(names_used(source)):
        skip = name in _KERNEL_NAMES | _RANK_NAMES or name.startswith("_") or hasattr(builtins, name)
        if skip or name not in user_ns:
            continue
        value = user_ns[name]
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            (warn or _warn)(f"%%ddp: not sending {name!r} to the workers (cannot be pickled: {type(exc).__name__})")
            continue
        sent[name] = value
    return sent



def _warn(message):
    print(message, file=sys.stderr)
