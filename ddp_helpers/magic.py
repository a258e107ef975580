"""The `%%ddp` cell magic: run a notebook cell on every rank.

    %load_ext ddp_helpers

    %%ddp -n 4 -b gloo
    t = torch.ones(2) * rank
    dist.all_reduce(t)
    t                      # each rank's value of the last expression is shown

`%%ddp -o result` also keeps those values, one per rank, in the notebook
variable `result` (for plotting them, say).

Each rank's namespace starts with `torch`, `dist` (torch.distributed), `rank`
and `world_size`, plus copies of the notebook's variables that the cell uses
(sent with cloudpickle). The process group is already initialised.

Without a pool, every `%%ddp` cell starts fresh ranks (`launch`), which forget
everything when the cell ends. With a warm pool the ranks stay up and keep
their variables from cell to cell:

    %ddp start -n 4 -b gloo     # start the pool
    %ddp status                 # PID, state and memory of each rank; the GPU leases, if any GPU
    %ddp push lr model          # copy notebook variables to every rank
    %ddp pull loss              # each rank's value of a variable
    %ddp stop                   # end the ranks

On a warm pool, a cell can run on some ranks only; the others stay idle and keep their variables.
It is for cells that do not communicate (look at one rank's variables, plot on rank 0):

    %%ddp --ranks 0,2           # or -r 0,2; each value is shown with its rank, as always
    loss

A collective in such a cell (or a send/recv to a rank outside the list) would wait for ranks
that never join it. It is refused at once, in the rank that calls it, by an error that says so:
run cells that communicate with plain `%%ddp`, on every rank. The pool stays up.

Rich output, as a notebook shows it: a matplotlib figure (`plt.show()`, or still open at the end
of the cell), `display(obj)`, and a last value with a richer view than text (an image, HTML, a
DataFrame) appear in the cell, each after a `[rank N]` line. Plain values stay `[rank N] value`
lines. Figures and `display` work in `launch`'s ranks too.

    %%ddp --tabs                # each rank's printed output on a tab of its own (ipywidgets)
    print(f"rank {rank} has {len(shard)} samples")

    %%ddp --seed 0              # rank r draws from seed + r: the same numbers at every run
    x = torch.rand(2)

Without `--seed`, each rank's random state is its own, from fresh entropy, as in a process that
torchrun starts (different on every rank, and in every run). `%ddp start --seed 0` seeds the pool's
ranks as they start.

The cell runs as a script's top level does under torchrun: `__name__` is "__main__", so a pasted
script's `if __name__ == "__main__":` block runs on every rank (its `init_process_group` keeps the
group the ranks have; see `tutorials`), and `sys.argv` holds no arguments (the kernel's own would
reach its argparse). A script whose main calls `mp.spawn` starts ranks of its own: run such a cell
without %%ddp (after `%load_ext ddp_helpers` mp.spawn starts the ranks from the notebook).

A cell that runs past `-t` (120 s by default) is stopped; the error says whether the ranks were
waiting in a collective (a rank that never calls it) or still in their own code (raise `-t`).

pdb in a rank, its prompt `[rank N] (Pdb) ` in the cell (answered in the input box, as `%debug`):

    %ddp debug                  # after a cell raised on a warm pool: the lowest rank that raised
    %ddp debug 1 -c "p x" -c q  # rank 1, with the commands given up front (no one to answer: nbval)

    %%ddp --pdb "p x.shape;; c" # breakpoint() and dist.breakpoint(r) in the cell: these commands answer
    x = torch.ones(rank + 1)
    breakpoint()

At a breakpoint `q` lets the rank go on, as `c` does; time at the prompt does not count against `-t`.
See `runtime.rank_pdb`.

A rank has no stdin: `input()` raises `runtime.rank_io.NoStdin` (an EOFError) at once. Read the value in
the notebook first (the cell takes the notebook variables it uses), or `%ddp push` it.

A mistake in the options or commands (`-n 0`, an unknown backend or command, a name
that is not defined) raises IPython's `UsageError`, one line, before any rank starts.
The pool's notices (new ranks started, ranks stopped) are printed on stdout, before
the cell's output; errors alone go to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import gpu_leases
from .launch_checks import NO_GPU_ZERO, check_seed, check_timeout, check_world_size, resolve_backend
from .launch_errors import WorkerError
from .launcher import launch
from .pool import Pool
from .runtime.cell_exec import run_cell
from .runtime.cells import PerRank, globals_to_send
from .runtime.debug_session import answering, someone_to_ask
from .runtime.output import output_sink
from .runtime.rank_views import TabSink
from .runtime.stacks import timeout_called

LINE_COMMANDS = ("start", "stop", "status", "push", "pull", "debug")


def _positive_int(text: str) -> int:
    """-n: a whole number of ranks, at least 1 (argparse turns the error into a UsageError)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the number of ranks must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"the number of ranks must be at least 1, got {value}"
                                         + (f". {NO_GPU_ZERO}" if value == 0 else ""))
    return value


def _seed(text: str) -> int:
    """--seed: a whole number, 0 or more (launch.check_seed's range)."""
    try:
        seed = int(text)
        check_seed(seed)
        return seed
    except (TypeError, ValueError) as exc:
        message = str(exc) if "seed must be" in str(exc) else f"seed must be a whole number, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _rank_list(text: str) -> list[int]:
    """-r/--ranks: ranks separated by commas, e.g. 0,2 (checked against the pool later)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"no ranks given in {text!r}: -r 0,1 runs the cell on ranks 0 and 1")
    for part in parts:
        if not part.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"ranks are whole numbers separated by commas, got {part!r}")
    return [int(p) for p in parts]


def _unquoted(commands: list[str] | None) -> list[str] | None:
    """-c "p x" / --pdb "p x;; c": IPython's argument split keeps the quotes around each value."""
    if commands is None:
        return None
    return [c[1:-1] if len(c) >= 2 and c[0] == c[-1] and c[0] in "'\"" else c for c in commands]


def _checked(opts: argparse.Namespace) -> argparse.Namespace:
    """Mistakes in the options, found before any process starts: IPython's UsageError (as
    ipyparallel's magics do), one line, no traceback."""
    try:
        if opts.nprocs is not None:
            check_world_size(opts.nprocs)
        if opts.backend is not None:
            resolve_backend(opts.backend, opts.nprocs or 2)
        check_timeout(opts.timeout)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    opts.pdb, opts.commands = _unquoted(opts.pdb), _unquoted(opts.commands)
    if opts.out is not None and not opts.out.isidentifier():
        raise UsageError(f"-o NAME: a Python variable name, got {opts.out!r}")
    return opts


@magics_class
class DDPMagics(Magics):
    pool: Pool | None = None
    _cells_run = 0

    @line_cell_magic
    @magic_arguments()
    @argument("-n", "--nprocs", type=_positive_int, default=None, help="number of ranks (default 2)")
    @argument("-b", "--backend", default=None, help="gloo, nccl or auto (default gloo)")
    @argument("-t", "--timeout", type=float, default=120, help="%%%%ddp: seconds before the ranks are stopped")
    @argument("-o", "--out", default=None, help="%%%%ddp: also keep the per-rank values in this variable")
    @argument("-r", "--ranks", type=_rank_list, default=None,
              help="%%%%ddp on a warm pool: run the cell on these ranks only, e.g. 0,2 (no collectives)")
    @argument("--tabs", action="store_true", help="%%%%ddp: each rank's output on a tab of its own")
    @argument("--seed", type=_seed, default=None,
              help="seed rank r's torch, NumPy and random with SEED + r first (default: fresh entropy)")
    @argument("--pdb", action="append", default=None, metavar="COMMANDS",
              help="%%%%ddp: answer each pdb prompt of a breakpoint() with these commands "
                   "(pdb's ;; separates several), instead of asking")
    @argument("-c", "--commands", action="append", default=None, metavar="COMMAND",
              help="%%ddp debug: the pdb commands to run, one per -c, instead of asking")
    @argument("command", nargs="*",
              help="%%ddp only: start, stop, status, push NAME [NAME ...], pull NAME or debug [RANK]")
    def ddp(self, line: str, cell: str | None = None) -> PerRank | None:
        """%%ddp [-n N] [-b BACKEND] [-t SECONDS] [-o NAME] [-r RANKS] [--tabs] [--seed N] [--pdb CMDS]: run
        this cell on every rank. %ddp start [--seed N]|stop|status|push NAMES|pull NAME: manage a warm pool
        of ranks; %ddp debug [RANK] [-c CMD ...]: pdb where the last cell raised."""
        opts = _checked(parse_argstring(self.ddp, line))
        if cell is None:
            return self._line(opts)
        if opts.command:
            raise UsageError(f"%%ddp takes options only, got {' '.join(opts.command)!r}: "
                             "start, stop, status, push, pull and debug go with %ddp (one %)")
        if opts.commands is not None:
            raise UsageError("-c goes with %ddp debug; %%ddp --pdb \"p x;; c\" answers a cell's breakpoints")
        pool = DDPMagics.pool
        if pool is not None:
            if opts.nprocs not in (None, pool.world_size) or opts.backend not in (None, pool.backend):
                raise UsageError(f"a pool of {pool.world_size} {pool.backend} ranks is running: "
                                 "drop -n/-b, or `%ddp stop` it first")
            try:
                ranks = pool.check_ranks(opts.ranks)
            except ValueError as exc:
                raise UsageError(f"-r/--ranks: {exc}") from None
        elif opts.ranks is not None:
            raise UsageError("-r/--ranks runs a cell on some ranks of a warm pool, and no pool is running: "
                             "`%ddp start -n 4` starts one")
        else:
            ranks = list(range(opts.nprocs or 2))
        DDPMagics._cells_run += 1
        filename = f"<ddp-cell-{DDPMagics._cells_run}>"
        with (output_sink(TabSink(ranks)) if opts.tabs else contextlib.nullcontext(),
              timeout_called("-t"), _hint_for_nested_spawn(), answering(opts.pdb)):
            if pool is not None:
                values = pool.run_cell(cell, self.shell.user_ns, filename, timeout=opts.timeout,
                                       ranks=opts.ranks, seed=opts.seed)
            else:
                sent = globals_to_send(cell, self.shell.user_ns)
                values = PerRank.of(launch(run_cell, world_size=len(ranks), backend=opts.backend or "gloo",
                                           args=(cell, sent, filename), timeout=opts.timeout, seed=opts.seed))
        if opts.out:
            self.shell.user_ns[opts.out] = values
        return values

    def _line(self, opts: argparse.Namespace) -> PerRank | None:
        command, names = (opts.command[0], opts.command[1:]) if opts.command else ("", [])
        if command not in LINE_COMMANDS:
            raise UsageError(f"unknown %ddp command {command!r}: use start, stop, status, push, pull or debug "
                             "(and %%ddp, with two %, to run a cell)")
        if opts.pdb is not None:
            raise UsageError("--pdb goes with %%ddp cells; %ddp debug takes -c COMMAND")
        if opts.commands is not None and command != "debug":
            raise UsageError(f"-c goes with %ddp debug, not %ddp {command}")
        if names and command in ("start", "stop", "status"):
            raise UsageError(f"%ddp {command} takes no names, got {' '.join(names)!r}")
        if opts.seed is not None and command != "start":
            raise UsageError(f"--seed goes with %%ddp or %ddp start, not %ddp {command}")
        if command == "start":
            if DDPMagics.pool is not None:
                DDPMagics.pool.stop()
                DDPMagics.pool = None
            DDPMagics.pool = started = Pool(world_size=opts.nprocs or 2, backend=opts.backend or "gloo", seed=opts.seed)
            print(f"ddp pool: {started.world_size} ranks ready ({started.backend}). "
                  "%%ddp cells now run on them; `%ddp stop` ends them.")
            return None
        pool = DDPMagics.pool
        if pool is None:
            raise UsageError("no pool is running: `%ddp start -n 4` starts one"
                         + (" (%ddp debug looks at a warm pool's ranks: those of a plain %%ddp cell are gone)"
                            if command == "debug" else ""))
        if command == "debug":
            return self._debug(pool, names, opts.commands)
        if command == "stop":
            pool.stop()
            DDPMagics.pool = None
            print("ddp pool: stopped.")
        elif command == "status":
            for row in pool.status():
                memory = f"{row['memory_mib']:.0f} MiB" if row["memory_mib"] else "-"
                print(f"rank {row['rank']}: pid {row['pid']}, {row['state']}, {memory}")
            if gpu_leases.visible_gpus():    # which GPUs this kernel holds, and who holds the others
                print("\n".join(gpu_leases.report()))
        elif command == "push":
            missing = [n for n in names if n not in self.shell.user_ns]
            if not names or missing:
                raise UsageError("%ddp push NAME [NAME ...]: not defined in the notebook: "
                                 f"{missing or 'no names given'}")
            try:
                pool.push(**{n: self.shell.user_ns[n] for n in names})
            except TypeError as exc:
                raise UsageError(f"%ddp push: {exc}") from None
        else:
            if len(names) != 1:
                raise UsageError(f"%ddp pull NAME: one variable name, got {names}")
            try:
                return pool.pull(names[0])
            except WorkerError as exc:
                if exc.exc_type == "NameError" and "has no variable" in (exc.exc_message or ""):
                    raise UsageError(f"%ddp pull {names[0]}: {exc.exc_message} (set it in a %%ddp cell, "
                                     "or `%ddp push` it)") from None
                raise
        return None


    @staticmethod
    def _debug(pool: Pool, names: list[str], commands: list[str] | None) -> None:
        """%ddp debug [RANK] [-c COMMAND ...]: pdb in the rank where the last cell raised."""
        if len(names) > 1 or (names and not names[0].isdigit()):
            raise UsageError(f"%ddp debug [RANK]: one rank number at most, got {' '.join(names)!r}")
        try:
            rank = int(names[0]) if names else None
            if rank is not None:
                pool.check_ranks([rank])
            if not pool.failed_ranks or (rank is not None and rank not in pool.failed_ranks):
                pool.debug(rank)   # raises the ValueError that says why
        except ValueError as exc:
            raise UsageError(f"%ddp debug: {exc}") from None
        if commands is None and not someone_to_ask():
            raise UsageError("%ddp debug: no one can answer pdb's prompts here (this kernel has no stdin): "
                             'give the commands, e.g. %ddp debug -c "p x" -c q')
        with answering(commands):
            pool.debug(rank)


@contextlib.contextmanager
def _hint_for_nested_spawn() -> Iterator[None]:
    """A cell whose code calls mp.spawn (a pasted script's main) would start ranks inside each rank:
    its error (the function cannot be pickled there) gets a line that says what to do instead."""
    try:
        yield
    except WorkerError as exc:
        if _NESTED_SPAWN.search(exc.remote_traceback or ""):
            named = re.search(r"<function (\w+)", exc.exc_message or "")
            first, _, rest = str(exc).partition("\n")
            hint = NESTED_SPAWN_HINT.format(fn=named[1] if named else "demo")
            exc.args = (f"{first}\n{hint}\n{rest}",)
        raise


_NESTED_SPAWN = re.compile(r"torch[/\\]multiprocessing[/\\]spawn\.py\", line \d+, in (spawn|start_processes)")
NESTED_SPAWN_HINT = ("mp.spawn inside a %%ddp cell would start ranks within each rank, which already runs the cell: "
                     "run this cell without %%ddp (after %load_ext ddp_helpers mp.spawn starts the ranks), "
                     "or call the function directly, e.g. {fn}(rank, world_size)")


def register(ipython: Any) -> None:
    ipython.register_magics(DDPMagics)


def unregister(ipython: Any) -> None:
    """Undo `register`: stop the warm pool, if one runs, and remove %ddp and %%ddp."""
    if DDPMagics.pool is not None:
        pool, DDPMagics.pool = DDPMagics.pool, None
        pool.stop()
    manager = ipython.magics_manager
    for kind in ("line", "cell"):
        if getattr(manager.magics[kind].get("ddp"), "__self__", None).__class__ is DDPMagics:
            del manager.magics[kind]["ddp"]
    manager.registry.pop(DDPMagics.__name__, None)
