r"""
---
title: Moments narrower than the master
summary: AdamW with an fp32 master and bf16 moments, computed in fp32 and
  rounded as the moments are stored, slice by slice around the fp32 kernel.
---

# Moments narrower than the master

This page deepens [AdamFP16](adam_fp16.html) for the `"bf16-moments"`
[state layout](../zero3/state_layout.html): the master stays fp32, and Adam's
moments $m$ and $v$ are kept in bf16, $K = 4 + 2 + 2$ bytes per element.
A step reads the stored moments, widens them to fp32 (exact),
runs the fp32 update, and rounds the new moments as it stores them:

$$\hat m_t = \operatorname{bf16}\big(\beta_1 \hat m_{t-1} + (1 - \beta_1) g_t\big),
  \qquad
  \hat v_t = \operatorname{bf16}\big(\beta_2 \hat v_{t-1} + (1 - \beta_2) g_t^2\big),$$

while the master's step uses the unrounded fp32 values: `torch.optim.AdamW`
whose moments are rounded to bf16 after every step, bit for bit
(tested: tests/optimizers/test_narrow_moments.py::test_bf16_moments_are_adamw_with_moments_rounded_each_step).
The loop that widens and rounds, `widened_update`, also serves the layouts
without a master, which widen the weight too ([stochastic
rounding](stochastic_rounding.html), [Kahan summation](kahan_summation.html)).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

# Elements widened at once: bounds the fp32 temporaries of the twin to
# $2 \cdot 4 \cdot 2^{22}$ bytes for the two moments whatever the shard's
# size, and $4 \cdot 2^{22}$ more where the weight is widened too (a layout
# without a master); a multiple of every vector width, so a slice ends where
# a whole shard's loop would.
WIDE_NUMEL = 2**22

Kernel = Callable[[list, list, list, list], None]


def update(kernel: Kernel, masters: Sequence[torch.Tensor],
           grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
           exp_avg_sqs: Sequence[torch.Tensor]) -> None:
    """
    ### One update of fp32 masters, whatever the moments' dtype

    `kernel(masters, grads, exp_avgs, exp_avg_sqs)` is the fp32 update
    (`AdamFP16._kernel`, fused or `foreach`), all lists of `[S]` fp32. With
    fp32 moments it runs once on the whole batch. With narrower moments it
    runs per shard and slice, on fp32 copies of the slice's moments, which
    are then rounded back into place: a skipped update (a non-finite
    gradient, `found_inf`) leaves the copies as they were, and a bf16 value
    widened and rounded back is itself.

    Each store rounds to bf16's 8 significant bits (7 stored), a relative
    error of at most $2^{-8}$ in $m$ and $v$; the master, where the small updates add up,
    keeps all of fp32's. On a GPU the [one-pass kernel](rounded_update.html)
    does the same in one kernel; here the widening costs fp32 temporaries
    (`WIDE_NUMEL`) beside the kernel's own traffic.
    """
    if all(m.dtype == torch.float32 for m in (*exp_avgs, *exp_avg_sqs)):
        kernel(list(masters), list(grads), list(exp_avgs), list(exp_avg_sqs))
        return
    # a 0-d parameter as its one element: `widened_update` slices dim 0
    masters = torch.atleast_1d(list(masters))
    # the kernel writes the master's slice in place: nothing left to store
    widened_update(kernel, grads, exp_avgs, exp_avg_sqs,
                   widen=lambda i, piece: masters[i][piece],
                   store=lambda i, piece, weight: None)


def widened_update(kernel: Kernel, grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor],
                   exp_avg_sqs: Sequence[torch.Tensor], *,
                   widen: Callable[[int, slice], torch.Tensor],
                   store: Callable[[int, slice, torch.Tensor], None]) -> None:
    """
    #### The slice loop every narrow state shares

    Per shard `i` and slice `piece` of `WIDE_NUMEL` elements: `widen(i, piece)`
    gives the fp32 weight the kernel updates (the master's slice itself, or
    a copy made from narrower states), the moments are widened beside it,
    the kernel runs, the moments are rounded back into place and
    `store(i, piece, weight)` puts the updated fp32 weight wherever it is
    kept ([stochastic rounding](stochastic_rounding.html), [Kahan
    summation](kahan_summation.html)).

    Every tensor is sliced along dim 0, so each must have one: a caller
    whose `widen` and `store` index a 0-d parameter's tensors passes them as
    one element each (`torch.atleast_1d`, a view).
    """
    grads, exp_avgs, exp_avg_sqs = (torch.atleast_1d(list(ts)) for ts in
                                    (grads, exp_avgs, exp_avg_sqs))
    for i, (grad, exp_avg, exp_avg_sq) in enumerate(zip(grads, exp_avgs,
                                                        exp_avg_sqs)):
        for start in range(0, exp_avg.numel(), WIDE_NUMEL):
            piece = slice(start, start + WIDE_NUMEL)
            # [min(S - start, WIDE_NUMEL)] fp32 each, exact copies of the
            # stored
            weight = widen(i, piece)
            wide_avg = exp_avg[piece].float()
            wide_avg_sq = exp_avg_sq[piece].float()
            kernel([weight], [grad[piece]], [wide_avg], [wide_avg_sq])
            # round to nearest even, as every cast to bf16
            exp_avg[piece].copy_(wide_avg)
            exp_avg_sq[piece].copy_(wide_avg_sq)
            store(i, piece, weight)


@contextlib.contextmanager
def contiguous(tensors: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    r"""
    #### `tensors` laid out in memory order, for the kernels that need it

    Yields each tensor itself where it is contiguous, else a contiguous copy,
    which is copied back into it when the block ends without an error.

    #### Note: operands in memory order

    Two kernels of the update read a tensor's memory, not its indices:

    * PyTorch's fused AdamW (`torch._fused_adamw_`, its CPU kernel at least)
      pairs the elements of its operands by their place in memory: a
      transposed master beside a row-major gradient, or a slice of a wider
      tensor, is updated with other elements' gradients and moments,
      silently;
    * the [8-bit update](blockwise_moments.html) views each tensor flat
      (`view(-1)`) to cut it into blocks, which a tensor whose elements are
      not evenly spaced in memory refuses.

    The engine's shards, their gradients and their states are flat and
    contiguous, so neither hazard arises there; but `AdamFP16` takes any
    parameter, a transposed view registered as one or a parameter whose
    `.data` is a slice included. Those kernels get contiguous operands: one
    copy in and one out per step for each tensor that is not (the gradient,
    only read, is copied in alone); the `foreach` kernels index by strides
    and need none. The elements keep their row-major order, so such a
    parameter is updated as the flat parameter of its elements, bit for bit
    (tested: tests/optimizers/test_adam_fp16.py::test_a_parameter_of_any_layout_is_updated_as_its_flat_elements).
    """
    dense = [t.contiguous() for t in tensors]
    yield dense
    for t, d in zip(tensors, dense):
        if d is not t:
            t.copy_(d)
