r"""
---
title: The planner
summary: Name the model and the GPUs; the planner predicts the memory and the
  step time of every setting of the fine-tune and picks the fastest that fits,
  before anything runs.
---

# The planner

Which micro-batch, whether to recompute, how much optimizer state to offload:
the planner answers from the engine's own quantities, in seconds and on any
machine. It sits above the models and below the fine-tune, and the engine
imports none of it. Its pages, in reading order:

* [the machines](devices.html): a GPU's rooflines and a cluster of them;
* [a job and its settings](setting.html): what is fixed, what is chosen, and
  the [memory budget](../neox/memory_budget.html) of a choice;
* [the time of a step](step_time.html): compute, update, collectives and the
  host link, with constants measured by the benchmark;
* [the search](search.html): the fastest setting that fits, or the smallest
  change that would.

The fine-tune's `--plan` prints the plan and `--auto` runs it
([the fine-tune's plan](../finetune/planning.html)).
"""

from .devices import GPUS, Cluster, gpu_by_name, this_machine
from .search import NoFit, Pinned, Plan, describe, plan
from .setting import Job, Setting

__all__ = ["GPUS", "Cluster", "gpu_by_name", "this_machine", "Job", "Setting",
           "Pinned", "Plan", "NoFit", "plan", "describe"]
