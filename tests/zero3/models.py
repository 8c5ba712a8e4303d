"""Tiny models with odd sizes, so every chunk has padding.

Shared by the engine tests.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def tiny_layers(seed: int = 0, *, freeze: bool = True) -> list[nn.Module]:
    """Input projection, three blocks, readout; some parameters frozen.

    The second block mixes frozen and trainable parameters (its `up.weight` is frozen,
    `up.bias` is not), as bias-only fine-tuning does.
    """
    torch.manual_seed(seed)
    layers = [
        nn.Linear(7, 13), Block(13, 29), Block(13, 31), Block(13, 17), nn.Linear(13, 5)
    ]
    if freeze:
        layers[2].up.weight.requires_grad_(False)
        layers[2].norm.requires_grad_(False)
        layers[3].requires_grad_(False)
    return layers


# `terms` of `tiny_layers` for `tests/tolerance.py`: the input projection (7),
# each block's norm, up and down (13 + 13 + hidden: 55 + 57 + 43), the readout
# (13) and the loss's mean over at most 12 rows of 5 outputs (60): 248 forward,
# as many backward, and a weight's gradient sums over the 12 rows.
TINY_TERMS = 2 * 248 + 12


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank; ranks take their rows."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 7, generator=g), torch.randn(rows, 5, generator=g)
