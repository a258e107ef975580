"""A tiny decoder-only transformer (GPT-style) for notebooks 09 and 10, small enough for a 2-core
laptop.

    cfg = Config()                       # 2 blocks, width 32, 4 heads, 16 tokens, 64 symbols
    model = TinyTransformer(cfg)         # about 30 thousand parameters
    tokens, targets = batch(cfg, batch_size=8, seed=0)
    loss = model.loss(tokens, targets)

Every piece a parallelism technique splits is a module of its own, with the names that
`torch.distributed.tensor.parallel` plans use: attention's `q`, `k`, `v` and `out`, the MLP's
`up` and `down`. Attention reads the number of heads from its input's width (`-1` below), so
the same code runs on a rank that holds only some of the heads (tensor parallelism).

The task: each sequence counts up in steps of its own size, modulo `vocab`
(for example 5, 8, 11, 14, ...). Predicting the next symbol means reading the step
from the earlier ones, which takes attention; a loss that falls shows the model learning.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Config:
    vocab: int = 64      # symbols
    seq_len: int = 16    # tokens per sequence
    dim: int = 32        # width of the residual stream
    heads: int = 4       # attention heads (dim // heads = 8 features each)
    layers: int = 2      # transformer blocks
    hidden: int = 128    # MLP width (4 x dim)


class Attention(nn.Module):
    """Causal multi-head self-attention: q, k, v projections, softmax(q k^T / sqrt(d)) v, and the
    output projection `out`."""

    def __init__(self, cfg):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):                                     # x: (batch, tokens, dim)
        b, t, _ = x.shape
        def heads(y):                             # (b, t, h * head_dim) -> (b, h, t, head_dim)
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Two linear layers with a GELU between: dim -> hidden -> dim."""

    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(cfg.dim), Attention(cfg)
        self.norm2, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and a linear head to the
    vocabulary."""

    def __init__(self, cfg=None, seed=0):
        super().__init__()
        cfg = cfg or Config()
        self.cfg = cfg
        torch.manual_seed(seed)                  # same seed, same weights on every rank
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def embed(self, tokens):                     # (batch, tokens) -> (batch, tokens, dim)
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))

    def forward(self, tokens):                                # -> logits (batch, tokens, vocab)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens, targets):
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(cfg=None, batch_size=8, seed=0):
    """`batch_size` sequences of the counting task, and their targets (the same shifted by one
    token)."""
    cfg = cfg or Config()
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(cfg.vocab, (batch_size, 1), generator=g)
    step = torch.randint(1, 8, (batch_size, 1), generator=g)
    seq = (start + step * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    # Each its own contiguous tensor: torch 2.11's pipelining refuses a stage input whose strides
    # differ from the shape's own (a slice of `seq` has rows of seq_len + 1).
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
