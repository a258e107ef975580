"""Run the airbench94 record trainer on our CIFAR-10 copy, for notebook 06's side-by-side comparison.

    git clone https://github.com/KellerJordan/cifar10-airbench peers/cifar10-airbench   # peers/ is git-ignored
    python benchmarks/ddp_cifar_gpu.py --data /path/to/cifar10-jpeg                       # our figures, then
    python benchmarks/peer_airbench94.py --airbench peers/cifar10-airbench/legacy/airbench94.py \\
        --data /path/to/cifar10-jpeg                                                      # theirs, same session

Nothing of airbench is in this repository: this script converts our class-folder copy into the
train.pt/test.pt files its loader reads, imports the unmodified script and calls its main():
once in its own warm-up mode (random labels), then --runs times. Its clock is its own (CUDA
events around the whitening set-up, the training epochs and the final test-time-augmented
evaluation; data already on the GPU). Writes airbench94_same_session.json into --out.
"""
import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402
from ddp_cifar_gpu import describe_data, describe_machine  # noqa: E402

from ddp_helpers import data  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--airbench", required=True, help="path to airbench94.py (legacy/airbench94.py of the repo)")
    p.add_argument("--data", default=os.environ.get(data.ENV_VAR), help="CIFAR-10 folder with train/ and test/")
    p.add_argument("--runs", type=int, default=5, help="timed runs after the warm-up")
    p.add_argument("--work", default=os.path.join(REPO, "peers", "airbench-work"),
                   help="folder for its data files (keep it git-ignored)")
    p.add_argument("--out", default=os.path.join(REPO, "notebooks", "reference"), help="folder for the JSON")
    p.add_argument("--commit", help="airbench's git commit, for the record (default: asked of git where "
                                    "--airbench lies; give it where that copy has no .git, e.g. a copied folder)")
    args = p.parse_args(argv)
    if not os.path.isfile(args.airbench):
        p.error(f"no file at --airbench {args.airbench}")
    if not args.data:
        p.error(f"give --data or set ${data.ENV_VAR}")
    data.check_folder(args.data)
    if not torch.cuda.is_available():
        p.error("airbench94 needs a CUDA GPU")
    return args


def write_its_data_files(folder, work):
    """Our uint8 (N, 3, 32, 32) splits as its files: uint8 (N, 32, 32, 3) images, labels, class names."""
    os.makedirs(os.path.join(work, "cifar10"), exist_ok=True)
    for split in ("train", "test"):
        s = data.load_cifar10(train=split == "train", root=folder)
        torch.save({"images": s.images.permute(0, 2, 3, 1).contiguous(), "labels": s.labels,
                    "classes": list(data.CLASSES)}, os.path.join(work, "cifar10", f"{split}.pt"))


def seconds_from_its_table(printed):
    """The last column of its final ('eval') row is total_time_seconds."""
    rows = [line for line in printed.splitlines() if "eval" in line]
    return float(rows[-1].strip().strip("|").split("|")[-1])


def git_commit(path):
    try:
        return subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(path)), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    args = parse_args(argv)
    write_its_data_files(args.data, args.work)
    spec = importlib.util.spec_from_file_location("airbench94", args.airbench)
    airbench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(airbench)   # its `if __name__ == "__main__"` part does not run
    os.chdir(args.work)                 # it reads cifar10/train.pt relative to the working folder
    runs = []
    for run in ["warmup"] + list(range(args.runs)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            accuracy = airbench.main(run)
        if run != "warmup":
            runs.append({"run": run, "test_accuracy": float(accuracy),
                         "seconds": seconds_from_its_table(printed.getvalue())})
            print(f"airbench94 run {run}: {accuracy:.2%} in {runs[-1]['seconds']:.2f} s", flush=True)
    accuracies, seconds = [r["test_accuracy"] for r in runs], [r["seconds"] for r in runs]
    report = {"what": "airbench94 (the public single-GPU CIFAR-10 speed record trainer) on the same data copy, "
                      "same machine, same device session as benchmarks/ddp_cifar_gpu.py",
              "source": f"github.com/KellerJordan/cifar10-airbench, legacy/airbench94.py at commit "
                        f"{args.commit or git_commit(args.airbench)}, unmodified; nothing of it is in this repository",
              "how": "benchmarks/peer_airbench94.py: the class folders converted to its train.pt/test.pt; one "
                     "warm-up run (its 'warmup' mode, random labels), then the timed runs; time is its own "
                     "CUDA-event clock: whitening init + training + final test-time-augmented evaluation, data "
                     "already on the GPU (per-epoch evaluations not counted)",
              "gpus": 1, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": describe_machine(), "data": describe_data(args.data), "runs": runs,
              "accuracy_mean": statistics.mean(accuracies),
              "accuracy_std": statistics.stdev(accuracies) if len(runs) > 1 else 0.0,
              "seconds_mean": statistics.mean(seconds),
              "seconds_std": statistics.stdev(seconds) if len(runs) > 1 else 0.0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "airbench94_same_session.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"airbench94: {report['accuracy_mean']:.2%} (± {report['accuracy_std']:.2%}) in "
          f"{report['seconds_mean']:.2f} s (± {report['seconds_std']:.2f}), {len(runs)} runs")


if __name__ == "__main__":
    main()
