"""
---
title: The fine-tune
summary: The GPT-NeoX fine-tune job, above the model - its command line,
  configuration, checks before start, data, schedule, tracking and checkpoints.
---

# The fine-tune

The job that trains [GPT-NeoX](../neox/index.html) with the engine. It sits above
the model: it builds the model through [the assembly](../assembly.html), feeds it
data and records what happens, and nothing below it imports it. Its pages, in
reading order: [the command line](cli.html) (`python -m labml_zero.finetune_neox`),
[the learning-rate schedule](lr_schedule.html), [the configuration](config.html),
[the checks before start](preflight.html), [the job](job.html), [what a step
shows](step_metrics.html), [its checkpoints](checkpoints.html) and
[tracking](tracking.html); then the data: [reading a corpus](corpus.html), [the
token file](token_file.html), [the dataset](dataset.html) and [the job's
data](data.html).
"""
