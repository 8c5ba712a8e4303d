r"""
---
title: ZeRO-3 with chunks
summary: Parameters, gradients and optimizer states sharded over ranks in flat chunks.
---

# ZeRO-3 with chunks

Data-parallel training keeps a full copy of the *model states* on every one of
the $N_d$ data-parallel ranks. With mixed-precision Adam that is, per parameter,
2 bytes of bf16 weight, a gradient, and $K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes of optimizer state
(fp32 master, two fp32 moments). [ZeRO](https://arxiv.org/abs/1910.02054)
(stage 3, "Zero-DP $P_{os+g+p}$") shards all three over the ranks, so each holds

$$\frac{(2 + 4 + K)\,\Psi_t + 2\,\Psi_f}{N_d}$$

bytes for $\Psi_t$ trainable and $\Psi_f$ frozen parameters, and gathers the
parameters of a layer only while the layer computes. Two departures from the
paper's accounting, both deliberate: the shard gradient is fp32 (4 bytes, not
2: it is averaged in fp32 and accumulates across micro-batches without
rounding), so a trainable parameter costs 18
(tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
bytes, not 16
(tested: tests/zero3/test_memory_model.py::test_zero_model_states_is_the_paper_formula)
, over
$N_d$; and a
frozen parameter (fine-tuning a subset) costs only its bf16 shard. The cost
of sharding is communication: a step gathers the parameters for forward,
again for backward (except those that stay gathered or need no backward), and
reduces the gradients once.

This engine shards in *chunks* (ColossalAI's Gemini): parameters are packed, in
execution order, into flat buffers of one size, and a chunk is what is
gathered, released and reduced as one tensor. A {{term: unit}} is a layer
whose chunks the hooks gather and release together.

## A step, in one picture

Each rank keeps one shard of every chunk. Before a unit computes, an
{{term: all-gather}} fills the chunk's full buffer on every rank from all the
shards; after backward, a {{term: reduce-scatter}} sums the ranks' full
gradients and leaves each rank the slice of its own shard:

![shards, all-gather and reduce-scatter on 2 to 4 ranks](figures/shard_collectives.svg)

Forward, unit by unit: gather, compute, release. Backward, in reverse: gather,
compute gradients, reduce-scatter them, release. The next units' gathers run on
a side stream, the {{term: gather stream}}, while the current one computes (how
many units ahead is the {{term: prefetch depth}}), and the reductions on another,
in the {{term: reduce dtype}}, as one measured step shows:

![one training step on its streams](figures/step_timeline.svg)

## Where the chapter leads

The pages of this folder follow below in reading order, from the memory formula
to the sharded model, then checkpoints, then the advanced chapters (chunk-size
search, {{see: placement}}, {{see: peer memory}}, compiled layers). Between the
sharded model and the checkpoints the book turns to
[AdamFP16](../optimizers/adam_fp16.html), the optimizer on the shards, and the
training features ([clipping](../optimizers/clip_grad.html),
[loss scaling](../optimizers/grad_scaler.html)); after the checkpoints to
[GPT-NeoX](../neox/index.html) and [the fine-tune](../neox/finetune.html).
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
