"""Where the first epoch of notebook 06's GPU cell spends its time, in a fresh process.

    python benchmarks/first_epoch_gpu.py                       # the cell's settings, as the trainer runs
    python benchmarks/first_epoch_gpu.py --cudnn-benchmark 1   # cuDNN's search, as the speed layer has it
    python benchmarks/first_epoch_gpu.py --workers 0           # batches made in the rank itself

One rank on one GPU (`launch`, NCCL), the cell's settings (fastnet, width 64, batches of 512, the
full training set). It times, synchronized with the GPU: building the run (data, model, DDP), the
DataLoader's first batch (its workers starting), each of the first 12 steps, the rest of the first
epoch, and a second epoch; then prints one JSON line. Run it in a fresh process for each setting:
what a learner waits for happens once per process, so a second measurement in the same process
would hide it.
"""
import argparse
import json
import time

START = time.perf_counter()

import torch  # noqa: E402

from ddp_helpers import launch  # noqa: E402

FIRST_STEPS = 12


def probe(cudnn_benchmark, workers, per_class=None):
    import torch  # imported here: the function travels to the rank by value
    import torch.distributed as dist

    from ddp_helpers import train

    class Recipe(train.Plain):
        def loaders(self, cfg, device):
            train_loader, test_loader = super().loaders(cfg, device)
            if workers is None:
                return train_loader, test_loader
            extra = dict(num_workers=workers, pin_memory=True, persistent_workers=True) if workers else {}
            return (torch.utils.data.DataLoader(train_loader.dataset, cfg.batch_size, drop_last=True,
                                                sampler=train_loader.sampler, **extra), test_loader)

    def synced():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    times = {}
    began = synced()
    cfg = train.make_config(model="fastnet", width=64, epochs=2, batch_size=512, per_class=per_class)
    device, _ = train.setup(cfg)
    torch.backends.cudnn.benchmark = cudnn_benchmark
    t = train.build(cfg, Recipe(), device)
    times["build_s"] = synced() - began
    for epoch in range(2):
        t.model.train()
        t.train_loader.sampler.set_epoch(epoch)
        randomness = torch.Generator(device).manual_seed(epoch)
        steps, start = [], synced()
        batches = iter(t.train_loader)
        images, labels = next(batches)
        first_batch = synced() - start
        i = 0
        while True:
            before = synced() if i < FIRST_STEPS else None
            images, labels = t.recipe.prepare(images, labels, device, randomness)
            t.recipe.forward_backward(t.model, images, labels)
            t.optimizer.step()
            t.schedule.step()
            if before is not None:
                steps.append(synced() - before)
            i += 1
            try:
                images, labels = next(batches)
            except StopIteration:
                break
        seconds = synced() - start
        times[f"epoch{epoch + 1}"] = {
            "seconds": seconds, "images_per_s": i * cfg.batch_size / seconds, "steps": i,
            "first_batch_s": first_batch, "first_steps_ms": [round(1e3 * s, 1) for s in steps],
            "rest_s": seconds - first_batch - sum(steps)}
    dist.barrier()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cudnn-benchmark", type=int, default=0, choices=(0, 1))
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: the trainer's)")
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--per-class", type=int, default=None, help="training images of each class (default: all)")
    args = parser.parse_args()
    launched = time.perf_counter()
    result = launch(probe, 1, backend=args.backend,
                    args=(bool(args.cudnn_benchmark), args.workers, args.per_class))[0]
    result.update(import_s=launched - START, launch_and_run_s=time.perf_counter() - launched,
                  cudnn_benchmark=args.cudnn_benchmark, workers=args.workers, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
