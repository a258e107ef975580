"""Soak test (not CI): many back-to-back 2-rank launches of a function without a collective,
in one process, or in several processes launching at the same time. Every failure is counted
and its first line printed; the exit code is the number of failures (capped at 1).

    python benchmarks/launch_soak.py --launches 1000               # one process
    python benchmarks/launch_soak.py --launches 100 --processes 2  # two processes at once

A function without a collective is the hardest case for the rendezvous: a rank that finishes
at once could leave before its peer has connected (issue 16: 1-5% of such launches failed).
"""
import argparse
import os
import subprocess
import sys
import time

from ddp_helpers import launch


def nothing():
    return 1


def soak(launches):
    failures, start = [], time.monotonic()
    for i in range(launches):
        try:
            if launch(nothing, 2, quiet=True, timeout=120) != [1, 1]:
                failures.append(f"launch {i}: wrong result")
        except Exception as exc:
            failures.append(f"launch {i}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return failures, time.monotonic() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=1000, help="launches per process")
    parser.add_argument("--processes", type=int, default=1, help="processes launching at the same time")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.processes > 1 and not opts.child:
        command = [sys.executable, os.path.abspath(__file__), "--launches", str(opts.launches), "--child"]
        start = time.monotonic()
        children = [subprocess.Popen(command) for _ in range(opts.processes)]
        codes = [child.wait() for child in children]
        print(f"{opts.processes} processes x {opts.launches} launches at once: exit codes {codes}, "
              f"{time.monotonic() - start:.0f} s")
        sys.exit(int(any(codes)))
    failures, took = soak(opts.launches)
    for line in failures[:20]:
        print(line)
    print(f"pid {os.getpid()}: {len(failures)} failures in {opts.launches} launches of 2 ranks, "
          f"{took:.0f} s ({took / opts.launches * 1000:.0f} ms per launch)", flush=True)
    sys.exit(int(bool(failures)))


if __name__ == "__main__":
    main()
