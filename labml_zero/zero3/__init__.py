r"""
---
title: The engine (zero3)
summary: The ZeRO-3 engine's package, its pages in reading order.
---

# The engine

The engine's overview is the first page of the core path,
[ZeRO-3 in six pages](../index.html); this package holds the engine itself,
its pages below in reading order. [The step as one CUDA
graph](../optimizers/graphed_step.html) needs the optimizer's captured updates,
so its page is with the optimizers'.
"""

# The engine's public API, re-exported here: `ZeroConfig`, `shard_model`,
# `Zero3Sequential`, `save_checkpoint` and `load_checkpoint` above all.
from .checkpoint import (CheckpointError, export_full_state_dict, load_checkpoint,
                         save_checkpoint)
from .config import ZeroConfig
from .sharded_model import (
    ShardedModel,
    Zero3Layer,
    Zero3Sequential,
    shard_model,
    zero3_layers,
)

__all__ = [
    "ZeroConfig",
    "save_checkpoint",
    "load_checkpoint",
    "export_full_state_dict",
    "CheckpointError",
    "Zero3Layer",
    "Zero3Sequential",
    "ShardedModel",
    "shard_model",
    "zero3_layers",
]
