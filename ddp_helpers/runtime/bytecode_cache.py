"""A private cache of compiled bytecode for the fork server, where Python cannot keep it beside the sources.

Python compiles each module it imports and normally keeps the result in a `__pycache__` folder beside
the source, so that the next process only reads it. Many container images set
`PYTHONDONTWRITEBYTECODE=1`, or install packages read-only, and ship torch without those files: then
every new Python process compiles torch's thousands of modules again (seconds on a GPU machine's image,
the larger part of `import torch`). The fork server then keeps what it compiles under
`~/.cache/ddp_helpers/pycache/` (Python's `sys.pycache_prefix`, readable by this user alone), and
the next fork server on this machine, in any kernel of this user, reads it instead of compiling.

Used only where it helps: when torch's own bytecode is missing beside its source and Python may not
write it there. `DDP_HELPERS_BYTECODE_CACHE` says otherwise: `0` never, `1` always (in the default
folder), or a folder to use always. A `PYTHONPYCACHEPREFIX` (or `-X pycache_prefix`) of the learner's own
is left alone. A folder that is a link, another user's, or one that group or others may write is not
used: bytecode there would run in every rank.
"""
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec

from . import run_dirs

ENV_VAR = "DDP_HELPERS_BYTECODE_CACHE"


def default_folder() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "ddp_helpers", "pycache")


def needed(module: str = "torch") -> bool:
    """Would this process compile `module` from source, and fail to keep the result? True when its
    bytecode is missing beside its source and Python may not write it there (PYTHONDONTWRITEBYTECODE,
    or a folder it cannot write)."""
    if sys.pycache_prefix:                      # where this Python keeps bytecode is set already
        return False
    spec = _find(module)
    source = _source(spec)
    if source is None:
        return False
    compiled = importlib.util.cache_from_source(source)
    if os.path.exists(compiled):
        return False
    folder = os.path.dirname(compiled)          # __pycache__, which Python makes if missing
    writable = os.access(folder if os.path.isdir(folder) else os.path.dirname(folder), os.W_OK)
    return sys.dont_write_bytecode or not writable


def has_bytecode(module: str) -> bool:
    """Would importing `module` compile nothing? True where its bytecode is where this process reads it
    (beside its source, or under its `sys.pycache_prefix`), or where it has no source (shipped as
    bytecode, or compiled code); False where it is not found. Its parent package is imported to find
    it; `module` is not."""
    spec = _find(module)
    source = _source(spec)
    return spec is not None and (source is None or os.path.exists(importlib.util.cache_from_source(source)))


def _find(module: str) -> ModuleSpec | None:
    """`module`'s import spec, found without importing it (its parent package is); None if not found."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _source(spec: ModuleSpec | None) -> str | None:
    """The .py file a spec imports from; None if it has none."""
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def private_folder(path: str) -> str | None:
    """`path`, made if missing, if it is a folder of this user's that no one else may write (made
    0700, as the run folders' root: `run_dirs.untrusted_folder`); else None."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if run_dirs.untrusted_folder(path, os.getuid()) is None else None


def use() -> str | None:
    """In this process (the fork server, before it imports torch; its ranks inherit it): read and write
    bytecode under the private folder. Returns the folder in use, or None."""
    choice = os.environ.get(ENV_VAR, "")
    if choice == "0" or sys.pycache_prefix:
        return None
    if choice in ("", "1"):
        if choice == "" and not needed():
            return None
        folder = default_folder()
    else:
        folder = os.path.abspath(os.path.expanduser(choice))
    private = private_folder(folder)
    if private is None:
        return None
    sys.pycache_prefix = private
    sys.dont_write_bytecode = False            # for this process and its ranks only
    return private
