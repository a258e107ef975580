"""A minimal DDP training script for CIFAR-10. Start it with torchrun, one process per device:
    torchrun --standalone --nproc-per-node=2 examples/ddp_minimal.py --epochs 2
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddp_helpers import data, models

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)  # per rank: global batch = this x ranks
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--per-class", type=int, default=100)  # training images of each class
parser.add_argument("--checkpoint", default="ddp_minimal.pt")
args = parser.parse_args()

# 1. Setup: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):   # a GPU for each process
    torch.cuda.set_device(local_rank)            # this process's GPU, before anything uses it
    device, backend = torch.device("cuda", local_rank), "nccl"
else:
    device, backend = torch.device("cpu"), "gloo"
dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)  # env://
rank, world_size = dist.get_rank(), dist.get_world_size()

# 2. The model: the same seed everywhere; DDP also broadcasts rank 0's weights when it wraps
torch.manual_seed(0)
model = models.build_model("fastnet", width=16).to(device)
model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

# 3. The data: rank r takes every world_size-th image of one shuffled order
train_set = data.Images(data.load_cifar10(True, per_class=args.per_class))
sampler = DistributedSampler(train_set, shuffle=True, seed=0)
loader = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True)
test_set = data.Images(data.load_cifar10(False, per_class=50))
test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), 250)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

for epoch in range(args.epochs):
    model.train()
    sampler.set_epoch(epoch)                     # a new shuffle each epoch, the same on all ranks
    for images, labels in loader:
        images, labels = data.normalize(images.to(device)), labels.to(device)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()                          # DDP averages the gradients over ranks here
        optimizer.step()
    # 4. Metrics: every rank scores its share of the test set, one all_reduce sums the counts
    model.eval()
    for buffer in model.module.buffers():        # BatchNorm statistics: use rank 0's everywhere
        dist.broadcast(buffer, src=0)
    counts = torch.zeros(2, device=device)       # (right answers, images)
    with torch.no_grad():
        for images, labels in test_loader:
            predicted = model(data.normalize(images.to(device))).argmax(1).cpu()
            counts += torch.tensor([(predicted == labels).sum(), len(labels)], device=device)
    dist.all_reduce(counts)                      # SUM: the same numbers on every rank
    # 5. Checkpoint: rank 0 writes (all ranks hold the same weights); the others wait
    if rank == 0:
        print(f"epoch {epoch + 1}: loss {loss.item():.3f} (rank 0's last batch), "
              f"test accuracy {counts[0] / counts[1]:.1%}", flush=True)
        torch.save(model.module.state_dict(), args.checkpoint)
    dist.barrier()

dist.destroy_process_group()
