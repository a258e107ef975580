"""Settings for speed.run that were measured on GPUs (benchmarks/ddp_cifar_gpu.py, 2 H200s).

    record = launch(speed.run, world_size=2, backend="nccl", kwargs=speed.recipes.FAST)[0]

FAST: the fast net's time-to-accuracy recipe, global batch 1024 (512 per GPU on 2 GPUs: pass
batch_size=1024 // gpus on other counts). It is airbench94's ideas rebuilt in our speed layer
(github.com/KellerJordan/cifar10-airbench): a whitening stem, identity-initialised convs, frozen
BatchNorm scales with 64x faster shifts, lookahead, alternating flips, 2-pixel crops, label smoothing
0.2, its schedule (0.2 -> 1 at 23% -> 0.07), and its learning rate, momentum and decay rewritten
for a mean loss.

RESNET: ResNet-18 throughput runs, 256 images per GPU. No buffer broadcast before every forward
(each rank keeps its own BatchNorm statistics: one collective less per step) and 10 MB buckets
(a smaller last bucket, the one whose all-reduce overlaps nothing).

The sweeps that chose them (epochs, ablations, bucket sizes), with hardware, versions and date:
notebooks/reference/recipe_sweeps.json.
"""

FAST = dict(model="fastnet", width=64, whiten=True, identity_init=True, bn_weights=False, batch_size=512,
            epochs=12, lr=1.5, momentum=0.85, weight_decay=1.33e-3, norm_bias_lr=64, lr_start=0.2, lr_end=0.07,
            warmup=0.23, label_smoothing=0.2, crop_pad=2, flip="alternate", lookahead=5, tta=2, cuda_graph=True)

RESNET = dict(model="resnet18", batch_size=256, lr=0.2, cuda_graph=True, broadcast_buffers=False, bucket_cap_mb=10.0)
