"""Reference results for notebook 04 (Gloo vs NCCL), measured in one run on a GPU machine.

    python benchmarks/gpu_reference.py [--out notebooks/reference] [--nccl-tests PATH/all_reduce_perf] [--quick]

Writes into --out, each CSV with a JSON of the same name beside it (hardware, interconnect
from `nvidia-smi topo -m`, torch and NCCL versions, date, command, the transports NCCL chose,
how each step went):
- bench_all_reduce.csv   every all_reduce series: NCCL (plain loop, CUDA graph, and with
                         NCCL_P2P_DISABLE=1 in the `note` column), Gloo on CPU tensors, Gloo on CUDA tensors
- bench_collectives.csv  NCCL sendrecv, all_gather, reduce_scatter (CUDA graph)
- bench_nccl_debug.txt   what NCCL_DEBUG=INFO printed, with and without NCCL_P2P_DISABLE=1
- with --nccl-tests: bench_nccl_tests_all_reduce.txt (its output, as a plain loop and with -G 1,
  a CUDA graph) and bench_nccl_tests_comparison.csv: at each size, both sides' time per call in
  both modes, and ratio = our best algbw / nccl-tests' best (theirs also the best of out-of-place
  and in-place). nccl-tests runs as one process driving all GPUs (-g N), against the NCCL
  library torch uses when one is found, with the same --iters and --warmup. CUDA-graph runs
  (ours, and nccl-tests' -G 1) use bench.GRAPH_ENV (NCCL_GRAPH_MIXING_SUPPORT=0).

About a minute on 2 H200s (NVLink), plus 40 s to build nccl-tests' all_reduce_perf:
    make -C nccl-tests/src MPI=0 NCCL_HOME=... NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90 ../build/all_reduce_perf

Without GPUs (or with --quick) it still runs what it can, with tiny sizes, so the script
itself can be tested on a laptop. Every launch has a timeout: a stuck step fails, the
run goes on.
"""
import argparse
import contextlib
import glob
import io
import os
import re
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_helpers import bench, machine, reference  # noqa: E402

TRANSPORT_LINES = re.compile(r" via |NVLS|Connected all|P2P Type|NCCL version|Using network|nRanks")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="notebooks/reference", help="output folder (default notebooks/reference)")
    p.add_argument("--nccl-tests", help="path to a built nccl-tests all_reduce_perf, to compare against")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few iterations: checks the script")
    p.add_argument("--iters", type=int, default=50, help="timed calls per size, ours and nccl-tests' (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls per size (default 5)")
    p.add_argument("--timeout", type=float, default=240, help="seconds allowed per launch (default 240)")
    return p.parse_args()


class Steps:
    """Runs named steps, prints progress, and records failures instead of stopping."""

    def __init__(self):
        self.log = []

    def run(self, name, fn):
        print(f"==> {name}", flush=True)
        start = time.monotonic()
        try:
            result = fn()
            ok, error = True, None
        except Exception as exc:
            result, ok, error = None, False, f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        seconds = round(time.monotonic() - start, 1)
        print(f"    {'done' if ok else 'FAILED'} in {seconds} s" + ("" if ok else f": {error.splitlines()[0]}"),
              flush=True)
        self.log.append({"step": name, "ok": ok, "seconds": seconds, "error": error})
        return result

    def skip(self, name, why):
        print(f"==> {name}: skipped, {why}", flush=True)
        self.log.append({"step": name, "ok": None, "seconds": 0, "error": f"skipped: {why}"})


def sweep_rows(steps, name, collective, sizes, note="", **kwargs):
    """bench.measure as a step; tags each row with `note` (e.g. an environment variable)."""
    rows = steps.run(name, lambda: bench.measure(collective, sizes, verbose=True, **kwargs)) or []
    return [dict(r, note=note) for r in rows]


def captured_sweep(steps, name, sizes, env, options):
    """A short NCCL sweep with NCCL_DEBUG=INFO; returns (rows, what the ranks printed)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        note = " ".join(f"{k}={v}" for k, v in env.items() if k != "NCCL_DEBUG")
        rows = sweep_rows(steps, name, "all_reduce", sizes, note, backend="nccl", device="cuda", env=env, **options)
    text = buffer.getvalue()
    print("\n".join(line for line in text.splitlines() if "NCCL INFO" not in line), flush=True)
    return rows, text


def transports(log):
    """The transports NCCL reported ('P2P/CUMEM', 'SHM/direct/direct', ...) and the lines that say so."""
    lines = [line for line in log.splitlines() if "NCCL INFO" in line and TRANSPORT_LINES.search(line)]
    return {"transports": sorted(set(re.findall(r" via (\S+)", log))), "lines": lines[:60]}


def interconnect(topology):
    """What links GPU0 and GPU1 in `nvidia-smi topo -m` (e.g. 'NV18': 18 NVLinks), or None."""
    for line in (topology or "").splitlines():
        fields = line.split()
        if fields[:2] == ["GPU0", "X"] and len(fields) > 2:
            return fields[2]
    return None


def torch_nccl_lib_dir():
    """Folder of the libnccl.so.2 that pip's torch uses (the nvidia-nccl wheel), or None."""
    for base in sys.path:
        found = glob.glob(os.path.join(base, "nvidia", "nccl*", "lib", "libnccl.so*"))
        if found:
            return os.path.dirname(found[0])
    return None


def run_nccl_tests(path, gpus, max_bytes, iters, warmup, graph, timeout):
    """Run nccl-tests all_reduce_perf on all GPUs from one process, as a plain loop or
    (graph=True, -G 1) as one CUDA-graph launch of `iters` calls; return (output, rows)."""
    command = [path, "-b", "8", "-e", str(max_bytes), "-f", "2", "-g", str(gpus), "-n", str(iters),
               "-w", str(warmup)] + (["-G", "1"] if graph else [])
    env = dict(os.environ, **(bench.GRAPH_ENV if graph else {}))  # the same NCCL settings as our graphs
    lib = torch_nccl_lib_dir()
    if lib:  # the same NCCL as torch: the comparison is then about the harness, not NCCL versions
        env["LD_LIBRARY_PATH"] = lib + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    print("    " + " ".join(command) + (f"  (LD_LIBRARY_PATH starts with {lib})" if lib else ""), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    output = (f"### {' '.join(command)}\n### LD_LIBRARY_PATH={env.get('LD_LIBRARY_PATH', '')}\n"
              f"{done.stdout}{done.stderr}")
    print(done.stdout, flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"all_reduce_perf exited with {done.returncode}: {done.stderr[-500:]}")
    return output, parse_nccl_tests(done.stdout)


def parse_nccl_tests(text):
    """Rows of an nccl-tests table: size, count, then out-of-place and in-place time/algbw/busbw/#wrong."""
    rows = []
    for line in text.splitlines():
        f = line.split()
        if line.startswith("#") or len(f) < 13 or not f[0].isdigit():
            continue
        row = {"bytes": int(f[0]), "count": int(f[1]), "dtype": f[2], "redop": f[3], "root": int(f[4])}
        for group, at in (("out_of_place", 5), ("in_place", 9)):
            row.update({f"time_us_{group}": float(f[at]), f"algbw_GBps_{group}": float(f[at + 1]),
                        f"busbw_GBps_{group}": float(f[at + 2]), f"wrong_{group}": f[at + 3]})
        rows.append(row)
    return rows


def comparison(ours, theirs):
    """Per size, each side's time per call as a plain loop and as a CUDA graph, and ratio =
    our best algbw / nccl-tests' best (theirs: best of out-of-place and in-place too).
    theirs: {"plain": rows, "graph": rows} from parse_nccl_tests. Bandwidths come from
    size / time: nccl-tests prints algbw with 2 decimals (0.00 for small sizes)."""
    times = {}
    for r in ours:
        if r["collective"] == "all_reduce" and r["backend"] == "nccl" and not r["note"]:
            times.setdefault(r["bytes"], {})["our_" + ("graph" if r["cuda_graph"] else "plain")] = r["time_us"]
    for mode, rows in theirs.items():
        for t in rows:
            if t["bytes"] in times:
                times[t["bytes"]]["their_" + mode] = min(t["time_us_out_of_place"], t["time_us_in_place"])
    table = []
    for size, t in sorted(times.items()):
        ours_best = min(v for k, v in t.items() if k.startswith("our_"))
        theirs_best = min((v for k, v in t.items() if k.startswith("their_")), default=None)
        if theirs_best is None:
            continue
        table.append({"bytes": size, **{f"{k}_time_us": t.get(k) for k in
                                        ("our_plain", "our_graph", "their_plain", "their_graph")},
                      "our_time_us": ours_best, "their_time_us": theirs_best,
                      "our_algbw_GBps": bench.algbw_GBps(size, ours_best),
                      "their_algbw_GBps": bench.algbw_GBps(size, theirs_best), "ratio": theirs_best / ours_best})
    return table


def metadata(args, gpus):
    """Where and how the results were measured (the keys ddp_helpers.reference's labels read, and more)."""
    topology, names = machine.gpu_topology(), machine.gpu_names()
    link = interconnect(topology)
    return {
        "hardware": f"{gpus}\u00d7 {names[0]}" if names else bench.hardware_name(torch.device("cpu")),
        "interconnect": f"{link} between GPU0 and GPU1 (nvidia-smi topo -m)" if link else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": machine.nccl_version(), "gpu_count": gpus, "gpus": names, "nvidia_smi_topo": topology,
        "cpu": bench.hardware_name(torch.device("cpu")),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "TORCH_NCCL", "TORCH_SYMM", "NVSHMEM_", "CUDA_VISIBLE", "GLOO_"))},
        "quick": args.quick,
    }


def main():
    args = parse_args()
    start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    out = lambda name: os.path.join(args.out, name)  # noqa: E731
    gpus = machine.gpu_count()
    meta = metadata(args, gpus)
    print(machine.summary_line(), flush=True)
    print(f"output folder: {os.path.abspath(args.out)}", flush=True)
    if args.quick:
        nccl_max, gloo_max, iters, warmup = "1M", "64K", 3, 1
    else:
        nccl_max, gloo_max, iters, warmup = "1G", "128M", args.iters, args.warmup
    options = dict(iters=iters, warmup=warmup, timeout=args.timeout)
    meta.update(iters=iters, warmup=warmup)
    nccl_sizes, gloo_sizes = bench.size_range(8, nccl_max), bench.size_range(8, gloo_max)
    steps, all_reduce, others, comparison_rows = Steps(), [], [], []
    can_nccl = gpus >= 2 and dist.is_nccl_available()

    if can_nccl:
        nccl = dict(backend="nccl", device="cuda", **options)
        all_reduce += sweep_rows(steps, "NCCL all_reduce, plain loop", "all_reduce", nccl_sizes, **nccl)
        all_reduce += sweep_rows(steps, "NCCL all_reduce, CUDA graph", "all_reduce", nccl_sizes, cuda_graph=True,
                                 **nccl)
        # Transports: NCCL_DEBUG=INFO on a short run, then on a full run without peer-to-peer.
        _, default_log = captured_sweep(steps, "NCCL_DEBUG=INFO (which transport?)",
                                        bench.size_range(8, "64M", 64), {"NCCL_DEBUG": "INFO"}, options)
        p2p_rows, p2p_log = captured_sweep(steps, "NCCL all_reduce with NCCL_P2P_DISABLE=1", nccl_sizes,
                                           {"NCCL_DEBUG": "INFO", "NCCL_P2P_DISABLE": "1"}, options)
        all_reduce += p2p_rows
        with open(out("bench_nccl_debug.txt"), "w") as f:
            f.write("### NCCL_DEBUG=INFO\n" + default_log + "\n### NCCL_DEBUG=INFO NCCL_P2P_DISABLE=1\n" + p2p_log)
        meta["nccl_transport"] = {"default": transports(default_log), "NCCL_P2P_DISABLE=1": transports(p2p_log)}
        for collective in ("sendrecv", "all_gather", "reduce_scatter"):
            others += sweep_rows(steps, f"NCCL {collective}, CUDA graph", collective, nccl_sizes, cuda_graph=True,
                                 **nccl)
    else:
        steps.skip("NCCL sweeps", f"NCCL needs 2 GPUs, this machine has {gpus}")

    all_reduce += sweep_rows(steps, "Gloo all_reduce, CPU tensors", "all_reduce", gloo_sizes, backend="gloo",
                             device="cpu", **options)
    if gpus >= 1:
        all_reduce += sweep_rows(steps, "Gloo all_reduce, CUDA tensors", "all_reduce", gloo_sizes,
                                 backend="gloo", device="cuda", **options)
    else:
        steps.skip("Gloo all_reduce, CUDA tensors", "no GPU here")

    if args.nccl_tests and can_nccl:
        def nccl_tests():
            outputs, theirs = [], {}
            for mode in ("plain", "graph"):
                output, theirs[mode] = run_nccl_tests(args.nccl_tests, gpus, nccl_max, iters, warmup,
                                                      mode == "graph", args.timeout)
                outputs.append(output)
            with open(out("bench_nccl_tests_all_reduce.txt"), "w") as f:
                f.write("\n".join(outputs))
            comparison_rows.extend(comparison(all_reduce, theirs))
            for row in comparison_rows:
                print(f"    {row['bytes']:>12}  ours {row['our_time_us']:9.2f} us  nccl-tests "
                      f"{row['their_time_us']:9.2f} us  ratio {row['ratio']:.3f}")
            return {"versions": [line for line in outputs[0].splitlines() if "nccl-library" in line],
                    "min_ratio": min(row["ratio"] for row in comparison_rows)}
        meta["nccl_tests"] = steps.run("nccl-tests all_reduce_perf, plain and CUDA graph, same sizes", nccl_tests)
    elif args.nccl_tests:
        steps.skip("nccl-tests", "needs 2 GPUs")

    meta["steps"] = steps.log
    meta["runtime_s"] = round(time.monotonic() - start, 1)
    for name, rows in (("bench_all_reduce", all_reduce), ("bench_collectives", others),
                       ("bench_nccl_tests_comparison", comparison_rows)):
        if rows:  # each CSV with its metadata beside it, as ddp_helpers.reference reads them
            reference.save(name, rows, meta, args.out)
    failed = [s["step"] for s in steps.log if s["ok"] is False]
    print(f"finished in {meta['runtime_s']} s; wrote {sorted(os.listdir(args.out))}"
          + (f"; FAILED steps: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":  # the guard matters: launch's workers import this file
    sys.exit(main())
