"""A small GPT-style byte-level language model, in plain torch (the main job's model, not the library's).

Causal self-attention blocks with pre-LayerNorm and a GELU MLP; the output head is tied to the
token embedding, so the averager and the export see one tensor under two names.

Built to be cut and split the way large models are: the fused ``qkv`` projection lays out each
head's query, key and value together, so a column-wise tensor-parallel shard of it holds whole
heads (the block infers how many from its input); the blocks sit in a ``ModuleDict`` keyed by
their number, so a pipeline stage that deletes the others keeps the full model's names; and a
stage reads tokens or hidden states, and returns hidden states or logits, as ``first`` and
``last`` say (torchtitan's way).
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
        self.head_dim = config.dim // config.heads
        self.norm1, self.norm2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)  # per head: its query, key and value rows
        self.proj = nn.Linear(config.dim, config.dim)
        self.up = nn.Linear(config.dim, 4 * config.dim)
        self.down = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        heads = qkv.shape[-1] // (3 * self.head_dim)  # all of them, or this rank's under tensor parallel
        q, k, v = qkv.view(batch, length, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, heads * self.head_dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.dim % config.heads:
            raise ValueError(f"model.dim ({config.dim}) must be a multiple of model.heads ({config.heads})")
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.position = nn.Parameter(torch.zeros(config.context, config.dim))
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.first = self.last = True  # a pipeline stage: reads tokens (first), returns logits (last)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)
        nn.init.normal_(self.position, std=0.01)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-byte cross-entropy of ``targets`` given ``tokens`` (both ``[batch, length]``);
        without ``targets`` the logits (or, on a pipeline stage that is not the last, the hidden states)."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]] if self.first else tokens
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        logits = self.head(self.norm(x))
        return logits if targets is None else loss(logits, targets)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
