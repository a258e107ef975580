"""Settings for speed.run that were measured on GPUs (benchmarks/ddp_cifar_gpu.py, 2 H200s).

    record = launch(speed.run, world_size=2, backend="nccl", kwargs=speed.recipes.FAST)[0]

FAST: the fast net's time-to-accuracy recipe, global batch 1024 (512 per GPU on 2 GPUs: pass
batch_size=1024 // gpus on other counts). It is airbench94's ideas rebuilt in our speed layer
(github.com/KellerJordan/cifar10-airbench): a whitening stem, identity-initialised convs, frozen
BatchNorm scales with 64x faster shifts, lookahead, alternating flips, 2-pixel crops, label smoothing
0.2, its schedule (0.2 -> 1 at 23% -> 0.07), and its learning rate, momentum and decay rewritten
for a mean loss. In a sweep on 2 H200s (3 seeds each, JPEG copy, 2026-11-30): 10 epochs gave
90.59% in 1.53 s, 11 epochs 90.83% in 1.67 s, 12 epochs 90.89% in 1.80 s (1.69 s since the loader
draws each epoch's order early: notebooks/reference/ddp_cifar_gpu.json). Against the same 10
epochs, learnable BatchNorm scales cost 1.6 points, shifts at the normal rate 0.5, no lookahead 0.5.

RESNET: ResNet-18 throughput runs, 256 images per GPU. No buffer broadcast before every forward
(each rank keeps its own BatchNorm statistics: one collective less per step, +1.6% on 2 GPUs) and
10 MB buckets (a smaller last bucket, the one whose all-reduce overlaps nothing; 15, 20 and 25 MB
were within noise of it, 50 MB 1.5% slower and 5 MB 0.8% slower in one run each).
"""

FAST = dict(model="fastnet", width=64, whiten=True, identity_init=True, bn_weights=False, batch_size=512,
            epochs=12, lr=1.5, momentum=0.85, weight_decay=1.33e-3, norm_bias_lr=64, lr_start=0.2, lr_end=0.07,
            warmup=0.23, label_smoothing=0.2, crop_pad=2, flip="alternate", lookahead=5, tta=2, cuda_graph=True)

RESNET = dict(model="resnet18", batch_size=256, lr=0.2, cuda_graph=True, broadcast_buffers=False, bucket_cap_mb=10.0)
