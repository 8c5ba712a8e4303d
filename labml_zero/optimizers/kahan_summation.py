r"""
---
title: bf16 weights without a master, by Kahan summation
summary: The "bf16-kahan" choice keeps no fp32 master but a bf16 compensation
  beside each bf16 weight, what rounding to nearest lost, so updates smaller
  than half a bf16 step are kept every time, not only on average.
---

# bf16 weights without a master, by Kahan summation

This page deepens [AdamFP16](adam_fp16.html) for the `"bf16-kahan"`
[state layout](../zero3/state_layout.html): bf16 moments, no master, and a
bf16 *compensation* $c$ beside each bf16 weight $w$, $K = 2 + 2 + 2$ bytes
per element. The weight the update sees is the pair's sum $x = w + c$; the
update runs in fp32 on it, and the result is split back into a weight
rounded to nearest and what that rounding lost:

$$x = w + c, \qquad x' = \operatorname{AdamW}(x), \qquad
  w' = \operatorname{rn}(x'), \qquad c' = \operatorname{rn}(x' - w'),$$

$\operatorname{rn}$ rounding to the nearest bf16 (as in [Zamirai et
al.](https://arxiv.org/abs/2010.06192), *Revisiting BFloat16 Training*,
which calls it Kahan summation after the compensated sum). Where
[stochastic rounding](stochastic_rounding.html) keeps an update smaller than
half a bf16 step on average, the pair keeps it every time, with twice bf16's
bits of mantissa.

Three facts make the split cheap and the error small:

* $x' - w'$ is exact in fp32: the difference between a value and its own
  rounding to fewer bits is representable.
* Only $c'$ rounds: $|x' - (w' + c')| \le u\,|x' - w'| \le u^2 |x'|$,
  with $u = 2^{-8}$ the unit roundoff of bf16.
* The next step's $x = w' + c'$ is exact in fp32 when $|c'| \ge u^2 |w'|$
  (the bits of both then fit in fp32's); a smaller $c'$ rounds in the sum,
  by $2^{-24}$ of $x$ at most.

A step loses at most about $2 u^2$ of the weight, against $u$ for a bf16
weight alone
(tested: tests/optimizers/test_kahan_summation.py::test_small_updates_are_kept_every_time).
So the pair is AdamW on an fp32 weight rounded to twice bf16's precision
after every step, with moments rounded as in [narrow
moments](narrow_moments.html)
(tested: tests/optimizers/test_kahan_summation.py::test_the_update_is_adamw_on_the_pair).

## Limitations

* As for stochastic rounding, a GPU runs one compiled pass per shard
  (`adamw_kahan_`) and a CPU, or a host home, the twin on widened slices
  (`update`); they agree within the fp32 roundings of an update
  (tested: tests/optimizers/test_kahan_summation.py::test_one_pass_is_the_twin_within_rounding).
* Offloaded, as there, the host updates a copy of the weight beside its
  compensation: $K + p$ =
  {{py: state_layout.BF16_KAHAN.host_bytes_per_element(2)}} bytes an element
  in host memory for a bf16 shard ([where a shard's optimizer state
  lives](shard_home.html)).
* An fp32 shard (fp32 parameters, `ZeroConfig(dtype=torch.float32)`) is its
  own master, updated in place; its compensation stays zero, and is counted in
  $K$.
* A skipped update leaves $x$ as it was, but where $|c|$ is exactly half a
  step, rounding $x$ to nearest even may move $w$ by one step and $c$ by
  minus one: the same $x$, written the other way.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from labml_zero.zero3.state_layout import BF16_KAHAN, StateLayout

from . import rounded_update
from .narrow_moments import Kernel, widened_update


def compensation_of(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    r"""
    ### $c = \operatorname{rn}(\theta - w)$ from an fp32 master $\theta$

    What the bf16 weight $w$ lost when the master was rounded into it: the
    start of the compensation where a master is known (the exact fp32 weights
    the engine kept, `master_init`, or a checkpoint saved with a master), so
    that $w + c$ is the master within $u^2$ of it. An fp32 weight is the
    master and gets zeros.
    """
    # [S] fp32 - [S] widened: exact, then rounded to bf16
    return (master.to(weight.device, torch.float32) - weight.float()).bfloat16()


def converted(state: dict, layout: StateLayout, weight: torch.Tensor) -> dict:
    r"""
    ### A checkpoint's state, into or out of a layout with a compensation

    `state` as a checkpoint or a state dict hands it to
    `AdamFP16.load_shard_state` (its `master` the saved one, else the weight
    widened, or from a checkpoint $w + c$ already), for a shard whose loaded
    weight is `weight`:

    * into `"bf16-kahan"` from a layout without a compensation: $c$ from the
      master (`compensation_of`), so $w + c$ is the saved master within
      $u^2$ of it;
      zero where the master was the weight;
    * out of it into a layout with a master: the master is $w + c$, not $w$
      alone (an fp32 weight is its own master and keeps it).
    """
    name = BF16_KAHAN.compensation.name
    if layout.compensation is not None and name not in state:
        return {**state, name: compensation_of(state.get("master", weight),
                                               weight)}
    if (layout.master is not None and name in state
            and weight.dtype == torch.bfloat16):
        # [S] fp32, $w + c$
        return {**state, "master": weight.float() + state[name].to(
            weight.device, torch.float32)}
    return state


def update(kernel: Kernel, shards: Sequence[torch.Tensor],
           grads: Sequence[torch.Tensor], compensations: Sequence[torch.Tensor],
           exp_avgs: Sequence[torch.Tensor],
           exp_avg_sqs: Sequence[torch.Tensor]) -> None:
    """
    ### One update of bf16 shards with their compensations

    `kernel` is the fp32 update of [narrow moments](narrow_moments.html);
    per shard and slice (`widened_update`) the kernel updates $x = w + c$
    and the widened moments; the moments are rounded to nearest as they are
    stored, and $x'$ is split into $w'$ and $c'$. An fp32 shard is its own
    master, updated in place (`.float()` is itself).
    """
    # a 0-d parameter as its one element (views): the pieces slice dim 0
    shards, compensations = (torch.atleast_1d(list(ts))
                             for ts in (shards, compensations))

    def widen(i: int, piece: slice) -> torch.Tensor:
        if shards[i].dtype != torch.bfloat16:
            return shards[i][piece].float()
        # [n] fp32, exact but for a tiny $c$ (the page's third fact)
        return shards[i][piece].float() + compensations[i][piece].float()

    def store(i: int, piece: slice, x: torch.Tensor) -> None:
        if shards[i].dtype != torch.bfloat16:
            return
        # [n] bf16, $w' = \operatorname{rn}(x')$
        weight = x.bfloat16()
        shards[i][piece].copy_(weight)
        # $x' - w'$ exact in fp32, rounded to nearest as it is stored
        compensations[i][piece].copy_(x - weight.float())

    widened_update(kernel, grads, exp_avgs, exp_avg_sqs, widen=widen,
                   store=store)


def adamw_kahan_(shard: torch.Tensor, state: tuple[torch.Tensor, ...],
                 grad: torch.Tensor, coefficients: torch.Tensor,
                 found_inf: torch.Tensor | None,
                 betas: rounded_update.Betas) -> None:
    r"""
    ### The pair's update in one pass

    `update`'s arithmetic for a whole bf16 shard, compiled on a GPU into one
    kernel that reads $w, c, m, v, g$ once and writes $w', c', m, v$ once.
    `state` is `(compensation, exp_avg, exp_avg_sq)`, `[S]` bf16 each, the
    layout's order; the rest as for [`adamw_rounded_`](rounded_update.html).
    """
    compensation, exp_avg, exp_avg_sq = state
    # [S] fp32, $x = w + c$
    pair = shard.float() + compensation.float()
    theta, m, v = rounded_update.adamw_fp32(pair, grad, exp_avg, exp_avg_sq,
                                            coefficients, found_inf, betas)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    # $w' = \operatorname{rn}(x')$, then $c' = \operatorname{rn}(x' - w')$
    weight = theta.bfloat16()
    shard.copy_(weight)
    compensation.copy_(theta - weight.float())


@functools.cache
def compiled_update():
    """`adamw_kahan_` compiled, made once at its first GPU call."""
    return rounded_update.compile_update(adamw_kahan_, exact_casts=True)
