r"""
---
title: Llama rotary embeddings
summary: Rotary embeddings over the whole head, with a base per model and Llama
  3's scaling of the slow frequencies; one table for every layer.
---

# Llama rotary embeddings

The rotation is GPT-NeoX's ([its page](../neox/rotary.html)), with three
differences. It turns **every** dimension of a head ($d_r = d_h$, where
GPT-NeoX turns a quarter); its base $b$ is a field of the model
(`rope_theta`, far larger in Llama 3 and Qwen2.5 than in GPT-NeoX); and
Llama-3.1 and Llama-3.2 **scale** the frequencies $\theta_i = b^{-2i/d_h}$
so that a model pretrained on $L_0$ positions reaches $s L_0$
(`inverse_frequencies`).
"""

from __future__ import annotations

import math

import torch

from labml_zero.llama.config import LlamaConfig
from labml_zero.neox.kernels import on_gpu_compiled
from labml_zero.neox.rotary import RotaryTables, rotate_half

__all__ = ["inverse_frequencies", "LlamaRotary", "apply_rotary", "rotate_qk",
           "rotate_qk_fused"]


def inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    r"""
    ### $\theta_i'$ for $i < d_h / 2$, fp32, on the CPU

    With the wavelength $\lambda_i = 2\pi / \theta_i$,

    $$\theta_i' = \begin{cases}
      \theta_i & \lambda_i < L_0 / \beta \\
      \theta_i / s & \lambda_i > L_0 / \alpha \\
      (1 - \sigma_i)\,\theta_i / s + \sigma_i\,\theta_i & \text{otherwise,}
    \end{cases} \qquad \sigma_i = \frac{L_0 / \lambda_i - \alpha}{\beta - \alpha}$$

    (`RopeScaling`: $s$ its `factor`, $\alpha$ and $\beta$ its low and high
    frequency factors). Fast frequencies, which resolve nearby tokens, are
    kept; slow ones, whose period exceeds the pretraining context, are slowed
    down by $s$, and those between are blended.

    Computed in fp32 as Hugging Face does, so the angles $m \theta_i'$ are the
    same numbers in both.
    """
    d_h = config.head_width
    # [d_h / 2] fp32: $\theta_i = b^{-2i / d_h}$
    theta = 1.0 / config.rope_theta ** (
        torch.arange(0, d_h, 2, dtype=torch.int64).float() / d_h)
    scaling = config.rope_scaling
    if scaling is None:
        return theta
    s, alpha, beta = (scaling.factor, scaling.low_freq_factor,
                      scaling.high_freq_factor)
    L0 = scaling.original_max_position
    wavelength = 2 * math.pi / theta
    slowed = torch.where(wavelength > L0 / alpha, theta / s, theta)
    sigma = (L0 / wavelength - alpha) / (beta - alpha)
    blended = (1 - sigma) * slowed / s + sigma * slowed
    middle = ~(wavelength < L0 / beta) & ~(wavelength > L0 / alpha)
    return torch.where(middle, blended, slowed)


class LlamaRotary(RotaryTables):
    r"""
    ## The cos and sin tables, once for every layer

    GPT-NeoX's `RotaryTables` ([its page](../neox/rotary.html)): one cache
    shared by the layers, its entry made by each layer's forward pre-hook
    before a compiled forward traces the lookup, so a recomputed forward
    (activation checkpointing) runs the graph of the forward it replays.
    Only the angles differ: $m\theta_i'$ over the whole head, from
    `inverse_frequencies`.
    """

    def __init__(self, config: LlamaConfig, max_entries: int = 4):
        super().__init__(config, max_entries)
        self.inv_freq = inverse_frequencies(config)  # [d_h / 2] fp32

    def compute(self, n_positions: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$\cos m\theta_i'$ and $\sin m\theta_i'$, each `[n_positions, d_h]`."""
        positions = torch.arange(n_positions, device=device).float()
        # [T, d_h / 2] fp32: in bf16 the positions themselves are not exact
        angles = torch.outer(positions, self.inv_freq.to(device))
        angles = torch.cat([angles, angles], dim=-1)  # [T, d_h], both halves
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> torch.Tensor:
    """`x` `[B, heads, T, d_h]` rotated; `cos`, `sin` `[T, d_h]` broadcast."""
    return x * cos + rotate_half(x) * sin


# ### Rotating q and k in one pass
#
# The attention calls one of this pair, chosen by `LlamaKernels.rotary`. The
# plain twin is two rotations, each five elementwise passes (two products,
# the halves' negation and concatenation, the sum) that write a `[B, heads, T,
# d_h]` tensor; compiled, one kernel reads q, k and the tables and writes the
# rotated q and k, and its backward pass, the same rotation by $-m\theta_i'$,
# is one kernel too. q and k stay two tensors: their head counts differ under
# grouped-query attention.


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`q` `[B, n_h, T, d_h]` and `k` `[B, n_kv, T, d_h]`, each rotated: query
    and key heads differ in number under grouped-query attention, so they are
    two tensors, not one stacked view as in GPT-NeoX."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


rotate_qk_fused = on_gpu_compiled(rotate_qk)
