r"""
---
title: Adam with fp32 master weights (AdamFP16)
summary: AdamW on flat shards, with fp32 master weights and moments, written back in 16 bits.
---

# Adam with fp32 master weights

The update is exactly `torch.optim.AdamW`'s (decoupled weight decay, $\epsilon$
added to the bias-corrected $\sqrt{v}$). With gradient $g_t$, learning rate
$\alpha$, weight decay $\lambda$:

\begin{align}
\theta &\leftarrow \theta (1 - \alpha \lambda) \\
m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
\theta &\leftarrow \theta - \frac{\alpha}{1 - \beta_1^t} \cdot
  \frac{m_t}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon}
\end{align}

with $\theta$ the fp32 master, $m$ and $v$ fp32, and the 16-bit parameter set to
$\theta$ rounded after each step.

## Where each piece lives

* The parameters handed to `AdamFP16` are the flat 16-bit shards of the trainable
  chunks (`model.get_trainable_chunk()`).
* Their gradients are in `param.main_grad` (fp32, averaged over ranks by the
  reduce-scatter); a plain `param.grad` is used where there is no `main_grad`, so
  the optimizer also works on ordinary parameters.
* The master starts from `param.master_init` when the engine left one (the
  original fp32 weights of a 16-bit chunk), otherwise from the parameter itself.
  An fp32 parameter *is* its own master: no copy, $K = 8$ extra bytes.

Each step is one pass over all shards, however many chunks there are: PyTorch's
fused AdamW kernel (`torch._fused_adamw_`, one kernel that reads $\theta, g, m, v$
once and writes $\theta, m, v$ once; it exists for CPU and CUDA) when available,
else the same update as a sequence of `foreach` multi-tensor kernels (each a full
pass over the state: about three times the memory traffic). Both are tested
against `torch.optim.AdamW`.

## Limitations

* No AMSGrad, no `maximize`, no capturable (CUDA graph) mode.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch


class AdamFP16(torch.optim.Optimizer):
    """
    ## The optimizer

    * `params`: the shards (or any parameters) to update, or param groups.
    * `lr`, `betas`, `eps`, `weight_decay`: as in `torch.optim.AdamW`; the default
      `weight_decay=0.0` keeps labml-nn's `AdamFP16(params, lr=...)` an Adam.
    * `fused`: use the fused kernel (default: where available) or `foreach` ops.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        fused: bool | None = None,
    ):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        # None: the fused kernel where this PyTorch has it
        self.fused = hasattr(torch, "_fused_adamw_") if fused is None else fused
        if self.fused and not hasattr(torch, "_fused_adamw_"):
            raise ValueError("fused=True needs torch._fused_adamw_ (PyTorch >= 2.4)")

    @staticmethod
    def gradient(param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 gradient the engine left, or the ordinary one."""
        grad = getattr(param, "main_grad", None)
        if grad is None and param.grad is not None:
            grad = param.grad.float()
        return grad

    def init_state(self, param: torch.Tensor) -> dict:
        """
        ### The state of one shard

        `master` [S] fp32, `exp_avg` [S] fp32, `exp_avg_sq` [S] fp32, `step`.
        """
        state = self.state[param]
        if state:
            return state
        master = getattr(param, "master_init", None)
        if master is not None:
            # The exact fp32 weights; the 16-bit shard is a rounding of them.
            del param.master_init
        elif param.dtype == torch.float32:
            master = param.data
        else:
            master = param.detach().float()
        state["step"] = 0
        state["master"] = master
        state["exp_avg"] = torch.zeros_like(master)
        state["exp_avg_sq"] = torch.zeros_like(master)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if self.gradient(p) is not None]
            # Shards that have taken the same number of steps share one bias
            # correction, so they can share one foreach pass.
            by_step: dict[int, list[torch.Tensor]] = {}
            for param in params:
                state = self.init_state(param)
                state["step"] += 1
                by_step.setdefault(state["step"], []).append(param)
            for step, same_step in by_step.items():
                self._update(same_step, step, group)
        return loss

    def _update(self, params: list[torch.Tensor], step: int, group: dict) -> None:
        """
        ### One AdamW step over shards with the same step count

        Shards with the same step share the bias corrections, so one kernel
        launch (or one foreach sequence) covers them all.
        """
        lr, (beta1, beta2) = group["lr"], group["betas"]
        states = [self.state[p] for p in params]
        masters = [s["master"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        grads = [self.gradient(p) for p in params]

        if self.fused:
            # The kernel reads the (already incremented) step from a tensor.
            steps = [torch.full((), float(step), device=m.device) for m in masters]
            torch._fused_adamw_(
                masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                eps=group["eps"], amsgrad=False, maximize=False,
            )
        else:
            self._update_foreach(masters, grads, exp_avgs, exp_avg_sqs, step, group)

        # Write back the rounded master; the next all-gather spreads it.
        pairs = [(p, m) for p, m in zip(params, masters) if m.data_ptr() != p.data_ptr()]
        if pairs:
            torch._foreach_copy_([p.data for p, _ in pairs], [m for _, m in pairs])

    @staticmethod
    def _update_foreach(masters, grads, exp_avgs, exp_avg_sqs, step, group) -> None:
        """
        #### The same update with `foreach` kernels

        The sequence of operations of `torch.optim.AdamW`'s foreach path.
        """
        lr, (beta1, beta2) = group["lr"], group["betas"]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(masters, 1 - lr * group["weight_decay"])
        # m ← β1·m + (1 − β1)·g
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        # v ← β2·v + (1 − β2)·g²
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        # √v / √(1 − β2^t) + ε
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(masters, exp_avgs, denom, -step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.main_grad = None
                param.grad = None
