r"""
---
title: The planner
summary: Name the model and the GPUs; the planner predicts the memory and the
  step time of every setting of the fine-tune and picks the fastest that fits,
  before anything runs.
---

# The planner

The fastest setting that fits, from the engine's own quantities, before
anything runs; above the models, below [the fine-tune](../finetune/planning.html).
Its pages: [the machines](devices.html), [a job and its
settings](setting.html), [the time of a step](step_time.html), [the
search](search.html).
"""

from .devices import GPUS, Cluster, gpu_by_name, this_machine
from .search import NoFit, Pinned, Plan, describe, plan
from .setting import Job, Setting

__all__ = ["GPUS", "Cluster", "gpu_by_name", "this_machine", "Job", "Setting",
           "Pinned", "Plan", "NoFit", "plan", "describe"]
