"""
---
title: The fine-tune
summary: The fine-tune job of any model family, above the models - its command
  line, configuration, checks before start, data, schedule, tracking and
  checkpoints.
---

# The fine-tune

The job that trains a model of any [family](../families.html) with the
engine. It sits above the models and imports none of them: it asks [the
family](../family.html) for the model, feeds it data and records what
happens. `python -m labml_zero.finetune` asks [which family](__main__.html)
first, then runs [its command line](cli.html).
"""
