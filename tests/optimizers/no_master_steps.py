"""
The one-pass updates of the layouts without a master against their twins,
step by step from one start: a shared driver for
tests/optimizers/test_stochastic_rounding.py and test_kahan_summation.py.

On CPU the one-pass functions run as written; `LABML_ZERO_TEST_DEVICE=cuda`
runs them compiled, the kernels the optimizer launches on a GPU.
"""

from __future__ import annotations

import math

import torch

from labml_zero.optimizers import rounded_update as R
from tests import tolerance
from tests.optimizers.test_offload import DEVICE

STEPS = 12
SIZE = 4096
HYPER = dict(lr=1e-2, betas=(0.8, 0.999), eps=1e-8, weight_decay=0.1)


def start(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A bf16 weight and zero bf16 states of the layout's `names`."""
    torch.manual_seed(0)
    weight = torch.randn(SIZE, device=DEVICE).bfloat16()
    return {"weight": weight, **{n: torch.zeros_like(weight) for n in names}}


def gradient(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(SIZE, generator=g).to(DEVICE)


def scalars(step: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The step as the optimizer's device tensor, and the one pass's
    coefficients for it."""
    beta1, beta2 = HYPER["betas"]
    step_t = torch.full((), float(step), device=DEVICE)
    return step_t, R.step_coefficients(
        step_t, torch.full((), lr, device=DEVICE), beta1=beta1, beta2=beta2,
        weight_decay=HYPER["weight_decay"])


def fp32_kernel(step: int, lr: float):
    """The twin's fp32 AdamW (`AdamFP16._kernel`, fused) for one step."""
    def kernel(weights, grads, exp_avgs, exp_avg_sqs):
        torch._fused_adamw_(
            weights, grads, exp_avgs, exp_avg_sqs, [],
            [torch.full((), float(step), device=DEVICE)] * len(weights), lr=lr,
            beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
            weight_decay=HYPER["weight_decay"], eps=HYPER["eps"],
            amsgrad=False, maximize=False)
    return kernel


def betas() -> R.Betas:
    return R.Betas(*HYPER["betas"], HYPER["eps"])


def train(update, names: tuple[str, ...], *, lr: float = HYPER["lr"]
          ) -> dict[str, torch.Tensor]:
    """`update(state, grad, step, lr)` for `STEPS` steps from `start`."""
    state = start(names)
    for step in range(1, STEPS + 1):
        update(state, gradient(step), step, lr)
    return state


def flips_at_most(elements: int, steps: int) -> float:
    r"""
    How many stored bf16 values two programs may round to different
    neighbours, by chance, when their fp32 results differ only by their own
    rounding orders.

    Each step the fp32 results differ by at most `ADAMW_ROUNDINGS` roundings,
    $\le 10 \cdot 2^{-24} |x|$; a draw (or a rounding to nearest) picks
    different neighbours only if its threshold falls between them, with
    probability at most that over the bf16 step $h \ge 2^{-8} |x|$:
    $10 \cdot 2^{-16}$ a value and step. Over `elements` values and `steps`
    steps the flips are about Poisson of mean $\lambda$; this is
    $\lambda + 6\sqrt\lambda + 6$. An update with its learning rate 1% off
    moves $x$ by about $10^{-4}$ a step, a hundredth of the step $h$ near
    1: hundreds of flips.
    """
    mean = tolerance.ADAMW_ROUNDINGS * 2**-16 * elements * steps
    return mean + 6 * math.sqrt(mean) + 6
