"""What one GPU can show about a training step: eager steps, CUDA graphs, torch.compile, and the data pipeline.

    python benchmarks/perf_lab_1gpu.py --data /path/to/cifar10-jpeg   # 1 GPU, NCCL, ~6 min on an H200
    python benchmarks/perf_lab_1gpu.py --quick                        # CPU, Gloo, tiny: checks the script

Every run is one process on one GPU, started with ddp_helpers.launch and training with
ddp_helpers.speed.run: a world of one (no DDP, nothing to all-reduce), so what is measured is the
step itself. Notebook 07 (performance lab) shows the results. Alternated --repeats times (each run
is a new process: about 8 s of start, data and evaluation around its 300 steps on an H200, and
compiling adds 10-30 s; one repeat of everything took 3.6 minutes there):
1. Step modes. ResNet-18 (speed.recipes.RESNET, 256 images per step) and the fast net
   (speed.recipes.FAST, 512 images per step), each with
     eager               every kernel of every step queued by Python, one by one
     cuda_graph          forward and backward recorded once as a CUDA graph, then replayed
     compile             the model compiled by torch.compile (fewer, fused kernels), eager steps
     compile_cuda_graph  the compiled model's forward and backward captured in a CUDA graph
   Images/s are counted after the first --warmup-steps steps (ddp_helpers.perf_lab.counted_throughput):
   compiling, cuDNN's autotuning and the graph capture all happen during the warm-up, whose cost
   each run's train_seconds still shows. A mode that fails (a compiled model may refuse capture)
   is recorded with its error message and not tried again; the others go on.
2. The data pipeline. ResNet-18 with CUDA graphs fed by the reference trainer's DataLoader
   (per-sample torchvision transforms, device_loader=False) or by DeviceLoader (the data kept and
   augmented on the GPU, device_loader=True); and, in the first repeat only, each loader alone,
   without a model: images/s over as many batches as a run has steps, each batch moved to the GPU,
   counted after the same warm-up.
Writes perf_lab_1gpu.json into --out (default notebooks/reference/; a temporary folder with
--quick): machine, versions, date, command, data copy, settings, every run ("rows"), and per
setting the mean images/s with its runs and first error: "step_modes"[model][mode] (also
step_ms, train_seconds), "data_pipeline"[loader] (also step_ms), "loader_alone"[loader] (also
batches_per_s).
"""
import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_cifar_gpu as bench  # noqa: E402  (also puts the repository on the path, keeps NVLS off)
import torch  # noqa: E402

from ddp_helpers import WorkerError, data, launch, machine, speed  # noqa: E402
from ddp_helpers.perf_lab import LOADERS, MODELS, MODES  # noqa: E402

# MODES (eager / CUDA graph / compile), LOADERS and MODELS: the settings notebook 07 runs live too.


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=os.environ.get(data.ENV_VAR),
                   help=f"CIFAR-10 folder with train/ and test/ class folders (default ${data.ENV_VAR})")
    p.add_argument("--out", help="folder for the JSON (default notebooks/reference, or a temporary folder "
                                 "with --quick)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternated (3 take ~9 min)")
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    p.add_argument("--warmup-steps", type=int, default=50, help="steps not counted (compiling, autotuning, capture)")
    p.add_argument("--modes", default=",".join(MODES), help="step modes to measure, comma-separated")
    p.add_argument("--models", default=",".join(MODELS), help="models for the step modes, comma-separated")
    p.add_argument("--no-pipeline", action="store_true", help="skip the DataLoader vs DeviceLoader runs")
    p.add_argument("--quick", action="store_true", help="CPU, Gloo, tiny sizes: a check of the script")
    args = p.parse_args(argv)
    args.modes, args.models = args.modes.split(","), args.models.split(",")
    for given, known in ((args.modes, MODES), (args.models, MODELS)):
        unknown = [name for name in given if name not in known]
        if unknown:
            p.error(f"unknown {unknown}: choose from {', '.join(known)}")
    if args.quick:
        # CUDA graphs need a GPU: on the CPU that mode fails, which checks that failures are recorded.
        # torch.compile is left out: compiling takes minutes on a 2-core CPU.
        args.steps, args.warmup_steps, args.repeats = 6, 2, 1  # 6: with 4, OneCycleLR divides by zero
        args.modes = [m for m in args.modes if not MODES[m]["compile"]]
    if args.repeats < 1 or not 0 <= args.warmup_steps < args.steps:
        p.error("need --repeats >= 1 and 0 <= --warmup-steps < --steps")
    if not args.data:
        p.error(f"give --data (a folder with train/ and test/) or set ${data.ENV_VAR}")
    try:
        data.check_folder(args.data)
    except data.DataNotFoundError as err:
        p.error(str(err))
    if not args.quick and machine.gpu_count() < 1:
        p.error("needs a GPU, this machine has none (try --quick)")
    args.common = dict(data=args.data, verbose=False, max_steps=args.steps, eval_every=0, device="cuda")
    args.models_settings = {name: dict(MODELS[name]) for name in MODELS}
    if args.quick:
        args.common.update(device="cpu", per_class=20, test_per_class=10)
        args.models_settings["resnet18"].update(batch_size=4, log_every=1)
        args.models_settings["fastnet"].update(width=8, batch_size=16, log_every=1)
    try:  # bad settings fail here, before any process starts (the modes are checked one by one later)
        for settings in args.models_settings.values():
            speed.check(**dict(settings, **args.common, cuda_graph=False, compile=False))
    except (TypeError, ValueError) as err:
        p.error(str(err))
    if args.quick:
        args.out = args.out or os.path.join(tempfile.gettempdir(), "perf_lab_1gpu-quick")
    else:
        args.out = args.out or os.path.join(bench.REPO, "notebooks", "reference")
    return args


# ------------------------------------------------------------- inside the rank
def loader_alone(settings, warmup_steps):
    """The training loader the settings choose, without a model: images/s over as many batches as a
    training run takes steps (max_steps, epoch after epoch), each batch moved to the device, the first
    warmup_steps not counted (the DataLoader's worker processes start and fill their queues)."""
    cfg, speedups = speed.check(**settings)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    train_loader, _ = speedups.loaders(cfg, device)
    set_epoch = getattr(train_loader, "set_epoch", None) or train_loader.sampler.set_epoch
    batches, counted, start = 0, 0, time.perf_counter()
    try:
        for epoch in range(cfg.epochs):
            set_epoch(epoch)
            for images, labels in train_loader:
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                batches += 1
                if batches == warmup_steps:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                elif batches > warmup_steps:
                    counted += len(labels)
                if batches == cfg.max_steps:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    return counted / (time.perf_counter() - start)
        raise ValueError(f"max_steps={cfg.max_steps} is more than {cfg.epochs} epochs of batches")
    finally:
        speedups.close()


# ------------------------------------------------------------------ measuring
def measure(experiment, settings, warmup_steps, backend):
    """One run on one rank: images/s (training steps counted after the warm-up, or the loader alone),
    or the error that stopped it."""
    started = time.perf_counter()
    try:
        speed.check(**settings)
        if experiment == "loader_alone":
            result = {"images_per_s": launch(loader_alone, world_size=1, backend=backend,
                                             args=(settings, warmup_steps), timeout=300, quiet=True)[0]}
        else:
            record = launch(speed.run, world_size=1, backend=backend, kwargs=settings,
                            timeout=900 if settings.get("compile") else 300, quiet=True)[0]
            result = {"images_per_s": bench.counted_throughput(record, warmup_steps),
                      "train_seconds": record["train_seconds"],
                      "peak_memory_gb": (record.get("peak_memory_gb") or [None])[0]}
    except (TypeError, ValueError, WorkerError) as err:  # WorkerTimeout is a WorkerError too
        result = {"images_per_s": None, "error": describe_error(err)}
    return {"error": None, **result, "wall_seconds": time.perf_counter() - started}


def describe_error(err):
    """The failing rank's exception in one line (its full traceback is in the rank's log)."""
    if isinstance(err, WorkerError) and err.exc_type:
        text = f"{err.exc_type}: {err.exc_message}"
    else:
        lines = str(err).strip().splitlines() or [type(err).__name__]
        text = f"{type(err).__name__}: {lines[0]}"
    return text if len(text) <= 600 else text[:597] + "..."


def plan(args, repeat):
    """(experiment, model, setting name, settings) of every run in one repeat, in the order they alternate."""
    runs = [("step_modes", model, mode, dict(args.models_settings[model], **args.common, **MODES[mode]))
            for model in args.models for mode in args.modes]
    if not args.no_pipeline:
        mode = "eager" if args.quick else "cuda_graph"  # CUDA graphs on the GPU, as the headline figures
        for experiment in ("data_pipeline", "loader_alone") if repeat == 0 else ("data_pipeline",):
            runs += [(experiment, "resnet18", loader, dict(args.models_settings["resnet18"], **args.common,
                                                           **MODES[mode], **how))
                     for loader, how in LOADERS.items()]
    return runs


def summarize(rows, experiment, settings_by_name):
    """Per model (step modes) or per loader (data pipeline, loader alone): mean images/s, runs, first error."""
    out = {}
    for row in rows:
        if row["experiment"] != experiment:
            continue
        entry = out.setdefault((row["model"], row["setting"]), {"runs": [], "train_seconds": [], "error": None})
        if row["error"]:
            entry["error"] = entry["error"] or row["error"]
        else:
            entry["runs"].append(row["images_per_s"])
            if "train_seconds" in row:
                entry["train_seconds"].append(row["train_seconds"])
    summary = {}
    for (model, name), entry in out.items():
        batch = settings_by_name[model]["batch_size"]
        mean = statistics.mean(entry["runs"]) if entry["runs"] else None
        entry.update(images_per_s=mean, batch_size=batch)
        if experiment == "loader_alone":
            del entry["train_seconds"]
            entry["batches_per_s"] = mean / batch if mean else None
        else:
            entry["step_ms"] = batch / mean * 1e3 if mean else None
        if experiment == "step_modes":
            summary.setdefault(model, {})[name] = entry
        else:
            summary[name] = dict(entry, model=model)
    return summary


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    backend = "gloo" if args.quick else "nccl"
    print(f"{machine.summary_line()}\ndata: {args.data}", flush=True)
    for split in (True, False):  # decode once here: the ranks then read the tensor cache
        data.load_cifar10(train=split, root=args.data,
                          per_class=args.common.get("per_class" if split else "test_per_class"))
    print(f"data ready after {time.perf_counter() - started:.0f} s", flush=True)

    rows, failed = [], set()
    for repeat in range(args.repeats):
        for experiment, model, name, settings in plan(args, repeat):
            if (experiment, model, name) in failed:  # a failure is recorded once, not retried
                continue
            result = measure(experiment, settings, args.warmup_steps, backend)
            rows.append({"experiment": experiment, "model": model, "setting": name, "run": repeat, **result})
            if result["error"]:
                failed.add((experiment, model, name))
                print(f"  {experiment:13s} {model:8s} {name:18s} run {repeat}: FAILED "
                      f"{result['error'].splitlines()[0]}", flush=True)
            else:
                print(f"  {experiment:13s} {model:8s} {name:18s} run {repeat}: "
                      f"{result['images_per_s']:>9,.0f} images/s ({result['wall_seconds']:.0f} s)", flush=True)

    report = {"what": "One GPU: training-step images/s eager vs CUDA graph vs torch.compile (ResNet-18, fast net), "
                      "and ResNet-18 fed by the reference DataLoader vs the on-GPU DeviceLoader",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], bench.REPO), *sys.argv[1:]]),
              "quick_check_only": args.quick, "machine": bench.describe_machine(),
              "data": bench.describe_data(args.data),
              "settings": {"steps": args.steps, "warmup_steps": args.warmup_steps, "repeats": args.repeats,
                           "modes": {m: MODES[m] for m in args.modes},
                           "loaders": {} if args.no_pipeline else LOADERS,
                           "models": {m: dict(args.models_settings[m], **{k: v for k, v in args.common.items()
                                                                          if k != "data"})
                                      for m in args.models_settings}},
              "step_modes": summarize(rows, "step_modes", args.models_settings),
              "data_pipeline": summarize(rows, "data_pipeline", args.models_settings),
              "loader_alone": summarize(rows, "loader_alone", args.models_settings),
              "rows": rows, "wall_seconds": time.perf_counter() - started}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "perf_lab_1gpu.json"), "w") as f:
        json.dump(report, f, indent=1)

    for model, modes in report["step_modes"].items():
        for name, entry in modes.items():
            what = f"{entry['images_per_s']:>9,.0f} images/s, {entry['step_ms']:.2f} ms a step" \
                if entry["images_per_s"] else f"failed: {entry['error'].splitlines()[0]}"
            print(f"{model:8s} {name:18s} {what}")
    for experiment, label in (("data_pipeline", "resnet18 fed by"), ("loader_alone", "loader alone:")):
        for name, entry in report[experiment].items():
            what = (f"{entry['images_per_s']:>9,.0f} images/s" if entry["images_per_s"]
                    else f"failed: {entry['error'].splitlines()[0]}")
            print(f"{label:16s} {name:12s} {what}")
    print(f"wrote {args.out}/perf_lab_1gpu.json after {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
