r"""
---
title: The learning-rate schedule
summary: Linear warm-up, then constant, linear or cosine decay to a floor; the
  rate at each step is a pure function of the step.
---

# The learning-rate schedule

Fine-tuning from pretrained weights starts with Adam's moments at zero, so the
first updates are sized by a few noisy gradients; a *warm-up* raises the rate
from near 0 to its peak $\eta$ over $W$ steps while the moments settle. The rate
then decays towards a floor $\eta_\text{min}$ over the rest of the $T_{\text{run}}$ steps, as
Hugging Face's Trainer, torchtitan and DeepSpeed's examples do. With
$p = \frac{s - W - 1}{T_{\text{run}} - W}$ the fraction of the decay done before step $s$
(the first step after the warm-up trains at the peak, and the decay would end
after the last, so no step trains at a floor of 0, which would only move
Adam's moments):

$$\eta_s = \begin{cases}
  \eta \, \frac{s}{W} & s \le W \\
  \eta & \text{constant} \\
  \eta_\text{min} + (\eta - \eta_\text{min})(1 - p) & \text{linear} \\
  \eta_\text{min} + (\eta - \eta_\text{min}) \, \frac{1 + \cos \pi p}{2} & \text{cosine}
\end{cases}$$

"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LRSchedule", "SCHEDULES"]

# The shapes of the decay after warm-up, the values `--lr-schedule` takes.
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    r"""
    ## A schedule: the peak, its shape, the warm-up and the floor

    A frozen dataclass, and `rate(step)` a pure function of the step: nothing
    is stepped, so a run resumed after step $s$ computes the same
    $\eta_{s+1}$ as the uninterrupted one, bit for bit, at any world size
    (tested: tests/finetune/test_lr_schedule.py::test_the_rate_depends_on_the_step_alone).
    The fine-tune saves its fields in each checkpoint (see [the job's
    checkpoints](checkpoints.html)). Steps count from 1, so the first step
    trains at $\eta / W$, not at 0 (a step at rate 0 would only move Adam's
    moments). One rate for all parameters (AdamFP16's parameter groups share
    it).
    """

    lr: float
    r"""$\eta$, the peak rate (after the warm-up)."""
    total_steps: int
    r"""$T_{\text{run}}$, the steps of the whole run; the decay ends after the last."""
    kind: str = "constant"
    """One of `SCHEDULES`."""
    warmup_steps: int = 0
    """$W$; 0 starts at the peak."""
    min_lr: float = 0.0
    r"""$\eta_\text{min}$, which linear and cosine decay reach after the last step."""

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, "
                             f"got {self.kind!r}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} must be below the "
                             f"run's {self.total_steps} steps")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr {self.min_lr:g} must be in [0, lr "
                             f"{self.lr:g}]")

    def rate(self, step: int) -> float:
        r"""
        ### $\eta_s$ at step $s \in [1, T_{\text{run}}]$
        """
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        p = (step - self.warmup_steps - 1) / (self.total_steps - self.warmup_steps)
        p = min(max(p, 0.0), 1.0)
        if self.kind == "linear":
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - p)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(
            math.pi * p))
