r"""
---
title: Llama's fused kernels
summary: RMSNorm in one pass, SwiGLU's gate and its backward in one pass, the
  rotation of q and k in one compiled pass, and GPT-NeoX's chunked readout and
  loss, each beside its plain twin and chosen once where the model is built.
---

# Llama's fused kernels

What GPT-NeoX's [fused kernels page](../neox/kernels.html) says holds here: the
matrix products run near the GPU's rate, and the passes between them are
bound by the bytes they move, at least $(r + w)\,n / \beta$ for a pass that
reads $r$ and writes $w$ bytes per element of $n$. A fusion wins by touching
each element fewer times. `LlamaKernels` names four fusions, each beside its
field below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from labml_zero.neox.kernels import ModelKernels, on_gpu_compiled, resolve_auto

__all__ = ["LlamaKernels", "resolve_llama_kernels", "rms_norm", "rms_norm_fused",
           "swiglu", "swiglu_fused"]

AUTO = "auto"
"""The `spec` that turns every fusion on on CUDA and off elsewhere."""


@dataclass(frozen=True)
class LlamaKernels:
    """
    ## Which kernels the Llama model runs

    Every field off is the plain PyTorch model. The names are read as
    `ModelKernels` reads its own: `from_names("loss,rotary")`, `'all'`,
    `'none'`; its class methods look only at the fields of the class they are
    called on, so they are shared, not copied.
    `build_layers(config, kernels=...)` hands the choice to every layer once,
    and a layer calls the function the choice resolved to. Attention is not
    among them: it is PyTorch's `scaled_dot_product_attention`, whose backend
    PyTorch picks.
    """

    rms_norm: bool = False
    """Every RMSNorm in one pass (`rms_norm_fused`), where the plain path
    writes an fp32 copy of $x$, its square, the scaled copy and its cast."""
    swiglu: bool = False
    r"""$\operatorname{SiLU}(g) \odot u$ and its backward in one pass each,
    where the plain path saves and rereads $\operatorname{SiLU}(g)$, a
    `[B, T, d_ff]` tensor."""
    rotary: bool = False
    """The rotation of q and k in one compiled pass over both, reading the
    tables `LlamaRotary` built once for every layer (`rotate_qk_fused` on the
    [rotary page](rotary.html))."""
    loss: bool = False
    """The readout and the cross-entropy in chunks of `loss_chunk_rows`,
    never holding the `[B T, V]` logits: GPT-NeoX's `chunked_readout_loss`
    with the readout's weight, which in a tied model is the embedding's
    matrix; autograd sums the gradients of its two uses."""
    loss_chunk_rows: int = 2048
    """Rows (tokens) per chunk of the chunked loss: one chunk's fp32 logits are
    `loss_chunk_rows` × $V$ × 4 bytes."""
    fp8: bool = field(default=False, metadata={"precision": True})
    """The decoder layers' large linears in fp8 ([fp8 matrix
    products](../layers/float8.html)): a precision, named on its own, never in
    `all` or `auto`."""
    fp8_emulate: bool = field(default=False, metadata={"test": True})
    """torchao's emulation of the fp8 products, for the CPU tests only."""
    fp8_every_linear: bool = field(default=False, metadata={"test": True})
    """fp8 on every linear of a shape the product takes, not only where it
    pays (`fp8_pays`): the tests' tiny models and the activation probe."""

    def __post_init__(self):
        if self.loss_chunk_rows < 1:
            raise ValueError(f"LlamaKernels: loss_chunk_rows must be >= 1, "
                             f"got {self.loss_chunk_rows}")

    fusions = classmethod(ModelKernels.fusions.__func__)
    choices = classmethod(ModelKernels.choices.__func__)
    all_fused = classmethod(ModelKernels.all_fused.__func__)
    from_names = classmethod(ModelKernels.from_names.__func__)
    names = ModelKernels.names


def resolve_llama_kernels(spec: str, device: torch.device | str) -> LlamaKernels:
    """
    ## `'auto'`, `'none'` or fusion names, to `LlamaKernels` for `device`

    `'auto'` is every fusion on CUDA and none elsewhere, where the compiled
    functions would run as their twins anyway; `'auto,fp8'` adds fp8. An
    unknown name is a `ValueError` naming it. Names only: whether fp8 can
    run on the device is `check_fp8`'s, before the start.
    """
    return resolve_auto(LlamaKernels, spec, device)


# ## RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    r"""
    ### $w \odot x / \sqrt{\overline{x^2} + \epsilon}$, the mean in fp32

    Hugging Face's order: the normalised value is cast back to `x`'s dtype
    before the weight multiplies it, so the compiled pass gives the plain
    path's bf16 numbers, not more precise ones. Uncompiled, each of the cast,
    the square, the mean, the scale, the cast back and the weight is a pass
    over `[B, T, d]`, most of them in fp32; compiled, $x$ is read once and the
    output written once.
    """
    x32 = x.float()  # [B, T, d] fp32; a copy only when x is 16-bit
    rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [B, T, 1]
    return weight * (x32 * rms).to(x.dtype)


# Each fused function is its plain twin compiled (`torch.compile` of the same
# Python function), and only on CUDA tensors: on a CPU, or inside a compiled
# layer, the twin runs
# (tested: tests/llama/test_kernels.py::test_model_with_every_kernel_is_the_plain_model).
rms_norm_fused = on_gpu_compiled(rms_norm)


# ## SwiGLU's gate


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    r"""
    ### $\operatorname{SiLU}(g) \odot u$, `[B, T, d_ff]` each

    With $\sigma$ the logistic function, the backward pass is

    $$\frac{\partial L}{\partial u} = \bar h \odot g\,\sigma(g), \qquad
      \frac{\partial L}{\partial g} = \bar h \odot u \odot
      \sigma(g)\,\bigl(1 + g\,(1 - \sigma(g))\bigr),$$

    both from $g$, $u$ and the incoming $\bar h$: compiled, one pass forward
    and one backward, which save only $g$ and $u$ (the products' outputs,
    saved anyway), where the plain path also writes and saves
    $\operatorname{SiLU}(g)$.
    """
    return F.silu(gate) * up


swiglu_fused = on_gpu_compiled(swiglu)

