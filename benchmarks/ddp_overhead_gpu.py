"""Where the second GPU's time goes: ResNet-18 steps on 1 GPU, on 2 GPUs with DDP but without
its all-reduce, and on 2 GPUs with DDP (as it is, and with three NCCL settings that one might try).

    python benchmarks/ddp_overhead_gpu.py --data /path/to/cifar10-jpeg   # 2 GPUs, NCCL, ~6 min
    python benchmarks/ddp_overhead_gpu.py --quick                        # CPU, Gloo, tiny: checks the script

The middle case registers a DDP communication hook that hands each bucket back unchanged: DDP
still does all its own work (gradients copied into buckets, bucket bookkeeping), only the
all-reduce is missing, so each rank trains on its own gradients. That is useless for training
and useful for measuring: it splits the gap between "2 x one GPU" and DDP into DDP's own work
and communication.

The last three cases ask whether NCCL can share the GPU better with the backward pass it overlaps:
its Simple protocol instead of the one it picks, at most 8 thread blocks (CTAs) instead of one per
channel (NCCL chose 24 channels on 2 H200s), and PyTorch's NCCL stream at high priority
(TORCH_NCCL_HIGH_PRIORITY). Each is an environment variable set for the ranks before NCCL starts;
the ranks report what they saw. Same settings as benchmarks/ddp_cifar_gpu.py (its RESNET, CUDA
graphs), all cases alternated --repeats times. Writes ddp_overhead_gpu.json into --out
(default notebooks/reference/).
"""
import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_cifar_gpu as bench  # noqa: E402  (also puts the repository on the path, keeps NVLS off)
import torch  # noqa: E402

from ddp_helpers import data, launch, machine, speed, train  # noqa: E402

# (name, GPUs, skip DDP's all-reduce, environment of the ranks)
CASES = [("1 GPU", 1, False, {}),
         ("2 GPUs, DDP without all-reduce", 2, True, {}),
         ("2 GPUs, DDP", 2, False, {}),
         ("2 GPUs, DDP, NCCL_PROTO=Simple", 2, False, {"NCCL_PROTO": "Simple"}),
         ("2 GPUs, DDP, NCCL_MAX_CTAS=8", 2, False, {"NCCL_MAX_CTAS": "8"}),
         ("2 GPUs, DDP, TORCH_NCCL_HIGH_PRIORITY=1", 2, False, {"TORCH_NCCL_HIGH_PRIORITY": "1"})]


def skip_allreduce(state, bucket):
    """A DDP comm hook that returns the bucket as it is: no communication (for measuring only)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class WithoutAllReduce(speed.Speedups):
    """The speed layer's plug-in, with DDP's all-reduce replaced by skip_allreduce."""

    def wrap(self, model, device):
        model = super().wrap(model, device)
        model.register_comm_hook(None, skip_allreduce)
        return model


def throughput(settings, skip, warmup_steps, env_names):
    """Inside each rank: train; return the images per second after the warm-up steps, and the
    values of env_names this rank saw."""
    cfg, speedups = speed.check(**settings)
    recipe = WithoutAllReduce(**dataclasses.asdict(speedups)) if skip else speedups
    record = train.run(recipe=recipe, **dataclasses.asdict(cfg))
    return bench.counted_throughput(record, warmup_steps), {k: os.environ.get(k) for k in env_names}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get(data.ENV_VAR), help="CIFAR-10 folder with train/ and test/")
    p.add_argument("--out", help="folder for the JSON (default notebooks/reference)")
    p.add_argument("--repeats", type=int, default=4, help="runs of each case, alternated")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument("--warmup-steps", type=int, default=50, help="steps not counted")
    p.add_argument("--quick", action="store_true", help="CPU, Gloo, tiny sizes: a check of the script")
    args = p.parse_args(argv)
    if not args.data:
        p.error(f"give --data (a folder with train/ and test/) or set ${data.ENV_VAR}")
    if args.repeats < 1 or args.warmup_steps >= args.steps:
        p.error("need --repeats >= 1 and --warmup-steps < --steps")
    data.check_folder(args.data)
    if args.quick:
        args.out = args.out or os.path.join(tempfile.gettempdir(), "ddp_overhead_gpu-quick")
        args.steps, args.warmup_steps, args.repeats = 3, 1, 1   # checks the script, measures nothing
    else:
        args.out = args.out or os.path.join(bench.REPO, "notebooks", "reference")
        if machine.gpu_count() < 2:
            p.error(f"needs 2 GPUs, this machine has {machine.gpu_count()} (try --quick)")
    return args


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    settings = dict(bench.RESNET, data=args.data, verbose=False, max_steps=args.steps, eval_every=0, device="cuda")
    if args.quick:
        settings.update(device="cpu", cuda_graph=False, batch_size=4, log_every=1, per_class=20, test_per_class=10)
    backend = "gloo" if args.quick else "nccl"
    runs = {name: [] for name, _, _, _ in CASES}
    for repeat in range(args.repeats):
        for name, gpus, skip, env in CASES:
            results = launch(throughput, world_size=gpus, backend=backend, timeout=120, quiet=True, env=env,
                             args=(settings, skip, args.warmup_steps, list(env)))
            seen = [ranks_env for _, ranks_env in results]
            if any(s != env for s in seen):  # a launcher that dropped the setting would measure nothing new
                raise RuntimeError(f"{name}: the ranks saw {seen}, not {env}")
            runs[name].append(results[0][0])
            print(f"  {name:40s} run {repeat}: {results[0][0]:,.0f} images/s", flush=True)
    one = statistics.mean(runs["1 GPU"])
    summary = {name: {"images_per_s": statistics.mean(runs[name]), "runs": runs[name], "env": env,
                      "of_2x_one_gpu": statistics.mean(runs[name]) / (2 * one)}
               for name, _, _, env in CASES}
    report = {"what": "ResNet-18 throughput: 1 GPU, 2 GPUs with DDP minus its all-reduce, 2 GPUs with DDP "
                      "(as it is, and with three NCCL settings)",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "quick_check_only": args.quick, "machine": bench.describe_machine(),
              "data": bench.describe_data(args.data),
              "settings": dict(settings, data=None, warmup_steps=args.warmup_steps, repeats=args.repeats),
              "summary": summary, "wall_seconds": time.perf_counter() - started}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ddp_overhead_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    for name, s in summary.items():
        print(f"{name:40s} {s['images_per_s']:10,.0f} images/s  = {s['of_2x_one_gpu']:.3f} of 2 x one GPU")
    print(f"wrote {args.out}/ddp_overhead_gpu.json after {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
