r"""
---
title: labml_zero
summary: An annotated ZeRO-3 (Zero-DP) engine with chunk-based memory management.
---

# labml_zero

A literate implementation of ZeRO-3 training: parameters, gradients and optimizer
states are sharded over $N_d$ ranks in flat chunks, so that each rank holds
$\frac{(2 + 2 + K)\Psi}{N_d}$ bytes of model states instead of $(2 + 2 + K)\Psi$.

Reading order:

1. [The ZeRO-3 engine](zero3/index.html)
2. [Chunks](zero3/chunk.html), [chunk layout](zero3/chunk_layout.html) and
   [the chunk-size search](zero3/chunk_search.html)
3. [AdamFP16](optimizers/adam_fp16.html)
4. [GPT-NeoX](neox/index.html)
5. [The fine-tuning experiment](finetune_neox.html), on
   [one process per GPU or several CPU processes](launch.html)
6. [Sharded checkpoints](zero3/checkpoint/index.html)
7. [The labml app, offline](app.html), and [finding it](app_client.html)
"""
