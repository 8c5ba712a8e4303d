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

The book has seven parts, in this order (the home page lists every page):

1. the problem and [the engine](zero3/index.html), from the memory formula
   through the configuration, the {{see: chunk layout}}, the chunk,
   [the shard](zero3/shard.html), communication and
   [its transports](zero3/transport.html) and the hooks to the sharded model;
2. [the optimizer](optimizers/index.html), its
   [host-side update](optimizers/host_offload.html), and the training features
   (clipping, loss scaling, accumulation, recomputation);
3. [sharded checkpoints](zero3/checkpoint/index.html), a package of its own:
   format, state, agreement, {{see: digests | digest}}, saving, reading,
   loading, checks, pruning and export;
4. [the GPT-NeoX model](neox/index.html);
5. the fine-tune: [the command line](finetune_neox.html),
   [its configuration](neox/finetune_config.html),
   [the pre-flight checks](neox/preflight.html), [the job](neox/finetune.html),
   [the assembly](assembly.html) of a sharded model and its optimizer,
   [tracking](neox/tracking.html), the fine-tuners, [LoRA](neox/lora.html) and
   [its exports](neox/lora_export.html);
6. the advanced chapters (chunk-size search, {{see: placement}} and
   {{see: offload}}, {{see: peer memory}}, compiled layers);
7. the tooling: launching processes and [supervising them](supervisor.html),
   the labml app and [its records](app_records.html), and the benchmark.
"""
