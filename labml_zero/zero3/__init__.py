r"""
---
title: ZeRO-3 with chunks
summary: Parameters, gradients and optimizer states sharded over ranks in flat chunks.
---

# ZeRO-3 with chunks

Data-parallel training keeps a full copy of the model states on every rank. With
mixed-precision Adam that is, per parameter, 2 bytes of 16-bit weight, 2 of
gradient and $K = 12$ of optimizer state (fp32 master, two fp32 moments):
$(2 + 2 + K)\Psi$ bytes for $\Psi$ parameters, 16 bytes each, 112 GB for a 7B model.
[ZeRO](https://arxiv.org/abs/1910.02054) (stage 3, "Zero-DP $P_{os+g+p}$") shards all
three over the $N_d$ data-parallel ranks, so each holds

$$\frac{(2 + 2 + K)\Psi}{N_d}$$

and gathers the parameters of a layer only while the layer computes. The cost is
communication: every step all-gathers the parameters twice (forward and backward)
and reduce-scatters the gradients once, $3\Psi$ against DDP's $2\Psi$.

This engine shards in *chunks* (ColossalAI's Gemini): parameters are packed, in
execution order, into flat buffers of one size, and a chunk is the unit of
gathering, releasing and gradient reduction.

Two departures from the paper's accounting, both deliberate: the shard gradient is
fp32 (4 bytes, not 2: it is averaged in fp32 and accumulates across micro-batches
without rounding), so a trainable parameter costs $\frac{2 + 4 + 12}{N_d}$ bytes
from the reduce-scatter until `zero_grad`; and frozen parameters (fine-tuning a
subset) cost only their 16-bit shard, $\frac{2}{N_d}$ bytes: no gradient, no
master, no moments. `tests/zero3/test_memory_and_comm.py` counts the real tensors
against these formulas.

## A step, in one picture

Forward, layer by layer: gather → compute → release. Backward, in reverse:
gather → compute gradients → reduce-scatter them → release. The next layer's
gather runs on a side stream while the current one computes.

## Pages, in reading order

* [Chunk layout](chunk_layout.html): which parameter goes where; pure arithmetic.
* [Chunk-size search](chunk_search.html): choosing the chunk size.
* [Memory model](memory_model.html): the bytes, analytically.
* [Placement](placement.html): which chunks keep optimizer states (or parameter
  shards) in host memory, or stay gathered, and the bytes that moves.
* [Communication](communication.html): the collectives and streams.
* [Chunk](chunk.html): a chunk's tensors and lifecycle.
* [Hooks and schedule](hooks.html): when chunks are gathered, released and reduced.
* [Configuration](config.html): the knobs.
* [Sharding a model](sharded_model.html): `Zero3Layer`, `Zero3Sequential`,
  `shard_model`.
* [Compiling sharded layers](compiled.html): `torch.compile` inside the hooks.
* [Checkpoints](checkpoint/index.html): saving, resuming and resharding, the
  format and its digests, checks before a job starts, pruning, and exporting
  the whole model.
"""

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
