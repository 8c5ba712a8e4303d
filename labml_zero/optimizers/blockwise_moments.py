r"""
---
title: Moments in 8 bits, block by block
summary: AdamW with an fp32 master and both moments stored as 8-bit codes,
  one fp32 absmax scale per block and a square-root code map, the update of
  a shard one compiled pass on a GPU.
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
{{py: state_layout.FP32_STATES.bytes_per_element()}} with fp32 ones. On a
GPU a shard's update, decoding, AdamW's step and encoding, is one kernel.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from labml_zero.zero3.state_layout import EIGHT_BIT_BLOCK, EIGHT_BIT_MOMENTS

from . import rounded_update
from .narrow_moments import contiguous

BLOCK = EIGHT_BIT_BLOCK
"""$B$, elements per scale: a scale costs $4 / B$ bytes per element."""

# Elements updated at once where the update runs eagerly (a CPU's one pass,
# and the `foreach` twin), as `narrow_moments.WIDE_NUMEL`: it bounds their
# fp32 temporaries whatever the shard's size; a multiple of `BLOCK`, so a
# slice never splits a block. On a GPU the one pass is one kernel over the
# whole shard, with no temporaries (see the update in one pass below).
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


def _levels(signed: bool) -> int:
    return SIGNED_LEVELS if signed else UNSIGNED_LEVELS


# The roots and powers of the maps are written as square roots and products,
# not `pow`: each is then one correctly rounded operation wherever it runs, so
# the compiled kernel, the eager twin and a checkpoint's reader code and
# decode alike.

def _root(r: torch.Tensor, signed: bool) -> torch.Tensor:
    """$|r|^{1/e}$: one square root for $m$, two for $v$."""
    root = r.abs().sqrt()
    return root if signed else root.sqrt()


def _power(t: torch.Tensor, signed: bool) -> torch.Tensor:
    r"""$t^e$ of $t \ge 0$: one product for $m$, two for $v$."""
    square = t * t
    return square if signed else square * square


def coded_blocks(blocks: torch.Tensor, *,
                 signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    ### The codes and scales of whole blocks: fp32 `blocks` [n_blocks, B]

    A block $j$ of a moment $x$ is stored as its absmax
    $a_j = \max_{i \in j}|x_i|$ and codes $q_i$ of
    $r_i = x_i / a_j \in [-1, 1]$, decoded as $\hat x_i = a_j \, \phi(q_i)$.
    Returns the codes [n_blocks, B] (fp32, whole numbers) and the scales
    [n_blocks]. Torch ops only, no host sync: the same code runs eagerly, in a
    captured step and compiled.
    """
    absmax = blocks.abs().amax(dim=1)
    # an all-zero block: any scale decodes its zero codes to zero
    r = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    q = torch.round(_root(r, signed) * _levels(signed))
    if signed:
        # $[-L_m, L_m]$ stored as $[0, 2 L_m]$
        q = q * torch.sign(r) + SIGNED_LEVELS
    return q, absmax


def phi(codes: torch.Tensor, *, signed: bool) -> torch.Tensor:
    r"""$\phi(q)$ of uint8 `codes`, fp32 of the same shape."""
    q = codes.float()
    if signed:
        q = q - SIGNED_LEVELS
    unit = _power(q.abs() / _levels(signed), signed)
    return unit * torch.sign(q) if signed else unit


def encode(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *,
           signed: bool) -> None:
    """
    ### Store fp32 `x` [n] as uint8 `codes` [n] and fp32 `scales` [n_blocks(n)]

    The last block may be partial: it is padded with zeros, which leave its
    absmax as it is.
    """
    n = x.numel()
    pad = n_blocks(n) * BLOCK - n
    # [n_blocks, B] fp32
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)
    q, absmax = coded_blocks(blocks, signed=signed)
    scales.copy_(absmax)
    codes.copy_(q.view(-1)[:n])


def decode(codes: torch.Tensor, scales: torch.Tensor, *,
           signed: bool) -> torch.Tensor:
    r"""### $\hat x = a_j \phi(q)$: fp32 [n] from `codes` [n] and `scales`

    `scales` holds one value per block ($\lceil n / B \rceil$) or, read
    from a checkpoint, one per element (each its block's).
    """
    n = codes.numel()
    if scales.numel() != n:
        # one scale per block, the last block partial
        scales = scales.repeat_interleave(BLOCK)[:n]
    return phi(codes, signed=signed) * scales


def update(kernel: Kernel, masters: Sequence[torch.Tensor],
           grads: Sequence[torch.Tensor],
           moments: Sequence[Sequence[torch.Tensor]]) -> None:
    r"""
    ### The twin: one update of fp32 masters with 8-bit moments, in passes

    The update `AdamFP16(fused=False)` takes (its `foreach` kernel), and the
    reference of the one pass below. `moments` is the layout's `exp_avg`,
    `exp_avg_absmax`, `exp_avg_sq` and `exp_avg_sq_absmax`, each a list over
    the shards. Per shard and slice the moments are decoded to fp32, `kernel`
    (the fp32 update) runs on them, and they are encoded back. A skipped
    update (`found_inf`) leaves the decoded copies as they were, and
    re-encoding a decoded block gives its codes and scales back (see the
    loading section below), so a skipped step leaves the moments as they were. That holds while $a_j \phi(q)$ is a
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
        # flat views: a plain parameter's master may have any shape, and
        # any strides (see Note: operands in memory order)
        with contiguous([master, m, v]) as dense:
            master, m, v = (t.view(-1) for t in dense)
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


# ## The update in one pass
#
# The twin moves each element's bytes many times: decoding writes both
# moments in fp32, the fused fp32 kernel reads and writes them again with the
# master and the gradient, encoding reads them once more, and the write-back
# reads the master to round it into the shard. Counting each of those once
# (in eager PyTorch each operation of a decode or an encode is a pass of its
# own), the twin moves at least
# {{py: blockwise_moments.twin_bytes(2) | .6g}} bytes per element for a bf16
# shard and an fp32 gradient.
#
# `adamw_coded_` is the whole update, written once with ordinary PyTorch
# operations on a `[n, B]` view, one block a row: decode $m$ and $v$, AdamW's
# step of the master, encode $m$ and $v$, round the master into the shard.
# `torch.compile` makes it one kernel: a block's new absmax is a reduction
# over its row, and the codes follow from it in the same program, the row
# still at hand. That kernel reads the gradient ($g_b$ bytes), the master,
# the codes and the scales once and writes the master, the codes, the
# scales and the shard ($p$ bytes) once:
#
# $$b = \underbrace{K + g_b}_{\text{read}} + \underbrace{K + p}_{\text{write}},$$
#
# with $K$ this layout's: {{py: blockwise_moments.one_pass_bytes(2, 4) | .6g}}
# bytes per element for a bf16 shard and an fp32 gradient,
# {{py: blockwise_moments.one_pass_bytes(2, 2) | .6g}} with a bf16 gradient;
# the twin moves at least
# {{py: blockwise_moments.twin_bytes(2) / blockwise_moments.one_pass_bytes(2, 4) | .2g}}
# times as many. It is compiled on a GPU; on a CPU (a host home's update, or
# any update of a CPU run) the same function runs eagerly, as the compiled
# kernel's twin.


def twin_bytes(shard_bytes: int) -> float:
    """Per element, at least, with an fp32 gradient: decode (read codes and
    scales, write two fp32 moments), the fused fp32 kernel and its
    write-back (`rounded_update.twin_bytes`), encode (read the two moments,
    write codes and scales)."""
    coded_bytes = EIGHT_BIT_MOMENTS.bytes_per_element() - 4
    wide = 2 * 4
    return (coded_bytes + wide + rounded_update.twin_bytes(shard_bytes)
            + wide + coded_bytes)


def one_pass_bytes(shard_bytes: int, grad_bytes: int) -> float:
    """Per element: $K + g_b + K + p$ (`rounded_update.one_pass_bytes` of this
    layout)."""
    return rounded_update.one_pass_bytes(shard_bytes, grad_bytes,
                                         EIGHT_BIT_MOMENTS)


def adamw_coded_(master: torch.Tensor, grad: torch.Tensor,
                 moments: tuple[torch.Tensor, ...], shard: torch.Tensor | None,
                 coefficients: torch.Tensor, found_inf: torch.Tensor | None,
                 betas: rounded_update.Betas) -> None:
    r"""
    ### One AdamW step of whole blocks with 8-bit moments, in one pass

    Every tensor of a block is a row of $B$ elements:

    * `master`: `[n, B]` fp32, updated in place.
    * `grad`: `[n, B]`, any floating dtype; read once, in fp32 arithmetic.
    * `moments`: `(exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax)`,
      codes `[n, B]` uint8 and scales `[n]` fp32, updated in place.
    * `shard`: `[n, B]` bf16 or fp16, written with the new master rounded;
      `None` when the update writes no shard (an fp32 shard that is its own
      master, or a host home, which uploads it).
    * `coefficients`: `rounded_update.step_coefficients` of this step.
    * `found_inf`: 0-dim fp32, or `None`; when it is not zero nothing changes.

    The arithmetic is the `foreach` kernel's, operation for operation
    (`torch.lerp` for $m$, a product and `addcmul` for $v$), so on a CPU it is
    the twin with that kernel bit for bit, codes, scales and master
    (tested: tests/optimizers/test_blockwise_one_pass.py::test_one_pass_is_the_foreach_twin_bit_for_bit);
    the fused fp32 kernel rounds $v$ in its own order, so with it the master
    agrees within fp32's roundings of a step
    (tested: tests/optimizers/test_blockwise_one_pass.py::test_one_pass_is_the_fused_twin_within_rounding).
    Compiled, a kernel may contract a product and a sum into one rounding,
    within the same roundings again.

    A skipped step selects the old codes, scales and master over the new
    ones, so it leaves them exactly as they were, whatever the block's
    absmax
    (tested: tests/optimizers/test_blockwise_one_pass.py::test_a_skipped_step_leaves_everything_as_it_was).
    No `maximize`, as in `AdamFP16`.
    """
    m_codes, m_scales, v_codes, v_scales = moments
    step_size, bias_correction2_sqrt, decay = coefficients.unbind()
    g = grad.float()
    # [n, B] fp32 each: the stored moments, decoded
    m0 = phi(m_codes, signed=True) * m_scales[:, None]
    v0 = phi(v_codes, signed=False) * v_scales[:, None]
    # m ← β1·m + (1 − β1)·g, as `torch.lerp` rounds it
    m = torch.lerp(m0, g, 1 - betas.beta1)
    # v ← β2·v + (1 − β2)·g²
    v = torch.addcmul(v0 * betas.beta2, g, g, value=1 - betas.beta2)
    # $\theta \leftarrow \theta (1 - \alpha\lambda) - \frac{\alpha}{1 - \beta_1^t}
    # \cdot \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}$
    theta = master * decay - step_size * m / (
        v.sqrt() / bias_correction2_sqrt + betas.eps)
    # the new codes and each block's new absmax: a reduction over the row
    m_new, m_absmax = coded_blocks(m, signed=True)
    v_new, v_absmax = coded_blocks(v, signed=False)
    if found_inf is not None:
        skip = found_inf != 0
        m_new = torch.where(skip, m_codes.float(), m_new)
        v_new = torch.where(skip, v_codes.float(), v_new)
        m_absmax = torch.where(skip, m_scales, m_absmax)
        v_absmax = torch.where(skip, v_scales, v_absmax)
        # skipped, the shard is written with the rounding it already holds
        theta = torch.where(skip, master, theta)
    m_codes.copy_(m_new)
    m_scales.copy_(m_absmax)
    v_codes.copy_(v_new)
    v_scales.copy_(v_absmax)
    master.copy_(theta)
    if shard is not None:
        shard.copy_(theta)


@functools.cache
def compiled_update():
    """`adamw_coded_` compiled (`rounded_update.compile_update`), made once at
    its first GPU call."""
    return rounded_update.compile_update(adamw_coded_)


# Values a padded element takes: a zero gradient, master and moments (the
# signed map codes zero as $L_m$), so its new $m$ and $v$ are zero and leave
# its block's absmax as it is.
_PAD = {"master": 0, "grad": 0, "m": SIGNED_LEVELS, "v": 0, "shard": 0}


def one_pass(master: torch.Tensor, grad: torch.Tensor,
             moments: tuple[torch.Tensor, ...], shard: torch.Tensor | None,
             coefficients: torch.Tensor, found_inf: torch.Tensor | None,
             betas: rounded_update.Betas) -> None:
    """
    ### `adamw_coded_` on a shard of $S$ elements

    The same arguments with `[S]` tensors (any shape and strides of $S$
    elements, blocked in their row-major order). The whole blocks go in one
    call, as `[S // B, B]` views: on CUDA compiled, one kernel launch (a
    second shard size makes Dynamo compile it again for any size, once); on
    a CPU eagerly, slice by slice of `WIDE_NUMEL` elements, which bounds its
    fp32 temporaries. A partial last block is copied into one padded row,
    updated by the same function and copied back. Nothing reads a value on
    the host, so a [captured step](captured_update.html) records it as it is.
    """
    run = compiled_update() if master.is_cuda else adamw_coded_
    # elements per call: the whole shard compiled, a bounded slice eagerly
    span = master.numel() if master.is_cuda else WIDE_NUMEL
    written = [master, moments[0], moments[2]] + ([] if shard is None
                                                  else [shard])
    # flat views: a plain parameter's master may have any shape, and any
    # strides (see Note: operands in memory order)
    with contiguous(written) as dense:
        flat = dict(zip(("master", "m", "v", "shard"),
                        (t.view(-1) for t in dense)))
        flat.setdefault("shard", None)
        flat["grad"] = grad.reshape(-1)
        m_scales, v_scales = moments[1], moments[3]
        whole = master.numel() // BLOCK * BLOCK
        for start in range(0, whole, max(span, BLOCK)):
            end = min(start + span, whole)
            rows = {k: None if t is None else t[start:end].view(-1, BLOCK)
                    for k, t in flat.items()}
            blocks = slice(start // BLOCK, end // BLOCK)
            run(rows["master"], rows["grad"],
                (rows["m"], m_scales[blocks], rows["v"], v_scales[blocks]),
                rows["shard"], coefficients, found_inf, betas)
        if whole == master.numel():
            return
        # [1, B] each: the partial block, padded
        tail = {}
        for k, t in flat.items():
            if t is not None:
                tail[k] = t.new_full((1, BLOCK), _PAD[k])
                tail[k][0, :t.numel() - whole].copy_(t[whole:])
        run(tail["master"], tail["grad"],
            (tail["m"], m_scales[-1:], tail["v"], v_scales[-1:]),
            tail.get("shard"), coefficients, found_inf, betas)
        for k in ("master", "m", "v", "shard"):
            if flat[k] is not None:
                flat[k][whole:].copy_(tail[k][0, :master.numel() - whole])

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
    to its dtype) and without scales. A moment keeps its shape (a plain
    parameter's may be N-d), coded and decoded by its flat elements.
    """
    state = dict(state)
    for name, signed in CODED:
        scale = f"{name}_absmax"
        codes = state[name]
        if scale in state:
            if blockwise and state[scale].numel() == n_blocks(codes.numel()):
                continue
            # [S] fp32 in the codes' shape, from per-block or per-element scales
            wide = decode(codes.reshape(-1), state.pop(scale),
                          signed=signed).view(codes.shape)
        elif blockwise:
            wide = codes.float()
        else:
            continue
        if not blockwise:
            state[name] = wide
            continue
        # [S] uint8 in the moment's shape, contiguous, and [n_blocks(S)] fp32
        state[name] = torch.empty(wide.shape, dtype=torch.uint8,
                                  device=wide.device)
        state[scale] = wide.new_empty(n_blocks(wide.numel()))
        encode(wide.reshape(-1), state[name].view(-1), state[scale],
               signed=signed)
    return state
