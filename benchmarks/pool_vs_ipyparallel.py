"""Round trip of a trivial cell on 4 warm workers: our `%%ddp` pool against
ipyparallel's `%%px` on 4 engines, in the same IPython shell, in one run
(and, for scale, `%%ddp` without a pool, which starts fresh ranks per cell).

    pip install ipyparallel        # only for this benchmark
    python benchmarks/pool_vs_ipyparallel.py [--cells 100] [--ranks 4]

Both run through their cell magics, as a learner would. The median of
`--cells` round trips is reported for each, and their ratio.
"""
import argparse
import statistics
import time

from IPython.core.interactiveshell import InteractiveShell

from ddp_helpers import machine


def time_cells(shell, cell, count):
    times = []
    for _ in range(count):
        start = time.perf_counter()
        result = shell.run_cell(cell)
        times.append(time.perf_counter() - start)
        result.raise_error()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    import ipyparallel as ipp

    print(machine.summary_line())
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext ddp_helpers").raise_error()
    shell.run_cell(f"%ddp start -n {args.ranks} -b gloo").raise_error()
    ours = time_cells(shell, "%%ddp\nx = 1", args.cells)
    shell.run_cell("%ddp stop").raise_error()
    fresh = time_cells(shell, f"%%ddp -n {args.ranks}\nx = 1", max(5, args.cells // 5))

    cluster = ipp.Cluster(n=args.ranks, log_level=40)
    client = cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(args.ranks, timeout=120)
        view = client[:]
        view.block = True  # wait for every engine, as %%ddp does
        view.activate()    # registers %%px on this shell
        theirs = time_cells(shell, "%%px\nx = 1", args.cells)
    finally:
        client.close()
        cluster.stop_cluster_sync()

    med = statistics.median
    print(f"%%ddp on {args.ranks} warm Gloo ranks: median {med(ours) * 1e3:.2f} ms over {args.cells} cells "
          f"(p90 {sorted(ours)[int(0.9 * len(ours))] * 1e3:.2f} ms)")
    print(f"%%px on {args.ranks} ipyparallel {ipp.__version__} engines: median {med(theirs) * 1e3:.2f} ms "
          f"(p90 {sorted(theirs)[int(0.9 * len(theirs))] * 1e3:.2f} ms)")
    print(f"%%ddp without a pool (fresh ranks each cell): median {med(fresh) * 1e3:.1f} ms "
          f"over {len(fresh)} cells")
    print(f"ratio ours / ipyparallel: {med(ours) / med(theirs):.2f}x  (goal: at most 0.1x)")


if __name__ == "__main__":
    main()
