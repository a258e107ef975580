"""DDP on CIFAR-10 with GPUs: ResNet-18 scaling efficiency, the fast net's time to accuracy, memory.

    python benchmarks/ddp_cifar_gpu.py --data /path/to/cifar10-jpeg    # 1 and 2 GPUs, NCCL, ~4 min
    python benchmarks/ddp_cifar_gpu.py --quick                         # CPU, Gloo, tiny: checks the script

Measures, with real data kept on each GPU (ddp_helpers.speed.DeviceLoader) and the training
code of ddp_helpers.train with its speed layer, ddp_helpers.speed (one process per GPU, started with
ddp_helpers.launch):
1. ResNet-18 training throughput at 256 images per GPU on 1 GPU (plain model: DDP would only
   add work) and on 2 GPUs (DDP over NCCL), alternated `--repeats` times; the first
   `--warmup-steps` steps of each run (cuDNN autotuning, allocator growth) are not counted.
   Scaling efficiency = throughput(2 GPUs) / (2 x throughput(1 GPU)).
2. The fast net's time to accuracy (training plus the final evaluation; data already on the
   GPU; process group, model and data built before the clock starts, after one untimed warm-up
   run in the same processes), `--runs` seeds, on 2 GPUs and, for comparison, on 1.
3. Peak GPU memory of every rank.
Writes ddp_cifar_gpu.json (hardware, versions, date, data copy, every figure, loss curves) and
ddp_cifar_gpu.csv (one row per run) into --out (default notebooks/reference/). For the record
trainer beside it, in the same session: benchmarks/peer_airbench94.py.
"""
import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# Keep NVLink multicast off (NCCL, PyTorch symmetric memory, NVSHMEM): required on shared hosts.
for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                    ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(name, value)

import torch  # noqa: E402
import torchvision  # noqa: E402

from ddp_helpers import data, launch, machine, settings, speed, train  # noqa: E402
from ddp_helpers.perf_lab import counted_throughput  # noqa: E402,F401  (images/s after a warm-up)

# The measured recipes are in ddp_helpers/speed/recipes.py, with how they were chosen.
# epochs: enough for max_steps. Losses are gathered (and the GPU waited for) every 25 steps:
# rarely enough not to slow it.
RESNET = dict(speed.recipes.RESNET, epochs=100, log_every=25)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=os.environ.get(data.ENV_VAR),
                   help=f"CIFAR-10 folder with train/ and test/ class folders (default ${data.ENV_VAR})")
    p.add_argument("--out", help="folder for the CSV and JSON (default notebooks/reference, or a "
                                 "temporary folder with --quick)")
    p.add_argument("--gpus", type=int, default=2, help="GPUs for the multi-GPU runs")
    p.add_argument("--repeats", type=int, default=6,
                   help="ResNet-18 runs per GPU count (the 1-GPU figure varies ~0.5%% run to run)")
    p.add_argument("--steps", type=int, default=400, help="ResNet-18 steps per run")
    p.add_argument("--warmup-steps", type=int, default=50, help="ResNet-18 steps not counted")
    p.add_argument("--runs", type=int, default=5, help="timed fast-net runs (seeds) per GPU count")
    p.add_argument("--fast-epochs", type=int, help="fast-net epochs (default: the recipe's)")
    p.add_argument("--quick", action="store_true", help="CPU, Gloo, tiny sizes: a check of the script")
    p.add_argument("--resnet-set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a ResNet-18 setting (train.Config or speed.Speedups), e.g. bucket_cap_mb=10; "
                        "repeatable")
    p.add_argument("--fast-set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a fast-net setting, e.g. epochs=14; repeatable")
    args = p.parse_args(argv)
    try:
        args.resnet = dict(RESNET, **settings_from(args.resnet_set))
        args.fast = dict(speed.recipes.FAST, **settings_from(args.fast_set))
        if args.fast_epochs:
            args.fast["epochs"] = args.fast_epochs
        if args.quick:  # what runs is what the JSON records
            args.resnet.update(batch_size=4, log_every=1, cuda_graph=False)
            args.fast.update(width=8, batch_size=50, epochs=2, cuda_graph=False)
        for chosen in (args.resnet, args.fast):  # bad values fail here, before any process starts
            speed.check(**dict(chosen, cuda_graph=chosen["cuda_graph"] and machine.gpu_count() > 0))
    except (TypeError, ValueError) as err:
        p.error(str(err))
    if not args.data:
        p.error(f"give --data (a folder with train/ and test/) or set ${data.ENV_VAR}")
    data.check_folder(args.data)
    if args.quick:
        args.out = args.out or os.path.join(tempfile.gettempdir(), "ddp_cifar_gpu-quick")
        args.steps, args.warmup_steps, args.runs, args.repeats = 3, 1, 2, 1
    else:
        args.out = args.out or os.path.join(REPO, "notebooks", "reference")
        if machine.gpu_count() < args.gpus:
            p.error(f"needs {args.gpus} GPUs, this machine has {machine.gpu_count()} (try --quick)")
    return args


def settings_from(pairs):
    """["epochs=14", "tta=2", "whiten=false"] -> {"epochs": 14, "tta": 2, "whiten": False}, typed as the
    trainer's (train.Config) and the speed layer's (speed.Speedups) settings are."""
    out = {}
    for pair in pairs:
        fields = speed.Speedups if pair.partition("=")[0] in speed.SPEED_OPTIONS else train.Config
        out.update(settings.from_pairs(fields, [pair]))
    return out


# ------------------------------------------------------------ inside the ranks
def resnet_throughput(settings):
    return speed.run(**settings)


def timed_fast_runs(settings, seeds):
    """One untimed warm-up run (cuDNN autotuning, NCCL's first calls), then one run per seed."""
    speed.run(**dict(settings, max_steps=min(30, settings.get("max_steps") or 30)))
    return [speed.run(**dict(settings, seed=seed)) for seed in seeds]


# ------------------------------------------------------------------ measuring
def curve(record, every=1):
    """A light copy of a record's per-step curve for the notebook's plots."""
    keep = ("step", "epoch", "loss", "images_per_s", "peak_memory_gb")
    return [{k: s[k] for k in keep if k in s} for s in record["steps"][::every]]


def run_resnet(args, common, backend):
    """CUDA-graph steps `--repeats` times per GPU count (the headline), then eager steps once
    per GPU count: how much of a step was Python's time, not the GPU's."""
    rows, curves = [], {}
    settings = dict(common, **args.resnet, max_steps=args.steps, eval_every=0)
    plan = [(graph, repeat) for repeat in range(args.repeats) for graph in [settings["cuda_graph"]]]
    if settings["cuda_graph"]:
        plan.append((False, 0))
    for graph, repeat in plan:
        for gpus in (1, args.gpus):
            record = launch(resnet_throughput, world_size=gpus, backend=backend,
                            args=(dict(settings, cuda_graph=graph),), timeout=120, quiet=True)[0]
            rows.append({"experiment": "resnet18_throughput" if graph == settings["cuda_graph"]
                         else "resnet18_throughput_eager", "model": "resnet18", "gpus": gpus,
                         "batch_per_gpu": settings["batch_size"], "cuda_graph": graph, "run": repeat,
                         "images_per_s": counted_throughput(record, args.warmup_steps),
                         "peak_memory_gb_per_rank": record.get("peak_memory_gb")})
            curves[f"resnet18_{gpus}gpu" + ("" if graph == settings["cuda_graph"] else "_eager")] = curve(record)
            print(f"  resnet18  {gpus} GPU(s)  cuda_graph={graph}  run {repeat}: "
                  f"{rows[-1]['images_per_s']:,.0f} images/s", flush=True)
    return rows, curves


def run_fast(args, common, backend):
    rows, curves = [], {}
    settings = dict(common, **args.fast, eval_every=0, log_every=1000)
    for gpus in (args.gpus, 1):
        per_gpu = dict(settings, batch_size=settings["batch_size"] * args.gpus // gpus)  # same global batch
        records = launch(timed_fast_runs, world_size=gpus, backend=backend,
                         args=(per_gpu, list(range(args.runs))), timeout=200, quiet=True)[0]
        for seed, record in enumerate(records):
            rows.append({"experiment": "fastnet_time_to_accuracy", "model": "fastnet", "gpus": gpus,
                         "batch_per_gpu": per_gpu["batch_size"], "run": seed,
                         "test_accuracy": record["test_accuracy"], "seconds": record["total_seconds"],
                         "train_seconds": record["train_seconds"], "eval_seconds": record["eval_seconds"],
                         "peak_memory_gb_per_rank": record.get("peak_memory_gb")})
            print(f"  fastnet   {gpus} GPU(s)  seed {seed}: {record['test_accuracy']:.2%} "
                  f"in {record['total_seconds']:.2f} s", flush=True)
        curves[f"fastnet_{gpus}gpu"] = curve(records[0])
    return rows, curves


def summarize(rows, gpus):
    def mean(values):
        return statistics.mean(values) if values else None

    def spread(values):
        return statistics.stdev(values) if len(values) > 1 else 0.0

    summary = {}
    for n in sorted({1, gpus}):
        speed = [r["images_per_s"] for r in rows if r["experiment"] == "resnet18_throughput" and r["gpus"] == n]
        fast = [r for r in rows if r["experiment"] == "fastnet_time_to_accuracy" and r["gpus"] == n]
        summary[f"resnet18_images_per_s_{n}gpu"] = mean(speed)
        summary[f"resnet18_images_per_s_best_{n}gpu"] = max(speed)
        summary[f"fastnet_accuracy_mean_{n}gpu"] = mean([r["test_accuracy"] for r in fast])
        summary[f"fastnet_accuracy_std_{n}gpu"] = spread([r["test_accuracy"] for r in fast])
        summary[f"fastnet_seconds_mean_{n}gpu"] = mean([r["seconds"] for r in fast])
        summary[f"fastnet_seconds_std_{n}gpu"] = spread([r["seconds"] for r in fast])
    eager = {n: mean([r["images_per_s"] for r in rows
                      if r["experiment"] == "resnet18_throughput_eager" and r["gpus"] == n]) for n in sorted({1, gpus})}
    if eager[1]:
        summary["resnet18_eager_images_per_s_1gpu"] = eager[1]
        summary[f"resnet18_eager_images_per_s_{gpus}gpu"] = eager[gpus]
        summary["resnet18_eager_scaling_efficiency"] = eager[gpus] / (gpus * eager[1])
    one, many = summary["resnet18_images_per_s_1gpu"], summary[f"resnet18_images_per_s_{gpus}gpu"]
    summary["resnet18_scaling_efficiency"] = many / (gpus * one)
    # Best of the repeats: less sensitive to other programs on the host slowing one run.
    best_one, best_many = summary["resnet18_images_per_s_best_1gpu"], summary[f"resnet18_images_per_s_best_{gpus}gpu"]
    summary["resnet18_scaling_efficiency_best"] = best_many / (gpus * best_one)
    return summary


def describe_data(folder):
    counts = {split: sum(len(files) for _, _, files in os.walk(os.path.join(folder, split)))
              for split in ("train", "test")}
    name = os.path.basename(os.path.normpath(folder))
    kind = {"cifar10-jpeg": "the full set re-encoded as JPEG (lossy)",
            "cifar10-mini": "lossless PNG subset"}.get(name, "a local class-folder copy")
    return {"folder": name, "what": kind, "train_images": counts["train"], "test_images": counts["test"]}


def describe_machine():
    return {"gpus": machine.gpu_names(), "cpu_cores": machine.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "cuda": torch.version.cuda, "nccl": machine.nccl_version(),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "NVSHMEM_DISABLE_NVLS")}}


def write(args, report, rows):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ddp_cifar_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    fields = ["experiment", "model", "gpus", "batch_per_gpu", "cuda_graph", "run", "images_per_s", "test_accuracy",
              "seconds", "train_seconds", "eval_seconds", "peak_memory_gb_per_rank"]
    with open(os.path.join(args.out, "ddp_cifar_gpu.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            peak = row.get("peak_memory_gb_per_rank")
            writer.writerow({**row, "peak_memory_gb_per_rank": " ".join(f"{x:.2f}" for x in peak) if peak else ""})


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    backend = "gloo" if args.quick else "nccl"
    common = dict(data=args.data, verbose=False, device="cpu" if args.quick else "cuda")
    if args.quick:
        common.update(per_class=20, test_per_class=10)
    print(f"{machine.summary_line()}\ndata: {args.data}", flush=True)
    for split in (True, False):  # decode once here: the ranks then read the tensor cache
        data.load_cifar10(train=split, root=args.data, per_class=common.get("per_class" if split else "test_per_class"))
    print(f"data ready after {time.perf_counter() - started:.0f} s", flush=True)

    resnet_rows, resnet_curves = run_resnet(args, common, backend)
    fast_rows, fast_curves = run_fast(args, common, backend)
    rows = resnet_rows + fast_rows
    summary = summarize(rows, args.gpus)
    report = {"what": "DDP CIFAR-10 on GPUs: ResNet-18 scaling efficiency, fast-net time to accuracy",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "quick_check_only": args.quick, "machine": describe_machine(), "data": describe_data(args.data),
              "settings": {"resnet18": dict(args.resnet, max_steps=args.steps, warmup_steps=args.warmup_steps,
                                            repeats=args.repeats),
                           "fastnet": dict(args.fast, runs=args.runs)},
              "summary": summary, "rows": rows, "curves": {**resnet_curves, **fast_curves},
              "wall_seconds": time.perf_counter() - started}
    write(args, report, rows)
    n = args.gpus
    batch = resnet_rows[0]["batch_per_gpu"]
    print(f"\nResNet-18, {batch} images per GPU: {summary['resnet18_images_per_s_1gpu']:,.0f} images/s on 1 GPU, "
          f"{summary[f'resnet18_images_per_s_{n}gpu']:,.0f} on {n}: scaling efficiency "
          f"{summary['resnet18_scaling_efficiency']:.3f} (means of {args.repeats} runs; best runs: "
          f"{summary['resnet18_images_per_s_best_1gpu']:,.0f} and "
          f"{summary[f'resnet18_images_per_s_best_{n}gpu']:,.0f}, "
          f"{summary['resnet18_scaling_efficiency_best']:.3f})")
    for g in (n, 1):
        print(f"fast net on {g} GPU(s): {summary[f'fastnet_accuracy_mean_{g}gpu']:.2%} "
              f"(± {summary[f'fastnet_accuracy_std_{g}gpu']:.2%}) in {summary[f'fastnet_seconds_mean_{g}gpu']:.2f} s "
              f"(± {summary[f'fastnet_seconds_std_{g}gpu']:.2f}), {args.runs} runs")
    print(f"wrote {args.out}/ddp_cifar_gpu.json and .csv after {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
