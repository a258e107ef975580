"""A rank's side of the notebook's input and output beyond plain text.

- **Rich output.** A rank has no Jupyter kernel of its own, so `display(obj)` would print
  `<IPython.core.display.HTML object>` and a figure `Figure(640x480)`. Here a rank formats what it
  shows with IPython's own `DisplayFormatter` (the mime bundle a kernel would send: PNG, HTML, ...;
  without IPython, as on a GPU image or in a script, the object's own `_repr_*_` methods and a
  figure's PNG)
  and writes it, as one marked line, on its stdout pipe; the kernel's `output.OutputPump` sees
  the mark and shows the bundle in the cell, after a `[rank N]` line. Matplotlib draws through
  `rank_backend` (set by MPLBACKEND, as Jupyter's inline backend is): `plt.show()` shows the open
  figures and closes them, and a `%%ddp` cell shows the figures still open at its end.
- **No stdin.** A rank cannot ask the learner anything: `input()` raises `NoStdin` at once (an
  EOFError) instead of writing a prompt that would surface in the next cell's output.
- **`%%ddp --ranks`**: `only_ranks` refuses, before anything is sent, a collective (or a send or
  recv) that needs a rank outside the cell's ranks: those ranks never join, and the cell would
  wait until its timeout.

`setup()` is called once in every rank, by `rank_setup.setup_worker_process`.
"""
from __future__ import annotations

import base64
import builtins
import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

try:   # in the fork server, PRELOAD imports worker: free here. Without IPython, ranks still show text.
    import IPython.core.display_functions  # noqa: F401
except ImportError:
    pass

from . import PACKAGE_DIR
from .c10d_names import called_as

BACKEND = "module://ddp_helpers.runtime.rank_backend"
# A rank's stdout line that carries a mime bundle, not text: MARK + JSON.
MARK = "\x00ddp-display\x00"


class NoStdin(EOFError):
    """`input()` in a rank: ranks have no stdin."""


def setup() -> None:
    """In a rank, once: matplotlib draws for the notebook, `display` shows there, `input` refuses."""
    if os.environ.get("MPLBACKEND", "") in ("", "inline") or "matplotlib_inline" in os.environ["MPLBACKEND"]:
        os.environ["MPLBACKEND"] = BACKEND   # read when matplotlib is imported (a kernel sets the inline one)
        if "matplotlib" in sys.modules:
            sys.modules["matplotlib"].use(BACKEND)
    builtins.input = _no_input
    try:
        import IPython.display
        IPython.core.display_functions.display = IPython.display.display = display
    except ImportError:   # a script or a GPU image without Jupyter: the builtin below is enough
        pass
    # A kernel has `display` among its builtins (IPython puts it there): a function written in a
    # notebook cell calls it without importing it, and cloudpickle does not send builtins along.
    builtins.display = display  # type: ignore[attr-defined]


def _no_input(prompt: object = "") -> str:
    asked = f"input({str(prompt)!r})" if prompt else "input()"
    raise NoStdin(f"ranks have no stdin: nobody can answer {asked} in a rank.\n"
                  "Read the value in the notebook first (a %%ddp cell takes the notebook variables it\n"
                  "uses), `%ddp push NAME` it to a warm pool, or pass it to launch as an argument.")


# ------------------------------------------------------------------ display
_formatter: Any = None


def _display_formatter() -> Any:
    global _formatter
    if _formatter is None:
        try:
            from IPython.core.formatters import DisplayFormatter
            from IPython.core.pylabtools import print_figure
        except ImportError:
            _formatter = PlainFormatter()
            return _formatter
        _formatter = DisplayFormatter()
        # What the inline backend registers in a kernel: a figure's PNG.
        _formatter.formatters["image/png"].for_type_by_name(
            "matplotlib.figure", "Figure", lambda fig: print_figure(fig, "png", bbox_inches="tight"))
    return _formatter


class PlainFormatter:
    """What a rank shows without IPython: `repr`, the `_repr_html_`-style methods the object has
    (what IPython would ask it for), and a matplotlib figure's PNG."""
    METHODS = {"text/html": "_repr_html_", "text/markdown": "_repr_markdown_", "image/svg+xml": "_repr_svg_",
               "image/png": "_repr_png_", "image/jpeg": "_repr_jpeg_", "text/latex": "_repr_latex_",
               "application/json": "_repr_json_"}

    def format(self, obj: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        data: dict[str, Any] = {"text/plain": repr(obj)}
        for mime, method in self.METHODS.items():
            try:
                value = getattr(obj, method)() if callable(getattr(obj, method, None)) else None
            except Exception:
                value = None
            if value is not None:
                data[mime] = value[0] if isinstance(value, tuple) else value
        figure = sys.modules.get("matplotlib.figure")
        if figure is not None and isinstance(obj, figure.Figure):
            import io
            png = io.BytesIO()
            obj.savefig(png, format="png", bbox_inches="tight")
            data["image/png"] = png.getvalue()
        return data, {}


def mime_bundle(obj: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(data, metadata) as a kernel would show `obj`, binary data base64-encoded (as Jupyter keeps it)."""
    data, metadata = _display_formatter().format(obj)
    data = {k: base64.b64encode(v).decode("ascii") if isinstance(v, bytes) else v for k, v in data.items()}
    return data, metadata


def is_rich(data: dict[str, Any]) -> bool:
    return any(key != "text/plain" for key in data)


def display(*objs: Any, raw: bool = False, metadata: dict[str, Any] | None = None, **_: Any) -> None:
    """IPython's `display`, in a rank: each object is shown in the notebook cell, after `[rank N]`."""
    for obj in objs:
        if raw:
            data, meta = obj, metadata or {}
        else:
            data, meta = mime_bundle(obj)
            meta = {**meta, **(metadata or {})}
        send_bundle(data, meta)


def send_bundle(data: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
    """Write one mime bundle on stdout (the file descriptor: the kernel's pipe, whatever sys.stdout
    is now), in order with what the rank printed before."""
    line = (MARK + json.dumps({"data": data, "metadata": metadata or {}}, default=str) + "\n").encode()
    for stream in (sys.stdout, sys.__stdout__):
        try:
            stream.flush()  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):
            pass
    view = memoryview(line)
    while view:
        view = view[os.write(1, view):]


def show_figures() -> None:
    """Show every open pyplot figure, then close it (what Jupyter's inline backend does at the end
    of a cell): when this rank draws with `rank_backend`."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or pyplot.get_backend() != BACKEND:
        return
    for number in pyplot.get_fignums():
        display(pyplot.figure(number))
        pyplot.close(number)


class Shown:
    """A cell's last value that has a rich view (an image, HTML, a figure): the value, and its bundle."""

    def __init__(self, value: Any, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.value, self.data, self.metadata = value, data, metadata


def last_value(value: Any) -> Any:
    """What a `%%ddp` cell gives back for its last value: the value itself, or a `Shown` when it has a
    richer view than text (a figure is shown once: it is closed, not shown again with the open ones)."""
    if value is None:
        return None
    try:
        data, metadata = mime_bundle(value)
    except Exception:
        return value
    if not is_rich(data):
        return value
    pyplot = sys.modules.get("matplotlib.pyplot")
    figure = sys.modules.get("matplotlib.figure")
    if pyplot is not None and figure is not None and isinstance(value, figure.Figure):
        pyplot.close(value)
    return Shown(value, data, metadata)


# ---------------------------------------------------------- %%ddp --ranks
# Operators that communicate: torch.distributed's collectives and p2p (c10d), and the functional
# collectives that DTensor and torch.compile use (_c10d_functional, which name their group).
_COMMUNICATION = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class CollectiveOutsideRanks(RuntimeError):
    """A `%%ddp --ranks` cell called a collective that needs ranks the cell does not run on."""


@contextlib.contextmanager
def only_ranks(ranks: Iterable[int]) -> Iterator[None]:
    """A context in which a collective (or send/recv) that needs a rank outside `ranks` raises
    CollectiveOutsideRanks before it starts. A TorchDispatchMode sees the `c10d.*` operators that
    torch.distributed's collectives dispatch to. The error's traceback ends at the learner's line."""
    try:
        with _only_ranks_mode(ranks):
            yield
    except CollectiveOutsideRanks as exc:
        _end_at_user_code(exc.__traceback__)
        raise


def _end_at_user_code(tb: TracebackType | None) -> None:
    """Cut a traceback after its deepest frame outside torch and ddp_helpers."""
    import torch
    library = (os.path.dirname(torch.__file__), PACKAGE_DIR)
    last_user = None
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(library):
            last_user = tb
        tb = tb.tb_next
    if last_user is not None:
        last_user.tb_next = None


def _only_ranks_mode(ranks: Iterable[int]) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    allowed = set(ranks)

    class OnlyRanks(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if getattr(func, "namespace", None) in _COMMUNICATION:
                needed = _ranks_needed(func, args, kwargs or {})
                if needed is not None and not needed <= allowed:
                    raise CollectiveOutsideRanks(_outside_message(func, needed, allowed))
            return func(*args, **(kwargs or {}))

    return OnlyRanks()


def collectives_visible() -> bool:
    """Does `only_ranks` see this torch's collectives? (It does on torch 2.14: they dispatch to
    c10d operators.) Call it on every rank at once: where the mode does not see it, the probe's
    all_reduce of a zero really runs, and completes, since every rank makes it."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(Exception):
        pass

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if getattr(func, "namespace", None) in _COMMUNICATION:
                raise Seen
            return func(*args, **(kwargs or {}))

    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    try:
        with Probe():
            dist.all_reduce(torch.zeros(1, device=device))
    except Seen:
        return True
    return False


def _ranks_needed(func: Any, args: tuple, kwargs: dict[str, Any]) -> set[int] | None:
    """The global ranks a c10d operator needs: its group's ranks, or the one peer of a send/recv.
    None: no group among its arguments (not a communication)."""
    import torch
    import torch.distributed as dist

    values = dict(zip((a.name for a in func._schema.arguments), args))
    values.update(kwargs)
    group = values.get("process_group", values.get("group_name"))
    if group is None:
        return None
    try:
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        elif isinstance(group, torch._C.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        members = dist.get_process_group_ranks(group)
    except Exception:   # a torch that does not say: assume the whole world
        group, members = None, list(range(dist.get_world_size()))
    name = func._schema.name.split("::")[-1]
    for peer in ("dst", "src"):
        if name in ("send", "recv_") and isinstance(values.get(peer), int):
            try:
                return {dist.get_global_rank(group, values[peer]) if group is not None else values[peer]}
            except Exception:
                return {values[peer]}
    return set(members)


def _outside_message(func: Any, needed: set[int], allowed: set[int]) -> str:
    name = called_as(func._schema.name)
    missing = sorted(needed - allowed)
    who = f"rank {missing[0]} too, which does" if len(missing) == 1 else f"ranks {missing} too, which do"
    return (f"{name} in a --ranks cell (ranks {sorted(allowed)}):\n"
            f"it needs {who} not run this cell, so it would wait until the timeout.\n"
            "Run a cell that communicates with plain %%ddp, on every rank.")
