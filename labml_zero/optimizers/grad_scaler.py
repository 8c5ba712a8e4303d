r"""
---
title: Dynamic loss scaling for fp16, agreed by all ranks
summary: Scale the loss, detect overflow on the shard gradients, skip everywhere.
---

# Dynamic loss scaling

fp16's smallest magnitude, a subnormal, is $6 \cdot 10^{-8}$
(tested: tests/optimizers/test_grad_scaler.py::test_fp16_flushes_what_the_scale_keeps);
many gradients are smaller and would flush to zero. So the loss is multiplied by a
scale $\gamma$ before the backward pass, every gradient is $\gamma$ times larger, and the
optimizer divides by $\gamma$ again (in fp32, on the shard gradients). Too large an
$\gamma$ overflows to `inf`: then the step is skipped and $\gamma$ halved. After
`growth_interval` steps without overflow $\gamma$ doubles, so it tracks the largest
safe value.
"""

from __future__ import annotations

from typing import Sequence

import torch

from labml_zero.zero3.communication import Communicator

from .clip_grad import global_grad_norm, shard_grads


class LossScaler:
    r"""
    ## The scaler

    Used like `torch.amp.GradScaler`: `scale(loss).backward()`,
    `unscale_(shards)`, then `step(optimizer)`, which steps unless a gradient
    was non-finite and updates the scale.

    * `comm`: the engine's communicator (its process group decides overflow).
    * `dynamic`: scale the loss (fp16) or keep $\gamma = 1$ (bf16, fp32).
    * `init_scale`, `growth_factor`, `backoff_factor`, `growth_interval`: as in
      `torch.amp.GradScaler`.

    ### bf16

    bf16 has fp32's exponent range and needs no scaling: `LossScaler(dynamic=False)`
    keeps $\gamma = 1$ but still checks the gradients, skips a non-finite step on
    every rank and counts it in `skipped_steps`, so a diverging run is reported
    rather than silently corrupting the master weights.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        dynamic: bool = True,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if init_scale <= 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if growth_factor <= 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.comm = comm
        self.dynamic = dynamic
        self.scale_value = float(init_scale) if dynamic else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0
        self.found_inf = False
        # the unscaled global gradient norm of the last `unscale_`
        self.grad_norm: torch.Tensor | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.dynamic else loss

    def unscale_(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """
        ### Check and unscale the shard gradients

        Returns the unscaled global gradient norm (pass it to `clip_grad_norm_` as
        `norm=` to clip without another all-reduce).

        #### Agreeing on overflow

        Under ZeRO each rank sees only its shards. An overflow in rank 0's shard must
        skip the step on every rank, or the ranks' shards would come from different
        steps. The overflow check is one all-reduce of the squared gradient norm (a
        non-finite gradient makes it non-finite, on every rank at once), which
        [clipping](clip_grad.html) reuses, and one host sync (`.item()`) to decide
        whether to step: one collective and one sync per step for both features.
        (labml-nn's scaler checked each rank alone.)
        """
        scaled_norm = global_grad_norm(shards, self.comm)
        # host sync: .item(), the one per step, to decide whether to step
        self.found_inf = not torch.isfinite(scaled_norm).item()
        if not self.found_inf and self.dynamic:
            torch._foreach_mul_(shard_grads(shards), 1.0 / self.scale_value)
        self.grad_norm = scaled_norm / self.scale_value
        return self.grad_norm

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """
        Step unless `unscale_` found a non-finite gradient; say whether it did.

        Refuses an optimizer that updates during the backward pass: such
        updates used the scaled gradient, and cannot be skipped on every rank
        once an overflow shows (see Note: a non-finite gradient in an early
        update).
        """
        if getattr(optimizer, "update_during_backward", False):
            raise ValueError("LossScaler cannot step an optimizer with "
                             "update_during_backward=True: its updates ran "
                             "before the overflow check; turn it off")
        stepped = not self.found_inf
        if stepped:
            optimizer.step()
        else:
            self.skipped_steps += 1
        self.update()
        return stepped

    def update(self) -> None:
        if not self.dynamic:
            return
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale_value,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.dynamic = bool(state["dynamic"])
