r"""
---
title: Shared layers
summary: Layers that more than one model family builds from, written once: the
  LoRA adapter and its fine-tuner.
---

# Shared layers

What the families' layers have in common lives here, below both, so
neither imports the other: the list of layers, and LoRA's
$y = W x + b + \frac{\alpha}{r} B A x$.
"""
