"""A small GPT-style byte-level language model, in plain torch (the main job's model, not the library's).

Causal self-attention blocks with pre-LayerNorm and a GELU MLP; the output head is tied to the
token embedding, so the averager and the export see one tensor under two names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes


@dataclass
class GPTConfig:
    dim: int
    layers: int
    heads: int
    context: int


class Block(nn.Module):
    """One transformer block: the unit every engine wraps or shards on its own."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1, self.norm2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.up = nn.Linear(config.dim, 4 * config.dim)
        self.down = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.dim % config.heads:
            raise ValueError(f"model.dim ({config.dim}) must be a multiple of model.heads ({config.heads})")
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.position = nn.Parameter(torch.zeros(config.context, config.dim))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)
        nn.init.normal_(self.position, std=0.01)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy of ``targets`` given ``tokens`` (both ``[batch, length]``)."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
