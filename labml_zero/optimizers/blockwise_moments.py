r"""
---
title: Moments in 8 bits, block by block
summary: AdamW with an fp32 master and both moments stored as 8-bit codes,
  one fp32 absmax scale per block and a square-root code map.
---

# Moments in 8 bits, block by block

This page deepens [narrow moments](narrow_moments.html) for the
`"8bit-moments"` [state layout](../zero3/state_layout.html): the master stays
fp32, and each moment is kept as one byte per element plus one fp32 scale per
block of $B$ elements (as bitsandbytes' and torchao's 8-bit Adam do),

$$K = 4 + 1 + 1 + 2 \cdot \frac{4}{B}$$

(tested: tests/optimizers/test_blockwise_moments.py::test_the_layout_counts_its_scales)
bytes per element, {{py: state_layout.EIGHT_BIT_MOMENTS.bytes_per_element() | .5g}}
at {{const: BLOCK}}, against
{{py: state_layout.BF16_MOMENTS.bytes_per_element()}} with bf16 moments and
{{py: state_layout.FP32_STATES.bytes_per_element()}} with fp32 ones.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from labml_zero.zero3.state_layout import EIGHT_BIT_BLOCK

BLOCK = EIGHT_BIT_BLOCK
"""$B$, elements per scale: a scale costs $4 / B$ bytes per element."""

# Elements decoded at once, as `narrow_moments.WIDE_NUMEL`; a multiple of
# `BLOCK`, so a slice never splits a block. There is no one-pass kernel:
# decoding, the fp32 kernel and encoding are separate passes over fp32
# temporaries of this size, so a step moves more bytes than with bf16 moments.
WIDE_NUMEL = 2**22

# $L_m$ and $L_v$, the levels of each map: the signed one spends the codes
# $0 \dots 2 L_m$ on $-L_m \dots L_m$, the unsigned one all of a byte's.
# Square-root maps are coarser near zero than bitsandbytes' dynamic tree map.
SIGNED_LEVELS = 127
UNSIGNED_LEVELS = 255

Kernel = Callable[[list, list, list, list], None]


def n_blocks(numel: int) -> int:
    """Scales of a shard of `numel` elements: the last block may be partial."""
    return -(-numel // BLOCK)


# ## The code maps
#
# A linear map would give every block equal steps of $a_j / L$: in a block
# whose largest $v$ is orders of magnitude above its smallest (common: $v$ is
# a squared gradient), most elements would decode to $\hat v = 0$ and take a
# step $\hat m / \epsilon$. Both maps here are root maps, fine near zero and
# coarse near $a_j$, with $L_m$ levels each side of zero for $m$
# (`SIGNED_LEVELS`, zero exact) and $L_v$ for $v$ (`UNSIGNED_LEVELS`, all of
# a byte):
#
# * $m$, signed, in the square root:
#   $q = \operatorname{round}(L_m \operatorname{sign}(r)\sqrt{|r|})$,
#   $\phi(q) = \operatorname{sign}(q)(q/L_m)^2$.
# * $v$, unsigned, in the fourth root: $q = \operatorname{round}(L_v\,r^{1/4})$,
#   $\phi(q) = (q/L_v)^4$. The update divides by $\sqrt{v}$, which has the
#   units of $m$: $\sqrt{\hat v} = \sqrt{a_j}\,(q/L_v)^2$ is the same
#   square-root map as $m$'s, with twice the levels. An element decodes to
#   zero only below $a_j / (2 L_v)^4$, where $\sqrt{v}$ is $(2 L_v)^2$ times
#   below the block's largest.
#
# The error bound follows from rounding in the root: with $s = |r|^{1/e}$
# ($e = 2$ for $m$, $e = 4$ for $v$) and $L$ levels,
# $|s - \hat s| \le \frac{1}{2L}$, and since $s, \hat s \le 1$,
# $|s^e - \hat s^e| \le e \, |s - \hat s|$, so
#
# $$|x - \hat x| \le \frac{e}{2L} \, a_j,$$
#
# $a_j / L_m$ for $m$ and $2 a_j / L_v$ for $v$
# (tested: tests/optimizers/test_blockwise_moments.py::test_round_trip_error_is_bounded_by_the_map_step).
# bitsandbytes' dynamic tree map is finer still near zero; the root maps are
# a line each, and Adam stays stable with them
# (tested: tests/optimizers/test_blockwise_moments.py::test_a_tiny_model_trains_as_with_fp32_moments).


def _power(signed: bool) -> int:
    return 2 if signed else 4


def _levels(signed: bool) -> int:
    return SIGNED_LEVELS if signed else UNSIGNED_LEVELS


def encode(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *,
           signed: bool) -> None:
    r"""
    ### Store fp32 `x` [n] as uint8 `codes` [n] and fp32 `scales` [n_blocks(n)]

    A block $j$ of a moment $x$ is stored as its absmax
    $a_j = \max_{i \in j}|x_i|$ and codes $q_i$ of
    $r_i = x_i / a_j \in [-1, 1]$, decoded as $\hat x_i = a_j \, \phi(q_i)$.

    Torch ops only, no host sync: the same code runs in a captured step. The
    last block may be partial: it is padded with zeros, which leave its
    absmax as it is.
    """
    n = x.numel()
    pad = n_blocks(n) * BLOCK - n
    # [n_blocks, B] fp32
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    scales.copy_(absmax)
    # an all-zero block: any scale decodes its zero codes to zero
    r = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    levels = _levels(signed)
    root = r.abs().pow(1.0 / _power(signed))
    q = torch.round(root * levels)
    if signed:
        # $[-L_m, L_m]$ stored as $[0, 2 L_m]$
        q = q * torch.sign(r) + SIGNED_LEVELS
    codes.copy_(q.view(-1)[:n])


def decode(codes: torch.Tensor, scales: torch.Tensor, *,
           signed: bool) -> torch.Tensor:
    r"""### $\hat x = a_j \phi(q)$: fp32 [n] from `codes` [n] and `scales`

    `scales` holds one value per block ($\lceil n / B \rceil$) or, read
    from a checkpoint, one per element (each its block's).
    """
    n = codes.numel()
    q = codes.float()
    if signed:
        q = q - SIGNED_LEVELS
    levels = _levels(signed)
    phi = (q.abs() / levels).pow(_power(signed))
    if signed:
        phi = phi * torch.sign(q)
    if scales.numel() != n:
        # one scale per block, the last block partial
        scales = scales.repeat_interleave(BLOCK)[:n]
    return phi * scales


def update(kernel: Kernel, masters: Sequence[torch.Tensor],
           grads: Sequence[torch.Tensor],
           moments: Sequence[Sequence[torch.Tensor]]) -> None:
    r"""
    ### One update of fp32 masters with 8-bit moments

    `moments` is the layout's `exp_avg`, `exp_avg_absmax`, `exp_avg_sq` and
    `exp_avg_sq_absmax`, each a list over the shards. Per shard and slice
    the moments are decoded to fp32, `kernel` (the fp32 update) runs on them,
    and they are encoded back. A skipped update (`found_inf`) leaves the
    decoded copies as they were, and re-encoding a decoded block gives its
    codes and scales back (see the loading section below), so a skipped step
    leaves the moments as they were. That holds while $a_j \phi(q)$ is a
    normal fp32 number, not for a block whose absmax is near fp32's subnormal
    range. The master's step uses the undecoded fp32 values: this is
    `torch.optim.AdamW` whose moments are encoded and decoded after every
    step, bit for bit
    (tested: tests/optimizers/test_blockwise_moments.py::test_8bit_moments_are_adamw_with_moments_coded_each_step).

    Every size here is the shard's, never the data's, and nothing reads a
    value on the host: a [captured step](captured_update.html) records these
    ops as they are, its temporaries taken from the graph's pool.
    """
    exp_avgs, avg_scales, exp_avg_sqs, sq_scales = moments
    for master, grad, m, m_scale, v, v_scale in zip(
            masters, grads, exp_avgs, avg_scales, exp_avg_sqs, sq_scales):
        # flat views: a plain parameter's master may have any shape
        master, m, v = (t.view(-1) for t in (master, m, v))
        grad = grad.reshape(-1)
        for start in range(0, master.numel(), WIDE_NUMEL):
            piece = slice(start, start + WIDE_NUMEL)
            blocks = slice(start // BLOCK, (start + WIDE_NUMEL) // BLOCK)
            # [min(S - start, WIDE_NUMEL)] fp32
            wide_m = decode(m[piece], m_scale[blocks], signed=True)
            wide_v = decode(v[piece], v_scale[blocks], signed=False)
            kernel([master[piece]], [grad[piece]], [wide_m], [wide_v])
            encode(wide_m, m[piece], m_scale[blocks], signed=True)
            encode(wide_v, v[piece], v_scale[blocks], signed=False)


# ## Loading a state of another layout
#
# A checkpoint reader gives an 8-bit moment's scales per element, each
# element's own block's (the saved shard's blocks need not be the new
# shard's). Decoding with those is exact arithmetic on what was saved, and
# re-encoding a decoded block gives back its codes and scale (its absmax
# element decodes to $a_j \cdot 1$), so a resume within `"8bit-moments"` at
# the same shards is bit-exact; at other shards the blocks are new ones,
# encoded once.

CODED = (("exp_avg", True), ("exp_avg_sq", False))
"""Each coded moment and whether its map is signed; its scales are
`<name>_absmax`."""


def convert(state: dict, *, blockwise: bool) -> dict:
    """
    ### A shard's state, its moments converted for a layout

    `state` holds each moment as saved: fp32 or bf16, or codes with scales
    per block or per element. With `blockwise` the moments come back coded
    with scales per block; without, decoded to fp32 (the home then casts them
    to its dtype) and without scales.
    """
    state = dict(state)
    for name, signed in CODED:
        scale = f"{name}_absmax"
        codes = state[name]
        if scale in state:
            if blockwise and state[scale].numel() == n_blocks(codes.numel()):
                continue
            # [S] fp32, from per-element scales
            wide = decode(codes, state.pop(scale), signed=signed)
        elif blockwise:
            wide = codes.float()
        else:
            continue
        if not blockwise:
            state[name] = wide
            continue
        state[name] = torch.empty_like(wide, dtype=torch.uint8)
        state[scale] = wide.new_empty(n_blocks(wide.numel()))
        encode(wide, state[name], state[scale], signed=signed)
    return state
