r"""
---
title: What trains
summary: Marking parameters trainable or frozen before the engine shards them, and
  counting the trainable elements that carry gradients and optimizer state.
---

# What trains

What trains must be decided before the layers are sharded: trainable and frozen
parameters go to different chunks (see [chunk layout](chunk_layout.html)). A
*fine-tuner* sets `requires_grad` and returns the counts the memory model reads,

$$\Psi_t = \sum_{p \,:\, \text{trainable}} |p|, \qquad \Psi = \sum_p |p|$$
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from torch import nn

# Nothing here knows a model: [the assembly](../assembly.html) calls any
# fine-tuner, and a model's own ones (GPT-NeoX's
# [fine-tuners](../neox/finetuners.html)) build on `mark_trainable`.
__all__ = ["TrainableCount", "mark_trainable", "train_all"]


class TrainableCount(NamedTuple):
    trainable: int
    r"""Parameters (elements) with `requires_grad`: $\Psi_t$."""
    total: int
    r"""All parameters (elements): $\Psi$."""


def mark_trainable(layers: Sequence[nn.Module],
                   is_trainable: Callable[[nn.Module, str], bool]) -> TrainableCount:
    """
    ### Set `requires_grad` on every parameter of every layer

    `is_trainable(layer, name)` decides, with `name` relative to the layer
    (e.g. `attention.dense.bias`). Works on meta-device layers too. A
    parameter of two layers (a tied embedding) is decided and counted once, by
    the first layer that has it, which owns it in `zero3_layers` (see Note: a
    parameter of two layers, in [sharding a model](sharded_model.html)).
    """
    trainable = total = 0
    seen: set[int] = set()
    for layer in layers:
        for name, p in layer.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            p.requires_grad_(is_trainable(layer, name))
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    return TrainableCount(trainable, total)


def train_all(layers: Sequence[nn.Module]) -> TrainableCount:
    """### The fine-tuner that trains every parameter (the assembly's default)"""
    return mark_trainable(layers, lambda layer, name: True)
