r"""
---
title: The update in one pass
summary: AdamW of a half-precision shard on a GPU as one compiled kernel that
  reads the gradient in its own dtype and writes the master, both moments and
  the rounded shard, beside the twin of two kernels it replaces.
---

# The update in one pass

This page deepens [AdamFP16](adam_fp16.html). The update of a shard is memory
bound: it computes a few operations per element and moves every element's
master, moments, gradient and shard once or more. At bandwidth $\beta$ a
pass that moves $b$ bytes per element over $S$ elements takes at least

$$t \ge \frac{b\, S}{\beta},$$

so the bytes per element are the update's cost: the twin of two kernels,
which a CPU runs, against one pass, whose bytes are counted below.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from labml_zero.zero3.state_layout import FP32_STATES, StateLayout

# fp32 master, exp_avg and exp_avg_sq: $K$ of the fp32 layout, which the twin
# (the fused fp32 kernel) reads and writes
STATE_BYTES = FP32_STATES.bytes_per_element()


def twin_bytes(shard_bytes: int) -> int:
    r"""Per element: the fused fp32 AdamW (an fp32 gradient) and the copy that
    rounds the master into the shard.

    The twin is two kernels:
    PyTorch's fused AdamW reads $\theta, g, m, v$ and writes $\theta, m, v$, all
    fp32 ({{py: rounded_update.twin_bytes(2) - rounded_update.write_back_bytes(2)}}
    bytes), then a copy rounds $\theta$ into the shard, reading 4 and writing $p$
    ({{py: rounded_update.write_back_bytes(2)}} bytes for bf16):
    {{py: rounded_update.twin_bytes(2)}} bytes per element. 
    """
    fused = STATE_BYTES + 4 + STATE_BYTES
    return fused + write_back_bytes(shard_bytes)


def write_back_bytes(shard_bytes: int) -> int:
    """Per element: read the fp32 master, write the shard."""
    return 4 + shard_bytes


def one_pass_bytes(shard_bytes: int, grad_bytes: int,
                   layout: StateLayout = FP32_STATES) -> int:
    r"""Per element: read master, moments and gradient; write master, moments
    and shard.

    One pass reads the
    gradient in whatever dtype it has, $g_b$ bytes, and writes the shard as it
    writes the master:

    $$b = \underbrace{K + g_b}_{\text{read } \theta, m, v, g}
        + \underbrace{K + p}_{\text{write } \theta, m, v, \text{shard}},$$

    with $K$ the bytes of the [state layout](../zero3/state_layout.html):
    {{py: rounded_update.one_pass_bytes(2, 4)}} bytes with fp32 states and an
    fp32 gradient, {{py: rounded_update.one_pass_bytes(2, 2)}} with a bf16
    gradient, and {{py: rounded_update.one_pass_bytes(2, 4, state_layout.BF16_MOMENTS)}}
    with bf16 moments and an fp32 gradient. The gradient is in
    bf16 where one rank holds a chunk alone and only its update reads the gradient
    (see the shard's Note: one rank keeps the parameter dtype): the
    [reduction](../zero3/chunk_grads.html) then copies autograd's bf16 gradients
    into it (read 2 and write 2 bytes, where the cast into fp32 writes 4) and the
    non-finite check reads 2 bytes where it read 4.
    """
    k = layout.bytes_per_element()
    return k + grad_bytes + k + shard_bytes


class Betas(NamedTuple):
    """The constants of a param group that the compiled kernel bakes in
    (a change recompiles it)."""

    beta1: float
    beta2: float
    eps: float


def applies(param: torch.Tensor) -> bool:
    """Whether `param`'s update may take the one pass: a half-precision
    shard on a GPU. An fp32 shard is its own master and the fused kernel
    already moves the least for it; on a CPU, and for a host home, the twin
    runs."""
    return param.is_cuda and param.dtype in (torch.bfloat16, torch.float16)


def step_coefficients(step: torch.Tensor, lr: torch.Tensor, *, beta1: float,
                      beta2: float, weight_decay: float) -> torch.Tensor:
    r"""
    ### The three scalars of a step, in fp64, rounded to fp32

    `step` and `lr` are 0-dim device tensors; returns `[3]` fp32.

    The bias corrections lose digits in fp32: at $t = 1$, $1 - \beta_2^t$ is
    $1 - \beta_2$, small for a $\beta_2$ near one, while the fp32 rounding of
    $\beta_2^t$ is up to $2^{-24}$; relative to $1 - \beta_2$ that is, for
    AdamW's default $\beta_2$, {{py: 2**-24 / (1 - 0.999) | .0e}}, hundreds of
    times an fp32 rounding. So the three scalars of a step,

    $$\frac{\alpha}{1 - \beta_1^t}, \qquad \sqrt{1 - \beta_2^t}, \qquad
      1 - \alpha\lambda,$$

    are computed once per step in fp64 on the device (`step_coefficients`) from
    the device tensors $t$ and $\alpha$ and rounded to fp32: each carries one fp32
    rounding, like every other operand of the update. Because they are device
    tensors, a captured step computes them inside its graph from the tensors it
    refills before each replay (see [the update inside a captured
    step](captured_update.html)).
    """
    t, alpha = step.double(), lr.double()
    # [3] fp64, then fp32
    return torch.stack([alpha / (1 - beta1 ** t), (1 - beta2 ** t).sqrt(),
                        1 - alpha * weight_decay]).float()


def adamw_rounded_(shard: torch.Tensor, state: tuple[torch.Tensor, ...],
                   grad: torch.Tensor, coefficients: torch.Tensor,
                   found_inf: torch.Tensor | None, betas: Betas) -> None:
    r"""
    ### One AdamW step of a shard, and its rounding, in one pass

    * `shard`: `[S]` bf16 or fp16, written with the new master rounded.
    * `state`: `(master, exp_avg, exp_avg_sq)`, `[S]` each, the master fp32
      and the moments fp32 or bf16 (read widened, rounded when stored: see
      [narrow moments](narrow_moments.html)), updated in place.
    * `grad`: `[S]`, any floating dtype; read once, in fp32 arithmetic.
    * `coefficients`: `step_coefficients` of this step.
    * `found_inf`: 0-dim fp32, or `None`; when it is not zero nothing changes
      (an update during the backward pass whose gradient was not finite: see
      Note: a non-finite gradient in an early update).

    `adamw_rounded_` is written with ordinary PyTorch operations and compiled
    by `torch.compile` into one Triton kernel, the first time it runs on a CUDA
    tensor of a given dtype. The arithmetic is `torch.optim.AdamW`'s (the
    formula on [AdamFP16's page](adam_fp16.html)), in fp32 like the fused kernel;
    it rounds in its own order, so it agrees with the twin within the fp32
    roundings of an update, not bit for bit
    (tested: tests/optimizers/test_rounded_update.py::test_one_pass_is_the_twin_within_rounding).
    Every update of a half-precision device shard with the fused kernel on a GPU
    takes it, in `step()`, during the backward pass and inside a captured step,
    so two ways of running the same training on a GPU still agree bit for bit.
    """
    master, exp_avg, exp_avg_sq = state
    theta, m, v = adamw_fp32(master, grad, exp_avg, exp_avg_sq, coefficients,
                             found_inf, betas)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    master.copy_(theta)
    shard.copy_(theta)


def adamw_fp32(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, coefficients: torch.Tensor,
               found_inf: torch.Tensor | None, betas: Betas
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""
    #### The arithmetic every one-pass update shares

    The new $(\theta, m, v)$, `[S]` fp32 each, from the fp32 `weight` (a
    master, or a weight widened from bf16), the gradient and the stored
    moments, all read in fp32; with `found_inf` set, the old values. The
    caller stores them: into a master and a rounded shard here, rounded
    stochastically or split with a compensation where there is no master
    ([stochastic rounding](stochastic_rounding.html), [Kahan
    summation](kahan_summation.html)).
    """
    step_size, bias_correction2_sqrt, decay = coefficients.unbind()
    g = grad.float()
    # widened first: a bf16 moment times a Python float would round in bf16
    m0, v0 = exp_avg.float(), exp_avg_sq.float()
    # m ← β1·m + (1 − β1)·g ;  v ← β2·v + (1 − β2)·g²
    m = betas.beta1 * m0 + (1 - betas.beta1) * g
    v = betas.beta2 * v0 + (1 - betas.beta2) * g * g
    # $\theta \leftarrow \theta (1 - \alpha\lambda) - \frac{\alpha}{1 - \beta_1^t}
    # \cdot \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}$
    theta = weight * decay - step_size * m / (
        v.sqrt() / bias_correction2_sqrt + betas.eps)
    if found_inf is not None:
        skip = found_inf != 0
        m = torch.where(skip, m0, m)
        v = torch.where(skip, v0, v)
        # skipped, the weight is stored as it was
        theta = torch.where(skip, weight, theta)
    return theta, m, v


def compile_update(update, *, exact_casts: bool = False):
    r"""A one-pass update compiled for the GPU. Pointwise autotuning is off: it
    would time the kernel at the first launch of each size, which inside a
    CUDA graph's capture is not allowed. `exact_casts` for an update that
    reads back what a cast to a narrower dtype lost ([Kahan
    summation](kahan_summation.html)'s $x' - \operatorname{rn}(x')$): the
    compiler otherwise keeps a value narrowed and widened again in fp32,
    which makes that difference zero."""
    return torch.compile(update, options={"triton.autotune_pointwise": False,
                                          "emulate_precision_casts": exact_casts})


@functools.cache
def compiled_update():
    """`adamw_rounded_` compiled, made once at its first GPU call."""
    return compile_update(adamw_rounded_)


def one_pass(shard: torch.Tensor, state: tuple[torch.Tensor, ...],
             grad: torch.Tensor, coefficients: torch.Tensor,
             found_inf: torch.Tensor | None, betas: Betas) -> None:
    """
    ### `adamw_rounded_` compiled, on CUDA tensors

    Compiled at the first call; a new dtype, or a second shard size (which
    Dynamo then compiles for any size), compiles again, once. One kernel
    launch per shard, where the fused kernel takes a whole batch of shards in
    one: the host pays one compiled call per chunk.
    """
    compiled_update()(shard, state, grad, coefficients, found_inf, betas)
