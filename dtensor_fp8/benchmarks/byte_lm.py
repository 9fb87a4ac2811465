"""The convergence benchmark's model: a byte-level decoder-only language model built from
``linear_step``'s :class:`~dtensor_fp8.benchmarks.linear_step.Block` (the same four ``nn.Linear``
weights per block, ``qkv``, ``proj``, ``fc1``, ``fc2``, so the FP8 rows quantize what
``linear_step`` times), with rotary position embeddings (RoPE) on the queries and keys.

Why RoPE and not learned absolute positions (the first version): with learned positions
initialized at random, attention has no usable position signal at the start, so every run sat on
a loss plateau at about the bigram level (~2.4 nats/byte) for a few hundred steps and left it at a
step that varied from run to run (and between eager and compiled runs of one seed): the final loss
measured when a run escaped, not what FP8 did to it. Relative positions built into the attention
scores let previous-byte heads form at once, and the curve falls without that plateau.

Example:
    >>> from dtensor_fp8.benchmarks.shapes import PRESETS
    >>> lm = ByteLM(PRESETS["toy"]); lm.init_weights(seed=0)
    >>> lm(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .linear_step import Block
from .shapes import ModelShape

VOCAB = 256
ROPE_BASE = 10_000.0


def rotary_tables(seq: int, head_dim: int, device=None) -> torch.Tensor:
    """``(2, seq, head_dim / 2)`` float32: the cosines and sines of RoPE's angles ``pos * base^(-2i/d)``."""
    inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()]).float()


def apply_rotary(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(batch, heads, seq, head_dim)`` by the angles of ``tables`` (rotate-half form)."""
    cos, sin = (t[: x.shape[-2]].to(x.dtype) for t in tables)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RotaryBlock(Block):
    """:class:`Block` with RoPE on the queries and keys; ``forward(x, tables)``, ``x`` ``(seq, batch,
    hidden)``; ``tables=None``: no rotation (positions come from the input)."""

    def forward(self, x, tables=None):
        sh = self.shape
        s, b, h = x.shape
        d, kv = sh.head_dim, sh.kv_heads * sh.head_dim
        q, k, v = self.qkv(self.ln1(x)).split([h, kv, kv], dim=-1)
        q = q.reshape(s, b, sh.heads, d).permute(1, 2, 0, 3)
        k = k.reshape(s, b, sh.kv_heads, d).permute(1, 2, 0, 3)
        if tables is not None:
            q, k = apply_rotary(q, tables), apply_rotary(k, tables)
        v = v.reshape(s, b, sh.kv_heads, d).permute(1, 2, 0, 3)
        groups = sh.heads // sh.kv_heads
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))  # GQA: KV heads repeated (HF's repeat_kv)
        return self.attention_and_mlp(x, q, k, v)


POSITIONS = ("rope", "learned")


class ByteLM(nn.Module):
    """Byte embedding -> ``shape.layers`` x :class:`RotaryBlock` -> RMSNorm -> output head;
    ``tokens (batch, seq) -> logits (batch, seq, 256)``, fp32 parameters. ``positions="learned"``:
    the first version's learned absolute positions added to the embedding, no RoPE (to show the
    plateau it had)."""

    def __init__(self, shape: ModelShape, device="cpu", positions: str = "rope"):
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"ByteLM: positions must be one of {POSITIONS}, got {positions!r}")
        self.embed = nn.Embedding(VOCAB, shape.hidden, device=device)
        self.pos = nn.Embedding(shape.seq, shape.hidden, device=device) if positions == "learned" else None
        self.layers = nn.ModuleList(RotaryBlock(shape, device, torch.float32) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden, device=device)
        self.head = nn.Linear(shape.hidden, VOCAB, bias=False, device=device)
        tables = rotary_tables(shape.seq, shape.head_dim) if str(device) != "meta" else torch.empty(2, shape.seq, shape.head_dim // 2)
        self.register_buffer("rope", tables.to(device), persistent=False)

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) matrices, the projections into the residual stream 0.02 / sqrt(2 layers)
        (GPT-2's), norms at 1; from a CPU generator seeded with ``seed``: the same values on every
        device and in every row of one seed."""
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * len(self.layers))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = residual_std if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                    p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos.weight[: tokens.shape[1]]
        x = x.transpose(0, 1)  # Block's layout: (seq, batch, hidden)
        tables = self.rope if self.pos is None else None
        for layer in self.layers:
            x = layer(x, tables)
        return self.head(self.norm(x.transpose(0, 1)))  # not a view: FSDP2's backward hook stays on it
