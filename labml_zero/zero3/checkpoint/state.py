r"""
---
title: What a resume needs
summary: The training state a checkpoint must hold for the next step after a load
  to compute exactly what the next step after the save would have.
---

# What a resume needs

A resume is *bit-exact* when, for every step $t$ after the save, the weights
$\theta_t$ of the resumed run equal those of the run that was never
interrupted, to the last bit. That needs every input of a step, each read out
beside its code below; whatever else the loop keeps (a loss scaler's state, the
data position) goes into `extra` (global) or `rank_extra` (per rank).
"""

from __future__ import annotations

import json
import random
from typing import Sequence

import numpy as np
import torch

from ..chunk import Chunk
from ..state_layout import ShardOptimizer
from .format import CheckpointError

__all__ = ["master_of", "model_shapes", "optimizer_state"]


# ## Describing the model


def model_shapes(chunks: Sequence[Chunk]) -> dict[str, tuple[int, ...]]:
    """Every parameter's qualified name and shape, in chunk order. Module
    buffers are not saved (the engine does not shard them); a model whose
    buffers are state (batch-norm statistics) must put them into `extra`."""
    shapes: dict[str, tuple[int, ...]] = {}
    for chunk in chunks:
        for name, param in zip(chunk.names, chunk.params):
            if name in shapes:
                raise CheckpointError(f"parameter name {name!r} appears twice in "
                                      "the model")
            shapes[name] = tuple(param.shape)
    return shapes


# ## The optimizer's state of a shard
#
# The bf16/fp16 parameters (the forward pass reads them), the fp32 masters (the
# update writes them), both moments, and each shard's step count $t$ (Adam's
# bias correction $1 - \beta^t$).


def optimizer_state(optimizer: ShardOptimizer | None, chunk: Chunk) -> dict | None:
    """The optimizer's state of a chunk's shard (each state of its
    [layout](../state_layout.html) by name), or `None` before its first step."""
    if optimizer is None or not chunk.trainable:
        return None
    return optimizer.shard_state(chunk.shard)


def master_of(optimizer: ShardOptimizer | None, chunk: Chunk) -> torch.Tensor | None:
    """
    #### The fp32 master of a shard, when it is not the shard itself

    The optimizer's, or before the first step the exact fp32 weights the engine
    kept for a bf16 or fp16 chunk (`master_init`).
    """
    if not chunk.trainable or chunk.dtype == torch.float32:
        return None
    state = optimizer_state(optimizer, chunk)
    if state is not None:
        # `None` for a layout without a master: the shard is the weight
        return state.get("master")
    return chunk.local.master_init


def weight_of(optimizer: ShardOptimizer | None, chunk: Chunk) -> torch.Tensor | None:
    r"""
    #### The fp32 weight training continues from, when it is not the shard

    The master (`master_of`), or for a layout that keeps a compensation
    instead ([Kahan summation](../../optimizers/kahan_summation.html)) the
    pair's sum $w + c$, as [the reader](reader.html) reads a saved one
    (its Note: the master of a compensated weight). `None`: the shard is the
    weight.
    """
    master = master_of(optimizer, chunk)
    if master is not None or chunk.dtype == torch.float32:
        return master
    state = optimizer_state(optimizer, chunk)
    compensation = None if state is None else optimizer.layout.compensation
    if compensation is None:
        return None
    shard = chunk.shard.detach()
    # [S] fp32, $w + c$; a host home's compensation comes to the shard's device
    return shard.float() + state[compensation.name].to(shard.device,
                                                       torch.float32)


# ## Hyperparameters
#
# A schedule may have changed them. The optimizer must be built the same way
# (same param groups, in order); its hyperparameters are restored from the
# manifest.


def group_hyperparameters(optimizer) -> list[dict] | None:
    """The param groups without their tensors, as JSON values."""
    if optimizer is None:
        return None
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        kept = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, tuple):
                value = list(value)
            try:
                json.dumps(value)
            except TypeError:
                raise CheckpointError(
                    f"optimizer group {index} hyperparameter {key!r} is a "
                    f"{type(value).__name__}, which a JSON manifest cannot hold"
                ) from None
            kept[key] = value
        groups.append(kept)
    return groups


def restore_groups(optimizer, groups: list[dict]) -> None:
    """Put saved hyperparameters back; JSON lists become tuples where they were.
    The optimizer must be built the same way (same param groups, in order)."""
    for group, saved in zip(optimizer.param_groups, groups):
        for key, value in saved.items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


# ## Random number generators
#
# The RNG states a step draws from: torch's CPU generator and this rank's CUDA
# one, Python's `random` and NumPy's global generator (dropout, sampling).


def rng_state(device: torch.device) -> dict:
    """Every RNG a training step may draw from, as `weights_only`-loadable values."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), position, has_gauss, gauss),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """The inverse of `rng_state`; the CUDA state only on a CUDA device."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position,
                         has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
