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
bytes of optimizer state (the fp32 {{see: master weights}} and Adam's two
moments). ZeRO-3 cuts all three into $N_d$ {{term: shards | shard}}, one per
rank, and gathers a layer's parameters only while it computes. With $\Psi_t$
trainable and $\Psi_f$ frozen parameters a rank holds

$$\frac{(2 + 4 + K)\,\Psi_t + 2\,\Psi_f}{N_d}$$

bytes of model states
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step):
a frozen parameter has no gradient and no optimizer state, only its bf16
shard. The ZeRO paper's $P_{os+g+p}$ counts an fp16 gradient, $(2 + 2 + K)$;
this engine keeps each rank's gradient shard in fp32, because the ranks'
gradients are averaged in fp32 by default and the optimizer reads fp32, so
nothing rounds the mean on its way. The memory model (page 2) adds what a rank
holds beside the model states: the layers gathered for compute, and the
full-size gradient buffers (all of them at once under gradient
accumulation).

The parameters are packed, in execution order, into flat {{term: chunks |
chunk}} of one size (but a group's last chunk, trimmed to what it holds, and a
parameter larger than the size, which gets a chunk of its own), so that each
collective moves one large buffer; every rank keeps one shard of every chunk. A {{term: unit}} is a wrapped layer
whose chunks are gathered and released together; the parameters of no wrapped
layer (embeddings, a tied readout; with `shard_model`) form the
{{term: root unit}}, gathered for the whole step.

## A step in one picture

Before a unit computes, an {{term: all-gather}} fills its chunks' full buffers
on every rank from the ranks' shards; after, the full buffers are freed. In
the backward pass the unit is gathered again, and as soon as the last gradient
of a chunk is computed a {{term: reduce-scatter}} averages the ranks' full
gradients of that chunk and leaves each rank the slice of its own shard, while
the layers below go on with their backward:

![shards, all-gather and reduce-scatter on 2 to 4 ranks](figures/shard_collectives.svg)

So a step gathers every chunk twice and reduce-scatters every trainable chunk
once: $3\Psi$ elements of traffic against the $2\Psi$ of DDP's all-reduce,
for $\frac{1}{N_d}$ of the memory (bytes, and the exceptions, on page 2).

## The core path

1. this page: what is sharded, the formula, chunks and units;
2. [the memory and communication model](zero3/memory_model.html): the bytes
   per rank, term by term as the engine holds them, and the traffic of a step
   against DDP's, in elements and in bytes;
3. [hooks and schedule](zero3/hooks.html): one training step from the first
   pre-forward hook to the last reduce-scatter, what prefetching does and how
   many units are gathered at most, frozen layers, gradient accumulation;
4. [AdamFP16](optimizers/adam_fp16.html): the update on the shards, where the
   masters and moments live (device or host), how all ranks agree on an
   overflow;
5. [sharding a model](zero3/sharded_model.html): the ways into the engine, and
   how a model larger than one GPU is built without any rank holding it;
6. [the chunk-size search](zero3/chunk_search.html): how the chunk size is
   chosen.

Every later page says which of these it deepens. The project grew from
labml-nn's annotated ZeRO-3 and GPT-NeoX pages; its names
(`Zero3Layer`, `Zero3Sequential`, `get_trainable_chunk`, `AdamFP16`) keep
working here.
"""
