r"""
---
title: ZeRO-3 in six pages
summary: What is sharded and what a rank holds, one step in one picture, and the
  five pages that make it precise.
---

# ZeRO-3 in six pages

Data parallelism over $N_d$ ranks keeps a full copy of the {{term: model
states}} on every rank: for each parameter trained with mixed-precision Adam,
$2$ bytes of bf16 parameter, $4$ of fp32 gradient and $K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes of optimizer state (the fp32 {{see: master weights}} and Adam's two moments).
ZeRO-3 cuts all three into $N_d$ {{term: shards | shard}}, one per rank, and
gathers a layer's parameters only while it computes. With $\Psi_t$ trainable
and $\Psi_f$ frozen parameters a rank holds

$$\frac{(2 + 4 + K)\,\Psi_t + 2\,\Psi_f}{N_d}$$

bytes of model states
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step).
The parameters are packed, in execution order, into flat {{term: chunks |
chunk}}, each layer's into chunks of their own, its {{term: group}}, so that
each collective moves one large buffer; every rank keeps one shard of every
chunk. A {{term: unit}} is a wrapped layer whose chunks are gathered and
released together; the parameters of no wrapped layer form the
{{term: root unit}}, gathered for the whole step.

## A step in one picture

Before a unit computes, an {{term: all-gather}} fills its chunks' full buffers
from the ranks' shards, freed again after it. Freeing resizes the buffer's
storage to zero bytes, and gathering resizes it back: the parameters are views
into that buffer, so they stay the tensors the modules and autograd hold while
their memory comes and goes (see Note: why storage resize).
In the backward pass the unit is gathered again, and once a chunk's last
gradient exists a {{term: reduce-scatter}} averages the ranks' gradients and
leaves each rank its shard's slice:

![shards, all-gather and reduce-scatter on 2 to 4 ranks](figures/shard_collectives.svg)

A step moves at most $3\Psi$ elements against data parallelism's $2\Psi$, for
$\frac{1}{N_d}$ of the memory (frozen chunks are never reduced, and the
root unit is not gathered again for the backward pass).

## The core path

1. this page: what is sharded, chunks and units;
2. [the memory and communication model](planner/memory_model.html);
3. [hooks and schedule](zero3/hooks.html): one training step, hook by hook;
4. [AdamFP16](optimizers/adam_fp16.html): the update on the shards;
5. [sharding a model](zero3/sharded_model.html): the ways into the engine;
6. [the chunk-size search](planner/chunk_search.html).

Every later page says which of these it deepens.
"""
