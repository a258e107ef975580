"""Data parallelism taken apart, for notebook 05. Everything here runs inside a rank.

- `hand_averaged_training`: split each batch across ranks, all-reduce the gradients
  by hand, step; returns what the kernel needs to compare with one process.
- `ddp_training`: the same with DistributedDataParallel.
- `ddp_timeline`: when do DDP's all-reduces run, relative to backward? (profiler)
- `no_sync_gradients`: gradient accumulation with and without `no_sync`.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def tiny_model(seed=0):
    """A small MLP; the same seed gives the same weights in every process."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def toy_batches(steps, batch=32, seed=1):
    """The same list of (inputs, targets) batches in every process."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def my_shard(tensor):
    """This rank's contiguous slice of a batch (batch size divisible by world size)."""
    return tensor.chunk(dist.get_world_size())[dist.get_rank()]


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def single_process_training(steps, lr=0.1):
    """The baseline: one process, whole batches. Returns (first gradients, final parameters)."""
    model, first = tiny_model(), None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in toy_batches(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        first = flat_grads(model) if first is None else first
        optimizer.step()
    return first, flat_params(model)


def average_gradients(model):
    """The heart of data parallelism: every rank ends with the mean of all ranks' gradients."""
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= dist.get_world_size()


def hand_averaged_training(steps, lr=0.1, average=average_gradients):
    """Each rank trains on its shard of every batch, averaging gradients with `average`."""
    model, first = tiny_model(), None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in toy_batches(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(my_shard(x)), my_shard(y)).backward()
        average(model)
        first = flat_grads(model) if first is None else first
        optimizer.step()
    return first, flat_params(model)


def ddp_training(steps, lr=0.1):
    """The same with DDP. Ranks other than 0 start from *different* weights: DDP broadcasts
    rank 0's weights when it wraps the model, so that does not matter."""
    rank = dist.get_rank()
    model = DDP(tiny_model(seed=0 if rank == 0 else 100 + rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    first = None
    for x, y in toy_batches(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(my_shard(x)), my_shard(y)).backward()
        first = flat_grads(model) if first is None else first
        optimizer.step()
    return first, flat_params(model)


def ddp_timeline(bucket_cap_mb, layers=8, width=512):
    """Profile one DDP backward pass; return the backward window and each all-reduce's
    start and end, in ms from the start of backward."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]), bucket_cap_mb=bucket_cap_mb)
    x = torch.randn(64, width)
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration
        model(x).sum().backward()
    loss = model(x).sum()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    events = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()]
    backward = [(s, e) for name, s, e in events if name.startswith("autograd::engine::evaluate_function")]
    start, end = min(s for s, _ in backward), max(e for _, e in backward)
    reduces = sorted((s - start, e - start) for name, s, e in events if name == "gloo:all_reduce")
    return {"backward_ms": end - start, "all_reduces_ms": reduces, "bucket_cap_mb": bucket_cap_mb,
            "parameters_mb": sum(p.numel() * 4 for p in model.parameters()) / 2**20}


def no_sync_gradients(micro_batches=2):
    """Accumulate gradients over micro-batches: inside `no_sync` DDP skips the all-reduce,
    so ranks' gradients differ until the last micro-batch, which syncs the accumulated sum."""
    model = DDP(tiny_model())
    batches = toy_batches(micro_batches)
    with model.no_sync():
        for x, y in batches[:-1]:
            nn.functional.cross_entropy(model(my_shard(x)), my_shard(y)).backward()
    inside = flat_grads(model).clone()
    x, y = batches[-1]
    nn.functional.cross_entropy(model(my_shard(x)), my_shard(y)).backward()
    return inside, flat_grads(model)
