r"""
---
title: What trains
summary: Marking parameters trainable or frozen before the engine shards them, and
  counting the trainable elements that carry gradients and optimizer state.
---

# What trains

The engine packs trainable and frozen parameters into different chunks (see
[chunk layout](chunk_layout.html)), so what trains must be decided before the
layers are sharded: a function of the layers that sets `requires_grad` on each
parameter and returns the counts

$$\Psi_t = \sum_{p \,:\, \text{trainable}} |p|, \qquad \Psi = \sum_p |p|$$

that the memory model reads. Such a function is a *fine-tuner*; the model's own
ones (GPT-NeoX's biases, MLPs, LoRA) are [its fine-tuners](../neox/finetuners.html),
built on `mark_trainable` below, and [the assembly](../assembly.html) calls
whichever it is given.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from torch import nn

# Nothing here knows a model: the assembly and each model's fine-tuners import
# these from below, and a model's fine-tuner is any function of this shape.
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
    (e.g. `attention.dense.bias`). Works on meta-device layers too.
    """
    trainable = total = 0
    for layer in layers:
        for name, p in layer.named_parameters():
            p.requires_grad_(is_trainable(layer, name))
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    return TrainableCount(trainable, total)


def train_all(layers: Sequence[nn.Module]) -> TrainableCount:
    """### The fine-tuner that trains every parameter (the assembly's default)"""
    return mark_trainable(layers, lambda layer, name: True)
