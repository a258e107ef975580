"""Ranks that ran out of time: where each one was, and what the timeout says about it.

`stacks_of` asks the unfinished ranks for their stacks (faulthandler, on SIGUSR1: printed in the cell
and in each rank's log) and reads them back from the logs; `waiting_in` tells from a stack whether
the rank was inside torch.distributed (a collective, a rendezvous) or in code of its own;
`describe_timeout` writes the message: it names the time limit as the learner set it (`timeout=`,
or `-t` inside `timeout_called("-t")`, as the %%ddp magic does) with its value, and blames a
collective only when a rank's stack is in one, a mismatch when every rank waits in one and they
differ (notebook 12's first cell). The head, the ranks' places and a mismatch each start a line.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from . import PACKAGE_DIR
from .run_dirs import rank_file

WIDTH = 100   # a notebook's width: the list of where the ranks were is broken to fit it
MISMATCH = ("They wait in different collectives: a mismatch. "
            "All ranks must call the same ones in the same order.")
POINT_TO_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                  "recv_object_list"}

# What the time limit is called where the learner set it: `timeout=` (launch, spawn, the pool's
# methods) unless a caller says otherwise (`timeout_called("-t")`: the %%ddp magic).
_TIMEOUT_NAME = contextvars.ContextVar("ddp_helpers_timeout_name", default="timeout=")


@contextlib.contextmanager
def timeout_called(name: str) -> Iterator[None]:
    """Inside this block a WorkerTimeout names the time limit `name` (e.g. "-t" for %%ddp)."""
    token = _TIMEOUT_NAME.set(name)
    try:
        yield
    finally:
        _TIMEOUT_NAME.reset(token)


def _setting(name: str, seconds: float) -> str:
    """How the learner writes the limit: `timeout=120`, `start_timeout=60`, `-t 120`."""
    return f"{name}{seconds:g}" if name.endswith("=") else f"{name} {seconds:g}"


def stacks_of(ranks: Any, unfinished: list[int]) -> dict[int, str]:
    """Ask the unfinished ranks where they are (`Supervisor.dump_stacks`: printed in the cell unless
    quiet, and in their logs); return what each printed then, read back from its log."""
    logs = {r: rank_file(ranks.run_dir, r, "log") for r in unfinished}
    sizes: dict[int, int | None] = {}
    for r, path in logs.items():
        try:
            sizes[r] = os.path.getsize(path)
        except OSError:
            sizes[r] = None
    ranks.dump_stacks(unfinished)
    stacks = {}
    for r, path in logs.items():
        try:
            with open(path, "rb") as f:
                f.seek(sizes[r] or 0)
                stacks[r] = f.read().decode("utf-8", "replace")
        except OSError:
            stacks[r] = ""
    return stacks


_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+.*\(most recent call first\):\s*$")
_FRAME_LINE = re.compile(r'^\s+File "(?P<file>.*)", line \d+ in (?P<name>\S+)')
_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep


def waiting_in(stack: str) -> str | None:
    """From one rank's faulthandler dump: the torch.distributed function (a collective, a
    rendezvous) that one of its threads is inside, "" when none is (the rank runs code of its own:
    a sleep, a long computation), None when there is no dump to read."""
    innermost, expecting, seen = [], False, False
    for line in stack.splitlines():
        if _THREAD_HEADER.match(line):
            expecting = seen = True
            continue
        frame = _FRAME_LINE.match(line)
        if frame and expecting:   # a thread's first frame is its innermost one
            innermost.append((frame["file"], frame["name"]))
            expecting = False
    if not seen:
        return None
    for file, name in innermost:
        if file.startswith(_TORCH_DISTRIBUTED) or f"{os.sep}torch{os.sep}distributed{os.sep}" in file:
            return name
        if file.startswith(PACKAGE_DIR) and name == "wait_for_every_rank":
            return "init_process_group"   # the launcher's own wait for every rank to join
    return ""


def describe_timeout(timeout: float, unfinished: list[int], stacks: dict[int, str], log_dir: str, *,
                     finished: list[int] | None = None, where: str = "printed above",
                     rendezvous: dict[int, str] | None = None, after: str = "",
                     name: str | None = None) -> tuple[str, dict[int, str]]:
    """(the message, {rank: the torch.distributed function it waited in}) for ranks that had not
    finished after `timeout` seconds; `stacks` is what `stacks_of` read."""
    name = name or _TIMEOUT_NAME.get()
    limit = _setting(name, timeout)
    more = ("%%ddp " if name.startswith("-") else "") + _setting(name, 2 * timeout)   # "%%ddp -t 240"
    head = f"timed out after {timeout:g} s ({limit}): rank(s) {unfinished} had not finished"
    if finished is not None:
        head += f" (finished: {finished or 'none'})"
    places = {r: waiting_in(stacks.get(r, "")) for r in unfinished}
    in_collective = {r: place for r, place in places.items() if place}
    lines = []
    if rendezvous:
        why = (f"rank(s) {sorted(rendezvous)} were still in init_process_group, waiting for the "
               f"rendezvous at {', '.join(sorted(set(rendezvous.values())))}: nobody serves it, or not "
               f"every rank joined it; their stacks are {where}.")
    elif in_collective:
        who = [f"rank {r} was waiting in {place} (torch.distributed)" if place else
               f"rank {r} in your own code" if place == "" else f"rank {r}: no stack came back"
               for r, place in sorted(places.items())]
        lines.append(one_per_line("Where they were: ", who))
        if is_mismatch(places):
            lines.append(MISMATCH)
            why = f"Their stacks are {where}."
        else:
            why = (f"A rank waiting in a collective for a rank that never calls it waits forever, so "
                   f"look for a rank that skipped it; their stacks are {where}. If it only needs more "
                   f"time, raise the limit (e.g. {more}).")
    elif places and all(place == "" for place in places.values()):
        why = (f"Their stacks ({where}) are in your own code, none waiting for another rank: it needs "
               f"more time than {limit} gives. Raise the limit (e.g. {more}), or give it less to do.")
    else:
        why = (f"Their stacks are {where}. A rank waiting in a collective for a rank that never calls it "
               f"waits forever; if the work only needs more time, raise the limit (e.g. {more}).")
    lines.append(why + (f" {after}" if after else ""))
    return "\n".join([f"{head}.", *lines, f"Logs: {log_dir}"]), in_collective


def one_per_line(start: str, items: list[str]) -> str:
    """`start` and the items, comma-separated, ending in a full stop, broken only between items so
    that each line fits WIDTH where one item does (lines after the first indented two spaces)."""
    lines: list[str] = []
    line = start
    for i, item in enumerate(items):
        piece = item + ("." if i == len(items) - 1 else ",")
        if line == start:
            line += piece
        elif len(line) + 1 + len(piece) > WIDTH:
            lines, line = [*lines, line], "  " + piece
        else:
            line += " " + piece
    return "\n".join([*lines, line])


def is_mismatch(places: dict[int, str | None]) -> bool:
    """Every rank whose stack came back waits in torch.distributed, and not all in the same call
    (a send facing a recv is one kind of call: point-to-point ranks wait in different ones by design)."""
    known = [place for place in places.values() if place is not None]
    if not known or "" in known:
        return False
    return len({"point-to-point" if place in POINT_TO_POINT else place for place in known}) > 1
