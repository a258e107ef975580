"""Running a notebook cell in a rank: what `%%ddp` runs on each rank (`run_cell`, or the warm pool's
`serve` with a namespace that lives on: `exec_cell`).

The cell runs as a script's top level under torchrun, and like IPython runs a cell: the value of its
last bare expression comes back (a `rank_io.Shown` when it has a richer view than text), a trailing
`;` hides it, and the figures left open are shown.
"""
from __future__ import annotations

import ast
import io
import linecache
import sys
import tokenize
from typing import Any

import torch
import torch.distributed as dist

from . import rank_io
from .cells import to_cpu


def rank_namespace() -> dict[str, Any]:
    """What a `%%ddp` cell's namespace starts with on every rank. The cell runs as a script's top
    level under torchrun: `__name__` is "__main__", so a pasted script's `if __name__ == "__main__":`
    block runs, and sys.argv holds no arguments (the kernel's own, `-f kernel.json`, would reach the
    script's argparse)."""
    del sys.argv[1:]
    initialised = dist.is_initialized()
    return {"__name__": "__main__", "torch": torch, "dist": dist,
            "rank": dist.get_rank() if initialised else 0,
            "world_size": dist.get_world_size() if initialised else 1,
            "display": rank_io.display}


def exec_cell(source: str, namespace: dict[str, Any], filename: str) -> Any:
    """Execute a cell like IPython does: the last bare expression is evaluated and returned (a
    `rank_io.Shown` when it has a richer view than text), and the figures left open are shown."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:   # kept in the cell's own code, so that pdb steps onto it as onto any line
        tree.body[-1] = ast.copy_location(ast.Assign([ast.Name(_LAST_VALUE, ast.Store())], last.value), last)
        ast.fix_missing_locations(tree)
    try:
        exec(compile(tree, filename, "exec"), namespace)
        if last is None:
            return None
        value = namespace.pop(_LAST_VALUE)
        if _ends_with_semicolon(source):   # as in IPython: a trailing `;` hides the value
            return None
        return rank_io.last_value(to_cpu(value))
    finally:
        rank_io.show_figures()


_LAST_VALUE = "_ddp_helpers_last_value"


def _ends_with_semicolon(source: str) -> bool:
    """Whether the cell's last token (comments and blank lines aside) is `;`."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER,
                                    tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, SyntaxError):
        return False
    return bool(tokens) and tokens[-1].string == ";"


def run_cell(source: str, sent_globals: dict[str, Any], filename: str) -> Any:
    """`%%ddp` without a pool: run the cell once, in a fresh namespace, on this rank."""
    namespace = rank_namespace()
    namespace.update(sent_globals)
    return exec_cell(source, namespace, filename)
