"""Reference solutions to the "Try it" exercises (peek only after trying!)."""
import time

import torch
import torch.distributed as dist


def my_square():
    """Notebook 00: this rank's number, squared."""
    return dist.get_rank() ** 2


def parity_group_sum():
    """Notebook 01: sum of the ranks that share this rank's parity."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # new_group is collective: every rank creates every group, in the same order.
    evens = dist.new_group(list(range(0, world_size, 2)))
    odds = dist.new_group(list(range(1, world_size, 2)))
    mine = evens if rank % 2 == 0 else odds
    total = torch.tensor([rank])
    dist.all_reduce(total, group=mine)
    return int(total.item())


def my_all_gather(t):
    """Notebook 02: every rank's tensor, in rank order, from point-to-point calls.
    Each rank posts all its sends and receives at once, so no ordering can deadlock."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = [t.clone() if r == rank else torch.empty_like(t) for r in range(world_size)]
    ops = []
    for peer in range(world_size):
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, t, peer))
            ops.append(dist.P2POp(dist.irecv, gathered[peer], peer))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    return gathered


def tree_broadcast(t):
    """Notebook 02: rank 0's tensor to everyone along a binomial tree: in round k,
    every rank that already has the data (ranks below 2**k) sends it to rank + 2**k.
    log2(world_size) rounds instead of world_size - 1 sends from rank 0."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    t = t.clone()
    step = 1
    while step < world_size:
        if rank < step and rank + step < world_size:
            dist.send(t, dst=rank + step)
        elif step <= rank < 2 * step:
            dist.recv(t, src=rank - step)
        step *= 2
    return t


def ring_all_reduce(t):
    """Notebook 03: SUM all-reduce as reduce-scatter then all-gather around a ring.
    torch.tensor_split makes n chunks even when n does not divide the length."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = list(torch.tensor_split(t.clone(), world_size))

    def pass_along(send_index, recv_index):
        incoming = torch.empty_like(chunks[recv_index])
        ops = [dist.P2POp(dist.isend, chunks[send_index], right), dist.P2POp(dist.irecv, incoming, left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return incoming

    for step in range(world_size - 1):  # reduce-scatter: afterwards rank r owns the sum of chunk r+1
        i = (rank - step - 1) % world_size
        chunks[i] += pass_along((rank - step) % world_size, i)
    for step in range(world_size - 1):  # all-gather: the summed chunks go round once more
        i = (rank - step) % world_size
        chunks[i] = pass_along((rank - step + 1) % world_size, i)
    return torch.cat(chunks)


def my_all_reduce_time(nbytes, iters=20, warmup=5):
    """Notebook 04: seconds per dist.all_reduce of `nbytes` bytes of float32, the mean over the ranks,
    timed as nccl-tests times it. Run on every rank."""
    t = torch.ones(nbytes // 4)
    for _ in range(warmup):         # 1. warm up: the first calls pay one-time costs, untimed
        dist.all_reduce(t)
    dist.barrier()                  # 2. start together: nobody times a wait for a late peer
    start = time.perf_counter()
    for _ in range(iters):          # 3. many calls between two readings of the clock
        dist.all_reduce(t)
    seconds = (time.perf_counter() - start) / iters
    mean = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(mean)           # 4. the mean over the ranks: their sum, divided by their number
    return mean.item() / dist.get_world_size()


def predicted_us(nbytes, alpha_us, beta_GBps):
    """Notebook 04: the alpha-beta model's time for one call of `nbytes` bytes, in µs:
    t = alpha + S / beta, where beta in GB/s is beta * 1e3 bytes per µs."""
    return alpha_us + nbytes / (beta_GBps * 1e3)


def average_gradients_one_bucket(model):
    """Notebook 05: the mean of every gradient over all ranks with ONE all_reduce: flatten every
    gradient into one buffer (a single bucket), all-reduce it, divide, copy each slice back.
    (torch._utils._flatten_dense_tensors / _unflatten_dense_tensors do the same flattening.)"""
    grads = [p.grad for p in model.parameters()]
    bucket = torch.cat([g.flatten() for g in grads])  # a new tensor: a copy of every gradient
    dist.all_reduce(bucket, op=dist.ReduceOp.SUM)
    bucket /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(bucket[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def steps_per_epoch(n_images, batch_per_rank, world_size):
    """Notebook 06: DistributedSampler gives each rank ceil(n / world_size) indices (padding by
    repeating a few), and the training loader drops the incomplete last batch."""
    per_rank = -(-n_images // world_size)
    return per_rank // batch_per_rank


# Notebook 11: the same command on both nodes; the agents meet at node01:29500 and number the nodes.
torchrun_command = ("torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node01:29500 "
                    "--max-restarts=3 -m ddp_helpers.train --checkpoint 'ckpt/epoch-{epoch}.pt' --resume auto")


def mean_loss(loss):
    """Notebook 12: every rank joins the all_reduce (a collective inside `if rank == 0` hangs the others);
    only the print is rank 0's."""
    t = torch.tensor([float(loss)])
    dist.all_reduce(t)
    t /= dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"mean loss {t.item():.3f}")
    return t.item()


def fp16_compress(state, bucket):
    """Notebook 07: a DDP comm hook that averages a bucket in float16 (half the bytes of float32).
    Dividing before the all-reduce keeps the sum inside float16's range (largest value 65504)."""
    buffer = bucket.buffer()
    compressed = (buffer / dist.get_world_size()).to(torch.float16)
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])   # back to float32, into DDP's bucket
        return buffer

    return fut.then(decompress)


def exact_accuracy(correct, n_images):
    """Notebook 06: the accuracy over all n_images test images, on every rank, from this rank's
    DistributedSampler share. Rank r's j-th sample sits at position r + j * world_size of the
    sampler's padded order; positions from n_images on repeat the first images, so they are not
    counted. One all_reduce (SUM) of both counts: every rank gets the exact figure."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    real = rank + world_size * torch.arange(len(correct)) < n_images   # the padding: False
    counts = torch.tensor([correct[real].sum().item(), real.sum().item()], dtype=torch.float64)
    dist.all_reduce(counts)   # ReduceOp.SUM: (right, scored) over all ranks
    return (counts[0] / counts[1]).item()


# ---- Notebook 00 --------------------------------------------------------------------------------

def slowest_rank(seconds):
    """Notebook 00: the largest time of all ranks and the rank that measured it (the lowest such rank
    on a tie), on every rank. Two all_reduces of one number each: MAX of the times, then MIN of the
    rank numbers of the ranks that hold that time (world_size, larger than any rank, for the others)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    slowest = seconds.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    who = torch.tensor([rank if bool(seconds == slowest) else world_size])
    dist.all_reduce(who, op=dist.ReduceOp.MIN)
    return slowest.item(), int(who.item())


# ---- Notebook 08 --------------------------------------------------------------------------------

def solution_shard(full, rank, world_size):
    """Notebook 08: this rank's padded dim-0 shard, as FSDP2 stores it."""
    rows = -(-full.shape[0] // world_size)                       # ceil: the size of every rank's shard
    shard = torch.zeros((rows,) + tuple(full.shape[1:]), dtype=full.dtype)
    mine = full[rank * rows:(rank + 1) * rows]                   # what torch.chunk gives this rank (maybe 0 rows)
    shard[:len(mine)] = mine
    return shard


def solution_reassemble(shard, rows):
    """Notebook 08: the full tensor from ONE all-gather of every rank's padded shard, padding dropped."""
    out = torch.empty((shard.shape[0] * dist.get_world_size(),) + tuple(shard.shape[1:]), dtype=shard.dtype)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # by torch version
    all_gather_single(out, shard)                                # every rank's padded shard, in rank order
    return out[:rows]                                            # drop the padding at the end


# ---- Notebook 09 --------------------------------------------------------------------------------

def row_parallel(x_shard, w_shard, bias, sequence_parallel):
    """Notebook 09: a row-parallel linear layer's forward. Each rank multiplies its slice of the input
    features by the same columns of the weight: a partial sum of the whole output. Tensor parallelism
    adds the partial sums with one all-reduce; sequence parallelism with one reduce-scatter along the
    tokens (dim 1), so each rank keeps only its block of tokens. The bias is added once, after."""
    partial = x_shard @ w_shard.T                                  # (batch, tokens, out): a partial sum
    if not sequence_parallel:
        dist.all_reduce(partial)                                   # the sum, on every rank
        return partial + bias
    n = dist.get_world_size()
    by_tokens = partial.transpose(0, 1).contiguous()       # tokens first: reduce-scatter splits dim 0
    mine = torch.empty_like(by_tokens.chunk(n)[0])
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(mine, by_tokens)                        # the sum of MY block of tokens
    return mine.transpose(0, 1) + bias


# ---- Notebook 10 --------------------------------------------------------------------------------

def one_f_one_b(forward, backward, m, rank, p):
    """Notebook 10: the 1F1B order on stage `rank` of `p`. Warm-up: p - rank - 1 forwards (the
    last stage none), enough to fill the pipeline behind this stage; then one forward, one backward
    until every forward has run; then the remaining backwards. At most p - rank micro-batches'
    activations are held at once (GPipe: all m)."""
    warmup = min(m, p - rank - 1)
    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)


# ---- Notebook 13 --------------------------------------------------------------------------------

def dispatch(x, expert, n_experts):
    """Notebook 13: send each kept choice's token to the rank of its expert (rank r holds experts
    r*m ... r*m+m-1), and return them grouped by expert. Sorted by expert, the rows for rank j are one
    block; the counts go first (one all-to-all of a few integers), so each rank knows how many rows each
    rank sends it for each of its experts; then one all_to_all_single moves the rows, with uneven
    splits. They arrive by source rank, then expert: block (s, e) holds from_each[s, e] rows. Taking the
    blocks expert by expert gives each expert's rows as one block (as a grouped matrix multiply takes
    them), each source rank's in turn, in token order. Returns those rows and what combine needs."""
    n = dist.get_world_size()
    m = n_experts // n                                           # experts per rank
    token, slot = (expert >= 0).nonzero(as_tuple=True)           # the kept choices, in token order
    order = expert[token, slot].argsort(stable=True)             # sorted by expert, so by rank
    token, slot = token[order], slot[order]
    counts = torch.bincount(expert[token, slot], minlength=n_experts)
    from_each = torch.empty_like(counts)
    dist.all_to_all_single(from_each, counts)                    # [source rank s, my expert e], flat
    in_splits = counts.view(n, m).sum(1).tolist()                # rows to each rank
    out_splits = from_each.view(n, m).sum(1).tolist()            # rows from each rank
    arrived = x.new_empty(sum(out_splits), x.shape[1])
    dist.all_to_all_single(arrived, x[token], out_splits, in_splits)    # by source rank, then expert
    blocks = torch.arange(len(arrived)).split(from_each.tolist())       # the positions of block (s, e)
    by_expert = torch.cat([blocks[s * m + e] for e in range(m) for s in range(n)])
    return arrived[by_expert], (token, slot, in_splits, out_splits, by_expert)


def combine(y, weight, state):
    """Notebook 13: the experts' outputs, given in dispatch's order (by expert), go back into the order
    their rows arrived (by source rank), then home with the dispatch's splits swapped; each token's
    output is the sum of its kept choices' outputs, each times its router weight (0 for a token whose
    every choice was dropped: the residual connection carries it)."""
    token, slot, in_splits, out_splits, by_expert = state
    arrived = torch.empty_like(y)
    arrived[by_expert] = y                                       # y[i]: the row that arrived by_expert[i]-th
    back = y.new_empty(sum(in_splits), y.shape[1])
    dist.all_to_all_single(back, arrived, in_splits, out_splits)
    out = torch.zeros(weight.shape[0], y.shape[1], dtype=y.dtype)
    return out.index_add(0, token, weight[token, slot, None] * back)
