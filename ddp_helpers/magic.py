"""The `%%ddp` cell magic: run a notebook cell on every rank.

    %load_ext ddp_helpers

    %%ddp -n 4 -b gloo
    t = torch.ones(2) * rank
    dist.all_reduce(t)
    t                      # each rank's value of the last expression is shown

Each rank runs the cell in its own namespace, which starts with `torch`,
`dist` (torch.distributed), `rank` and `world_size`, plus copies of the
notebook's variables that the cell uses (sent with cloudpickle). The process
group is already initialised.
"""
import ast
import builtins
import linecache
import types

import cloudpickle
from IPython.core import magic_arguments
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .launcher import launch

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


def run_cell(source, sent_globals, filename):
    """Runs on each rank: execute `source`, return the value of its last expression."""
    import torch
    import torch.distributed as dist

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__ddp__", "torch": torch, "dist": dist,
                 "rank": dist.get_rank() if dist.is_initialized() else 0,
                 "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    namespace.update(sent_globals)
    return exec_cell(source, namespace, filename)


def exec_cell(source, namespace, filename):
    """Execute a cell like IPython does: the last bare expression is evaluated and returned."""
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)


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


def globals_to_send(source, user_ns, warn=print):
    """The notebook variables the cell uses that can travel (cloudpickle) to the workers."""
    sent = {}
    for name in sorted(names_used(source)):
        if name in _KERNEL_NAMES | _RANK_NAMES or name.startswith("_") or name not in user_ns or hasattr(builtins, name):
            continue
        value = user_ns[name]
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            warn(f"%%ddp: not sending {name!r} to the workers (cannot be pickled: {type(exc).__name__})")
            continue
        sent[name] = value
    return sent


@magics_class
class DDPMagics(Magics):
    _cells_run = 0

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("-n", "--nprocs", type=int, default=2, help="number of ranks (default 2)")
    @magic_arguments.argument("-b", "--backend", default="gloo", help="gloo, nccl or auto (default gloo)")
    @magic_arguments.argument("-t", "--timeout", type=float, default=120, help="seconds before the ranks are stopped")
    @line_cell_magic
    def ddp(self, line, cell=None):
        """%%ddp -n 4 -b gloo: run this cell on every rank of a new process group."""
        if cell is None:
            raise ValueError("use %%ddp as a cell magic: `%%ddp -n 4` on the first line, the code below it")
        opts = magic_arguments.parse_argstring(self.ddp, line)
        DDPMagics._cells_run += 1
        filename = f"<ddp-cell-{DDPMagics._cells_run}>"
        sent = globals_to_send(cell, self.shell.user_ns)
        values = launch(run_cell, world_size=opts.nprocs, backend=opts.backend,
                        args=(cell, sent, filename), timeout=opts.timeout)
        return None if all(v is None for v in values) else PerRank(values)


def register(ipython):
    ipython.register_magics(DDPMagics)
