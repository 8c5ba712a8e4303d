r"""
---
title: ZeRO-3 in six pages
summary: What is sharded and what a rank holds, one step in one picture, and the
  five pages that make it precise.
---

# ZeRO-3 in six pages

Data parallelism (DDP) over $N_d$ ranks keeps a full copy of the {{term: model
states}} on every rank: for each parameter trained with mixed-precision Adam,
$2$ bytes of bf16 parameter, $4$ of fp32 gradient and $K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes of optimizer state (the fp32 {{see: master weights}} and Adam's two
moments). ZeRO-3 cuts all three into $N_d$ {{term: shards | shard}}, one per
rank, and gathers a layer's parameters only while it computes. With $\Psi_t$
trainable and $\Psi_f$ frozen parameters a rank holds

$$\frac{(2 + 4 + K)\,\Psi_t + 2\,\Psi_f}{N_d}$$

bytes of model states
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step).
The ZeRO paper's $P_{os+g+p}$ counts an fp16 gradient, $(2 + 2 + K)$; this
engine keeps the gradient shard in fp32, so the mean over ranks is never
rounded on its way to the optimizer.

The parameters are packed, in execution order, into flat {{term: chunks |
chunk}} of one size, each layer's into chunks of their own, its {{term: group}}
(but a group's last chunk, trimmed to what it holds, and a parameter larger
than the size, which gets a chunk of its own), so that each collective moves
one large buffer; every rank keeps one shard of every chunk. A
{{term: unit}} is a wrapped layer whose chunks are gathered and released
together; the parameters of no wrapped layer form the {{term: root unit}},
gathered for the whole step.

## A step in one picture

Before a unit computes, an {{term: all-gather}} fills its chunks' full buffers
from the ranks' shards; after, each buffer's storage is resized to zero bytes,
which frees the memory while the parameters, views into it, stay the tensors
autograd knows (see Note: why storage resize). In the backward pass the unit
is gathered again, and once a chunk's last gradient exists a
{{term: reduce-scatter}} averages the ranks' gradients of that chunk and leaves
each rank its shard's slice, while the layers below go on:

![shards, all-gather and reduce-scatter on 2 to 4 ranks](figures/shard_collectives.svg)

A step gathers every chunk twice and reduce-scatters every trainable chunk
once: $3\Psi$ elements of traffic against DDP's $2\Psi$, for $\frac{1}{N_d}$
of the memory.

## The core path

1. this page: what is sharded, chunks and units;
2. [the memory and communication model](zero3/memory_model.html): bytes per
   rank term by term, and a step's traffic;
3. [hooks and schedule](zero3/hooks.html): one training step, hook by hook;
4. [AdamFP16](optimizers/adam_fp16.html): the update on the shards;
5. [sharding a model](zero3/sharded_model.html): the ways into the engine;
6. [the chunk-size search](zero3/chunk_search.html): how the chunk size is
   chosen.

Every later page says which of these it deepens. The project grew from
labml-nn's annotated ZeRO-3 and GPT-NeoX pages, whose names (`Zero3Layer`,
`Zero3Sequential`, `get_trainable_chunk`, `AdamFP16`) keep working here.
"""
