r"""
---
title: The planner
summary: Name the model and the GPUs; the planner predicts the memory and the
  step time of every setting of the fine-tune and picks the fastest that fits,
  before anything runs.
---

# The planner

The policy above the engine's mechanism: what a setting costs and which
setting to run, before anything runs. The engine in [zero3](../zero3/index.html)
runs a step with the sizes it is given and imports nothing from here. The
pages: [the memory model](memory_model.html) and [the gradient
buffers](grad_buffers.html), [hybrid sharding's memory](hybrid_memory.html),
[the chunk-size search](chunk_search.html) and [its
shortcuts](chunk_search_shortcuts.html), [sharding with the searched
size](sharding.html), [placement in device and host memory](placement.html)
with [its probe](placement_probe.html) and [its
report](placement_report.html); then the planner: [the memory
budget](memory_budget.html) of one fine-tune, [the machines](devices.html), [a
job and its settings](setting.html), [the time of a step](step_time.html),
[the search](search.html).

A model is asked of its [family](../family.html), an object the caller
gives: no page here imports a model package (`tests/test_layers.py`), so the
same planner sizes GPT-NeoX and Llama.
"""
