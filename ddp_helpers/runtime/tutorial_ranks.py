"""Inside each rank that ddp_helpers starts: tutorial code's own `init_process_group` (see `tutorials`).

`install_in_rank` (called by `rank_setup` as a rank starts) replaces `init_process_group` and
`destroy_process_group` in the rank, unless DDP_HELPERS_TUTORIAL_CODE=0:

- inside a group that exists already (a `%%ddp` cell, `launch(init=True)`, the pool) an init that
  asks for the same backend, rank and world size keeps it, and its destroy does nothing;
- `MASTER_ADDR`/`MASTER_PORT` set by the rank's code, or a `tcp://` init_method, go back to the
  launch's own rendezvous, with one line from rank 0 that says so and what torchrun needs instead;
- each group formed on the launch's store meets under a prefix of its own (a group formed again
  after `destroy_process_group()` would find the old group's addresses there);
- a `world_size` or `rank` that does not fit the ranks started is an error at once.
"""
from __future__ import annotations

import functools
import inspect
import os
import urllib.parse
from datetime import timedelta
from typing import Any

import torch.distributed as dist

SWITCH = "DDP_HELPERS_TUTORIAL_CODE"   # "0": tutorial code runs exactly as torch runs it


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


_real_init = dist.init_process_group
_real_destroy = dist.destroy_process_group
_INIT_SIGNATURE = inspect.signature(_real_init)


class _RankShims:
    launch_addr: str | None = None    # the launch's rendezvous, as the rank started
    launch_port: str | None = None
    marker: str | None = None         # the file that says where this rank waits to meet the others
    rounds = 0         # init_process_group calls that formed a group on the launch's store (see _a_store_of_this_round)
    kept_inits = 0     # init_process_group calls that found the group formed: their destroys do nothing


def install_in_rank(marker_path: str | None = None) -> None:
    """Called by every rank as it starts (rank_setup.setup_worker_process): see the module docstring."""
    if not enabled():
        return
    _RankShims.launch_addr = os.environ.get("MASTER_ADDR")
    _RankShims.launch_port = os.environ.get("MASTER_PORT")
    _RankShims.marker = marker_path
    _RankShims.rounds = _RankShims.kept_inits = 0
    for module in (dist, dist.distributed_c10d):
        module.init_process_group = init_process_group
        module.destroy_process_group = destroy_process_group


def _say(text: str) -> None:
    """One line, from rank 0 only (every rank would print the same)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"ddp_helpers: {text}", flush=True)


@functools.wraps(_real_init)
def init_process_group(*args: Any, **kwargs: Any) -> Any:
    call = _INIT_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    given = call.arguments
    init_method = given["init_method"]
    tcp = isinstance(init_method, str) and init_method.startswith("tcp://")
    if tcp:   # tcp://host:port?rank=0&world_size=2: the query's rank and world size count as given
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(init_method).query))
        for name in ("rank", "world_size"):
            if given[name] in (-1, None) and query.get(name, "").isdigit():
                given[name] = int(query[name])
    backend, world_size, rank = given["backend"], given["world_size"], given["rank"]
    if dist.is_initialized():
        _use_the_launch_rendezvous(init_method if tcp else None)
        return _keep_the_group(backend, world_size, rank)
    started = int(os.environ.get("WORLD_SIZE", "0") or 0)
    if started and world_size not in (-1, None) and world_size != started:
        raise ValueError(f"init_process_group(world_size={world_size}), but {started} ranks were started: "
                         f"they would wait for the missing ones forever. Pass world_size={started}.")
    if started and rank not in (-1, None) and not 0 <= rank < started:
        raise ValueError(f"init_process_group(rank={rank}): ranks are 0 to {started - 1} here")
    if given["store"] is None and (init_method in (None, "env://") or tcp) and _RankShims.launch_port:
        # env://, or a tcp:// address (which no store serves in here): the launch's own rendezvous
        _use_the_launch_rendezvous(init_method if tcp else None)
        given["init_method"] = None
        given["store"] = _a_store_of_this_round(given["timeout"])
        given["rank"] = rank if rank not in (-1, None) else int(os.environ["RANK"])
        given["world_size"] = world_size if world_size not in (-1, None) else int(os.environ["WORLD_SIZE"])
    where = init_method if given["store"] is None and init_method not in (None, "env://") else (
        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
    _mark_rendezvous(where)
    try:
        return _real_init(*call.args, **call.kwargs)
    finally:
        _mark_rendezvous(None)


def _a_store_of_this_round(timeout: timedelta | None) -> Any:
    """A client of the launch's store, under a prefix of its own for each init_process_group of this
    rank. A group formed again after destroy_process_group() has the same name ("0"), so without it
    Gloo found the previous group's addresses in the store: "connectFullMesh failed ... Connection
    refused", or a wait that never ended (torchrun's agent store has the same keys; the tutorials'
    own rank-0 store is new for each group). Every rank forms its groups in the same order, so the
    n-th init of each rank meets under the same prefix."""
    _RankShims.rounds += 1
    client = dist.TCPStore(_RankShims.launch_addr, int(_RankShims.launch_port or 0), is_master=False,
                           timeout=timeout or dist.distributed_c10d.default_pg_timeout)
    return dist.PrefixStore(f"ddp_helpers/init_{_RankShims.rounds}", client)


def _keep_the_group(backend: str | None, world_size: int | None, rank: int | None) -> None:
    current = dist.get_backend()
    size, me = dist.get_world_size(), dist.get_rank()
    wanted = str(backend).lower() if backend is not None else current
    fits = wanted == current and world_size in (-1, None, size) and rank in (-1, None, me)
    if not fits:
        raise ValueError(
            f"a process group exists already ({current}, rank {me} of {size}): this code runs inside it "
            f"(a %%ddp cell, launch or the pool), and cannot form another with backend={backend!r}, "
            f"world_size={world_size}, rank={rank}. Drop the call, or use launch(fn, init=False) to "
            "let the function form its own.")
    _RankShims.kept_inits += 1
    _say(f"kept the {current} group of {size} ranks that exists (so init and destroy do nothing)")


@functools.wraps(_real_destroy)
def destroy_process_group(group: Any = None) -> None:
    if group is None and _RankShims.kept_inits > 0:
        _RankShims.kept_inits -= 1
        return None
    return _real_destroy(group)


def _is_the_launch_store(url: str) -> bool:
    parsed = urllib.parse.urlparse(url)
    return (parsed.hostname, str(parsed.port)) == (_RankShims.launch_addr, _RankShims.launch_port)


def _use_the_launch_rendezvous(init_method: str | None = None) -> None:
    """Point MASTER_ADDR/PORT at the launch's own rendezvous, saying so in one line if the code had
    set others (or passed a tcp:// init_method), and what to do under torchrun."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if _RankShims.launch_port is None:
        return
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = _RankShims.launch_addr or "127.0.0.1", _RankShims.launch_port
    if init_method is not None and not _is_the_launch_store(init_method):
        _say(f"init_method {init_method} from your code -> this launch's own rendezvous")
        _say("under torchrun, drop init_method: torchrun sets MASTER_ADDR/PORT for env://")
    elif (addr, port) != (_RankShims.launch_addr, _RankShims.launch_port):
        _say(f"MASTER_ADDR:PORT {addr}:{port} from your code -> this launch's own")
        _say("under torchrun, delete the lines that set them: torchrun sets both")


def _mark_rendezvous(where: str | None) -> None:
    """A file saying where this rank waits for its rendezvous (read by the launcher on a timeout)."""
    path = _RankShims.marker
    if path is None:
        return
    try:
        if where is None:
            os.unlink(path)
        else:
            with open(path, "w") as f:
                f.write(where)
    except OSError:
        pass
