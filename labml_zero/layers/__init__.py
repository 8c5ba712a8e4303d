r"""
---
title: Shared layers
summary: Layers that more than one model family builds from, written once: the
  LoRA adapter and its fine-tuner.
---

# Shared layers

A model family is one package ([GPT-NeoX](../neox/index.html), [the Llama
family](../llama/index.html)); what their layers have in common lives here,
below both, so neither imports the other. The first is LoRA's adapted linear,
$y = W x + b + \frac{\alpha}{r} B A x$, and the fine-tuner that puts it on a
family's projections.
"""
