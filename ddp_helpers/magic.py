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
    %ddp status                 # PID, state and memory of each rank
    %ddp push lr model          # copy notebook variables to every rank
    %ddp pull loss              # each rank's value of a variable
    %ddp stop                   # end the ranks
"""
import argparse
import shlex

from IPython.core.magic import Magics, line_cell_magic, magics_class

from .cells import PerRank, globals_to_send
from .launcher import launch
from .pool import Pool
from .worker import run_cell


def _parser(prog, with_timeout):
    parser = argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False)
    parser.add_argument("-n", "--nprocs", type=int, default=None, help="number of ranks (default 2)")
    parser.add_argument("-b", "--backend", default=None, help="gloo, nccl or auto (default gloo)")
    if with_timeout:
        parser.add_argument("-t", "--timeout", type=float, default=120, help="seconds before the ranks are stopped")
        parser.add_argument("-o", "--out", default=None, help="also store the per-rank values in this variable")
    return parser


def _parse(parser, line):
    try:
        return parser.parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit) as err:
        raise ValueError(f"{parser.prog}: cannot read options {line!r}: {err}") from None


@magics_class
class DDPMagics(Magics):
    pool = None
    _cells_run = 0

    @line_cell_magic
    def ddp(self, line, cell=None):
        """%%ddp [-n N] [-b BACKEND] [-t SECONDS]: run this cell on every rank.
        %ddp start|stop|status|push NAMES|pull NAME: manage a warm pool of ranks."""
        if cell is None:
            return self._line(line)
        opts = _parse(_parser("%%ddp", with_timeout=True), line)
        DDPMagics._cells_run += 1
        filename = f"<ddp-cell-{DDPMagics._cells_run}>"
        pool = DDPMagics.pool
        if pool is not None:
            if opts.nprocs not in (None, pool.world_size) or opts.backend not in (None, pool.backend):
                raise ValueError(f"a pool of {pool.world_size} {pool.backend} ranks is running: "
                                 "drop -n/-b, or `%ddp stop` it first")
            values = pool.run_cell(cell, self.shell.user_ns, filename, timeout=opts.timeout)
        else:
            sent = globals_to_send(cell, self.shell.user_ns)
            values = launch(run_cell, world_size=opts.nprocs or 2, backend=opts.backend or "gloo",
                            args=(cell, sent, filename), timeout=opts.timeout)
            values = None if all(v is None for v in values) else PerRank(values)
        if opts.out:
            self.shell.user_ns[opts.out] = values
        return values

    def _line(self, line):
        command, _, rest = line.strip().partition(" ")
        if command == "start":
            opts = _parse(_parser("%ddp start", with_timeout=False), rest)
            if DDPMagics.pool is not None:
                DDPMagics.pool.stop()
            DDPMagics.pool = Pool(world_size=opts.nprocs or 2, backend=opts.backend or "gloo")
            print(f"ddp pool: {DDPMagics.pool.world_size} ranks ready ({DDPMagics.pool.backend}). "
                  "%%ddp cells now run on them; `%ddp stop` ends them.")
            return None
        pool = DDPMagics.pool
        if command not in ("stop", "status", "push", "pull"):
            raise ValueError(f"unknown %ddp command {command!r}: use start, stop, status, push or pull "
                             "(and %%ddp, with two %, to run a cell)")
        if pool is None:
            raise RuntimeError("no pool is running: `%ddp start -n 4` starts one")
        if command == "stop":
            pool.stop()
            DDPMagics.pool = None
            print("ddp pool: stopped.")
        elif command == "status":
            for row in pool.status():
                memory = f"{row['memory_mib']:.0f} MiB" if row["memory_mib"] else "-"
                print(f"rank {row['rank']}: pid {row['pid']}, {row['state']}, {memory}")
        elif command == "push":
            names = rest.split()
            missing = [n for n in names if n not in self.shell.user_ns]
            if not names or missing:
                raise NameError(f"%ddp push NAME [NAME ...]: not defined in the notebook: {missing or 'no names given'}")
            pool.push(**{n: self.shell.user_ns[n] for n in names})
        else:
            return pool.pull(rest.strip())
        return None


def register(ipython):
    ipython.register_magics(DDPMagics)
