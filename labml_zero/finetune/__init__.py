"""
---
title: The fine-tune
summary: The GPT-NeoX fine-tune job, above the model - its command line,
  configuration, checks before start, data, schedule, tracking and checkpoints.
---

# The fine-tune

The job that trains [GPT-NeoX](../neox/index.html) with the engine. It sits
above the model: it builds the model through [the assembly](../assembly.html),
feeds it data and records what happens, and nothing below imports it.
`python -m labml_zero.finetune_neox` runs [its command line](cli.html).
`python -m labml_zero.finetune` asks [which family](__main__.html) first, from
`--model` or the checkpoint's `config.json`.
"""
