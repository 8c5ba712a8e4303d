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

Reading order:

1. [The ZeRO-3 engine](zero3/index.html): the problem and
   [the memory formula](zero3/memory_model.html), then
   [the chunk layout](zero3/chunk_layout.html), [the chunk](zero3/chunk.html),
   [communication](zero3/communication.html),
   [hooks and schedule](zero3/hooks.html) and
   [the sharded model](zero3/sharded_model.html).
2. [AdamFP16](optimizers/adam_fp16.html), the optimizer on the shards, in
   [the optimizers chapter](optimizers/index.html).
3. Training features: [gradient clipping](optimizers/clip_grad.html),
   [loss scaling](optimizers/grad_scaler.html), gradient accumulation and
   recomputation (in [hooks and schedule](zero3/hooks.html)).
4. [Sharded checkpoints](zero3/checkpoint/index.html).
5. [GPT-NeoX](neox/index.html): the model we train, and
   [the fine-tune](neox/finetune.html), started by
   [`finetune_neox`](finetune_neox.html).
6. Advanced: [the chunk-size search](zero3/chunk_search.html),
   [placement and offload](zero3/placement.html),
   [peer memory](zero3/peer_memory.html),
   [compiled layers](zero3/compiled.html).
7. Tooling: [launching processes](launch.html),
   [the labml app, offline](app.html) and [finding it](app_client.html), and the
   benchmark (`bench/`).
"""
