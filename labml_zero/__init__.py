r"""
---
title: labml_zero
summary: An annotated ZeRO-3 (Zero-DP) engine with chunk-based memory management.
---

# labml_zero

A literate implementation of ZeRO-3 training. Data parallelism over $N_d$ ranks
keeps a full copy of the *model states* (parameters, gradients, optimizer state)
on every rank; ZeRO-3 shards all three over the ranks, in flat *chunks* here, so
that with bf16 parameters, this engine's fp32 gradient shard and Adam's
$K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes of fp32 state each rank holds

$$\frac{(2 + 4 + K)\,\Psi}{N_d}$$

bytes of model states for $\Psi$ trainable parameters, instead of
$(2 + 4 + K)\Psi$. Every page shows the notes beside the code they explain.

The book has seven parts, in this order (the home page lists every page): the
problem and [the engine](zero3/index.html), from the memory formula through the
chunk layout, the chunk, communication and the hooks to the sharded model;
[the optimizer](optimizers/index.html) and the training features (clipping, loss
scaling, accumulation, recomputation); sharded checkpoints;
[the GPT-NeoX model](neox/index.html); the fine-tune; the advanced chapters
(chunk-size search, placement and offload, peer memory, compiled layers); and
the tooling (launching processes, the labml app, the benchmark).
"""
