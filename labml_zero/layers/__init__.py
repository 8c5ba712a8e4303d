r"""
---
title: Shared layers
summary: Layers that more than one model family builds from, written once: the
  LoRA adapter and its fine-tuner, and the fp8 linears.
---

# Shared layers

What the families' layers have in common lives here, below both, so
neither imports the other: the list of layers, LoRA's
$y = W x + b + \frac{\alpha}{r} B A x$, and the [fp8
products](float8.html) of the layers' linears.
"""
