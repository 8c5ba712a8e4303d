r"""
---
title: bf16 weights without a master, by stochastic rounding
summary: The "bf16-stochastic" choice keeps no fp32 master; each update is
  computed in fp32 from the bf16 weight and rounded back up or down at random,
  in proportion, so small updates survive on average.
---

# bf16 weights without a master

This page deepens [AdamFP16](adam_fp16.html) for the `"bf16-stochastic"`
[state layout](../zero3/state_layout.html): bf16 moments and no master,
$K = 2 + 2$ bytes per element. The update widens the bf16 weight to fp32, runs
the fp32 update of [narrow moments](narrow_moments.html) on it, and rounds the
result $x$ back to a neighbour $x_\downarrow \le x \le x_\uparrow$ at random:

$$\operatorname{sr}(x) = x_\uparrow \text{ with probability }
  \frac{x - x_\downarrow}{x_\uparrow - x_\downarrow}, \text{ else }
  x_\downarrow; \qquad \mathbb{E}[\operatorname{sr}(x)] = x,$$

so an update smaller than half a bf16 step, which rounding to nearest loses,
survives on average
(tested: tests/optimizers/test_stochastic_rounding.py::test_small_updates_survive_on_average).

## Limitations

* The update has two forms that draw the same bits: on a GPU one compiled
  pass per shard (`adamw_stochastic_`, [the update in one
  pass](rounded_update.html) without its master), and on a CPU, or for a
  host home, the twin (`update`: the fp32 kernel on widened slices). They
  agree within the fp32 roundings of an update
  (tested: tests/optimizers/test_stochastic_rounding.py::test_one_pass_is_the_twin_within_rounding).
* Offloaded, the host keeps a copy of the weight to update: $K + p$ =
  {{py: state_layout.BF16_STOCHASTIC.host_bytes_per_element(2)}} bytes an
  element in host memory for a bf16 shard (see the host home's Note: a host
  home without a master, in [where a shard's optimizer state
  lives](shard_home.html)); the noise hashes the shard's position and the
  step, wherever the update runs, so the host draws the device's bits.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from . import rounded_update
from .narrow_moments import Kernel, widened_update

# Odd constants of the hash (xxHash's and the golden ratio's): any odd
# multiplier is a bijection mod $2^{32}$. Each is kept as its signed
# residue, $c - 2^{32}$ where $c \ge 2^{31}$: the same number mod $2^{32}$,
# so the same hash, and a literal that a compiled kernel may multiply with
# an element's index, an int32 there.
MIX = tuple(c - 2**32 if c >= 2**31 else c
            for c in (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1))
LOW_32 = 0xFFFFFFFF


def noise(start: int, numel: int, step: torch.Tensor, salt: int) -> torch.Tensor:
    r"""
    ### Random bits per element, from a hash

    From the element's position, the shard and the step count, not from a
    generator: there is no state to save, a resume draws the same bits, and
    a captured step reads its count from the device tensor it refills.
    `[numel]` int32 in $[0, 2^{16})$ for the elements `start` to
    `start + numel` of shard `salt` at step `step` (a 0-dim device tensor,
    so a captured step hashes each replay's own count). The hash mixes the
    three with multiplications and xor-shifts mod $2^{32}$ (xxHash's
    finaliser), in int64: every product's low half of bits is exact.
    """
    device = step.device
    # [numel] int64
    x = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    x = x * MIX[0] + step.to(torch.int64) * MIX[1] + salt * MIX[2]
    x &= LOW_32
    for multiplier in MIX[3:]:
        x ^= x >> 15
        x = (x * multiplier) & LOW_32
    x ^= x >> 16
    return (x & 0xFFFF).to(torch.int32)


def stochastic_round(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    r"""
    ### $\operatorname{sr}(x)$: fp32 to bf16, up or down at random

    A bf16 value is an fp32 value whose low half of bits is zero. Adding a
    uniform $r \in [0, 2^{16})$ to those bits of $|x|$ (the sign sits apart,
    so the magnitude's bits carry into the next bf16 step) and dropping them
    rounds up exactly when $r \ge 2^{16} - \text{low}$, with probability
    $\text{low} / 2^{16}$, the fraction of the step that $x$ has gone.
    A bf16 value has nothing to round and stays itself.
    """
    # int32 view of fp32 bits, `x`'s shape; $-2^{16}$ keeps the high half
    rounded = (x.view(torch.int32) + bits) & -65536
    return rounded.view(torch.float32).to(torch.bfloat16)


def update(kernel: Kernel, shards: Sequence[torch.Tensor],
           grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
           exp_avg_sqs: Sequence[torch.Tensor], *, step: torch.Tensor,
           salts: Sequence[int]) -> None:
    """
    ### One update of bf16 shards that are their own weights

    `kernel` is the fp32 update of [narrow moments](narrow_moments.html);
    per shard and slice (`widened_update`) the weight and the moments are
    widened, updated in fp32, and stored: the moments rounded to nearest, a
    bf16 weight stochastically (an fp32 one is its own master, updated in
    place). A skipped update (`found_inf`) leaves the widened values as they
    were, which round back to themselves.
    """
    # a 0-d parameter as its one element (a view): `store` slices dim 0
    shards = torch.atleast_1d(list(shards))

    def store(i: int, piece: slice, weight: torch.Tensor) -> None:
        # an fp32 shard was updated in place (`.float()` is itself)
        if shards[i].dtype != torch.bfloat16:
            return
        # `piece` slices dim 0 (a plain parameter may have any shape): the
        # bits of its elements' flat row-major positions, as the one pass
        # hashes them, shaped as the slice (a flat shard: one element a row)
        first = piece.start * math.prod(shards[i].shape[1:])
        bits = noise(first, weight.numel(), step, salts[i]).view(weight.shape)
        shards[i][piece].copy_(stochastic_round(weight, bits))

    widened_update(kernel, grads, exp_avgs, exp_avg_sqs,
                   widen=lambda i, piece: shards[i][piece].float(), store=store)


def adamw_stochastic_(shard: torch.Tensor, moments: tuple[torch.Tensor, ...],
                      grad: torch.Tensor, coefficients: torch.Tensor,
                      found_inf: torch.Tensor | None,
                      betas: rounded_update.Betas, step: torch.Tensor,
                      salt: int) -> None:
    r"""
    ### The whole update of a bf16 shard in one pass

    The twin's three passes over each slice (widen, the fp32 kernel, round)
    and its hash, which runs as a dozen int64 kernels, move some hundreds of
    bytes an element; compiled, this one reads the weight, the moments and
    the gradient once and writes the three once. `shard` `[S]` bf16, updated
    in place; `moments` `(exp_avg, exp_avg_sq)` `[S]` bf16; the rest as for
    [`adamw_rounded_`](rounded_update.html). The bits are the twin's for the
    same element, step and `salt`, since the hash reads the element's
    position in the shard, not in a slice. A skipped update writes the
    widened weight, which rounds back to itself.
    """
    exp_avg, exp_avg_sq = moments
    theta, m, v = rounded_update.adamw_fp32(shard.float(), grad, exp_avg,
                                            exp_avg_sq, coefficients,
                                            found_inf, betas)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    # [S] int32 by flat position, shaped as the shard (a plain parameter's
    # may be N-d)
    bits = noise(0, shard.numel(), step, salt).view(shard.shape)
    shard.copy_(stochastic_round(theta, bits))


@functools.cache
def compiled_update():
    """`adamw_stochastic_` compiled, made once at its first GPU call; a
    second `salt` or size makes Dynamo compile it once more, for any."""
    return rounded_update.compile_update(adamw_stochastic_)
