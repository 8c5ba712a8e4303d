r"""
---
title: Activation memory of a layer
summary: Bytes that autograd keeps from forward to backward in one GPT-NeoX
  layer, per fine-tuner, with the fused norms and with recomputation.
---

# Activation memory of a layer

This page counts the tensors that one [layer](model.html) keeps from its
forward pass for its backward pass, without allocating any, for eager PyTorch
and bf16 activations; [activation memory](activation_memory.html) adds the
layers up with the readout and the loss. With $n = BT$ tokens per rank, width
$d$, MLP width $d_{ff}$ ($= 4d$), $n_h$ heads and $d_r$ rotary dimensions, a
layer computes $y = \operatorname{MLP}(\operatorname{LN}_2(x)) +
\operatorname{Attn}(\operatorname{LN}_1(x)) + x$, and an operation saves a
tensor only if a gradient that is needed reads it. What a layer keeps depends
on the [fine-tuner](finetuners.html) (the table beside `_layer_bytes`); with
$d_{ff} = 4d$ its bf16 tensors add up to $c\,nd$ elements, and a layer keeps

$$M_{\text{layer}} = 2 c\, nd + 4 \cdot 4n + 4 n_h n
\text{ bytes}, \qquad c = 16, 14, 9 \text{ for all, ffn, biases}.$$
(tested: tests/neox/test_activation_memory.py::test_layer_counts_by_finetuner)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from labml_zero.layers.float8 import check_fp8_count, fp8_inputs_recomputed, no_fp8
from labml_zero.neox.finetuners import finetuner
from labml_zero.neox.kernels import ModelKernels
from labml_zero.neox.lora import TARGETS
from labml_zero.neox.model import NeoXConfig, build_layers

__all__ = ["layer_activation_bytes"]

# Layer norm statistics, attention's log-sum-exp and the loss's softmax are fp32
# whatever the activation dtype (CUDA's accumulate type for bf16 and fp16).
FP32 = 4


# ## Which parameters train


def _trainable(config: NeoXConfig, finetune: str, lora_rank: int = 8,
               lora_targets: Sequence[str] = tuple(TARGETS)
               ) -> tuple[set[str], set[str]]:
    """
    #### The fine-tuner's choice, read off a model on the meta device

    Returns the trainable parameter names of a transformer layer (relative to
    it, e.g. `attention.dense.weight`, or `attention.dense.lora_A` under LoRA)
    and of the other units (`embed_in`, `final_layer_norm`, `embed_out`, with
    their parameter names). Asking the fine-tuner itself keeps this page in step
    with it (and checks the rank and targets); on meta it allocates nothing,
    whatever the width.
    """
    options = ({"rank": lora_rank, "targets": tuple(lora_targets)}
               if finetune == "lora" else {})
    layers = build_layers(replace(config, n_layers=1), device="meta")
    finetuner(finetune, **options)(layers)
    block = {name for name, p in layers[1].named_parameters() if p.requires_grad}
    others = {name for layer in (layers[0], layers[2], layers[3])
              for name, p in layer.named_parameters() if p.requires_grad}
    return block, others


def _check(config: NeoXConfig, batch: int, seq: int, dtype_bytes: int) -> None:
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got {batch} x {seq}")
    if seq > config.max_position:
        raise ValueError(f"seq {seq} exceeds the model's max_position "
                         f"{config.max_position}")
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1, got {dtype_bytes}")


# ## One transformer layer


# ## Note: the attention output is copied
#
# The attention kernel lays its output out in memory as $q$ is laid out, and $q$,
# made by the rotation's `cat`, is `[B, n_h, T, d_h]` (on CPU, and on CUDA with
# the cuDNN and FlashAttention backends). So `transpose(1, 2).reshape(B, T, d)`
# is a *copy*, and the dense linear saves that copy besides the output the
# attention saved: one $nd$ more than counting tensors by name suggests. On the
# benchmark's {{see: W1}}, Pythia-1.4B at {{py: workloads.workloads()["W1"].batch}} ×
# {{py: workloads.workloads()["W1"].seq | d}} tokens, that is 64
# (tested: tests/neox/test_activation_memory.py::test_figures_in_the_notes)
# MiB per layer.
#
# This holds for the CPU kernel and, on CUDA, for the cuDNN (default) and
# FlashAttention backends; the memory-efficient backend writes its output
# `[B, T, n_h, d_h]` whatever the layout of $q$ and saves $nd$ less under the
# full fine-tune. Two or three 8-byte RNG scalars that the CUDA kernels save are
# not counted. The CPU kernel keeps the layer norms' statistics in bf16, not
# fp32; the tests add the difference back.


def _layer_bytes(config: NeoXConfig, trains: set[str], *, batch: int, seq: int,
                 input_requires_grad: bool, dtype_bytes: int,
                 lora_rank: int = 0, fused_norms: bool = False,
                 fp8_recomputed: Callable[[int, int], bool] = no_fp8) -> int:
    r"""
    #### Bytes a layer saves without recomputation

    A linear $z = a W^\top + b$ saves its input
    $a$ only if $W$ trains: $\partial L / \partial a$ needs $W$ (a parameter, no
    activation) and $\partial L / \partial W$ needs $a$. So what a layer keeps
    depends on the fine-tuner (LoRA's column: ✓ where the projection is a
    target):

    | saved tensor | elements | dtype | all | ffn | biases | lora |
    | --- | --- | --- | --- | --- | --- | --- |
    | $x$, the layer input (both layer norms' input) | $nd$ | bf16 | ✓ | ✓ | ✓ | ✓ |
    | mean and $1/\sigma$ of each layer norm | $4n$ | fp32 | ✓ | ✓ | ✓ | ✓ |
    | $\operatorname{LN}_1(x)$, input of the QKV linear | $nd$ | bf16 | ✓ | | | ✓ |
    | $q$ and $k$ (rotated, one new tensor), $v$ (a copy) | $3nd$ | bf16 | ✓ | ✓ | ✓ | ✓ |
    | attention output and log-sum-exp | $nd$, $n_h n$ | bf16, fp32 | ✓ | ✓ | ✓ | ✓ |
    | heads concatenated, input of the dense linear | $nd$ | bf16 | ✓ | | | ✓ |
    | $\operatorname{LN}_2(x)$, input of `dense_h_to_4h` | $nd$ | bf16 | ✓ | ✓ | | ✓ |
    | $h$, input of the GELU | $n d_{ff}$ | bf16 | ✓ | ✓ | ✓ | ✓ |
    | $\operatorname{GELU}(h)$, into `dense_4h_to_h` | $n d_{ff}$ | bf16 | ✓ | ✓ | | ✓ |
    | $A x$ of each adapter, input of $B$ | $n r$ | bf16 | | | | ✓ |

    *LoRA.* An adapted projection computes $y = W x + b + \frac{\alpha}{r}
    B (A x)$ as three linears (`LoRALinear.forward`). The frozen $W x + b$
    saves nothing but $W$ (a parameter); $A x$ saves its input $x$, since
    $\partial L / \partial A = \frac{\alpha}{r} (B^\top g)\, x^\top$ reads it,
    with $g = \partial L / \partial y$ — the same storage the full fine-tune's
    $W$ would save, so each target costs its row of the table once;
    $B (A x)$ saves $u = A x$ `[n, r]`, since
    $\partial L / \partial B = \frac{\alpha}{r} g\, u^\top$; the scaling by the
    number $\alpha / r$ and the sum save nothing, and there is no dropout. The
    adapters' $\partial L / \partial x$ needs only $A$ and $B$, parameters.
    With $r$ and a set $P$ of targets, a layer whose input requires grad keeps
    the biases' set, and besides

    $$M_{\text{lora}} = M_{\text{biases}} + \sum_{t \in P}
    \bigl(\text{the input row of } t + 2 n r\bigr) \text{ bytes},$$

    so on all four, besides the small terms, the bytes of $2 (16 nd + 4 n r)$
    (tested: tests/neox/test_activation_memory.py::test_layer_counts_by_finetuner).
    LoRA trains in every layer, so every layer's input requires grad but the
    first's, behind the frozen embedding: that one saves only what its targets
    make need a gradient.

    Each term is one row of the table, under the condition that makes autograd
    save it; `trains` are the layer's trainable parameter names, `lora_rank` $r$
    the adapters' rank. `fp8_recomputed`: of a product's shape, whether it
    runs in fp8, compiled, so the layer keeps its input only where another
    row keeps it ([fp8 products](../layers/float8.html), `fp8_inputs_recomputed`). A model without
    rotary dimensions (`rotary_pct=0`, none released) differs and is counted so:
    $q$ and $k$ are then views of the fused QKV output and keep all of it ($nd$
    more), and the attention output comes out `[B, T, n_h, d_h]`, so the dense
    linear's input is a view of it (under the full fine-tune $nd$ less).
    """
    n, d, d_ff = batch * seq, config.d_model, config.ff_dim
    nd = n * d * dtype_bytes

    def any_trains(prefix: str) -> bool:
        return any(name.startswith(prefix) for name in trains)

    def input_saved(path: str, in_features: int, out_features: int) -> bool:
        # W's gradient, or an adapter's A's, reads the linear's input; a
        # compiled fp8 product recomputes it in the backward instead
        if fp8_recomputed(in_features, out_features):
            return False
        return f"{path}.weight" in trains or f"{path}.lora_A" in trains

    # A layer norm saves its input and statistics when any of its inputs (x,
    # weight, bias) needs a gradient; both norms read the same x.
    ln1 = input_requires_grad or any_trains("input_layernorm.")
    ln2 = input_requires_grad or any_trains("post_attention_layernorm.")
    # Does the activation after the norm and the first linear require grad?
    attn = ln1 or any_trains("attention.query_key_value.")
    mlp = ln2 or any_trains("mlp.dense_h_to_4h.")

    total = 0
    if ln1 or ln2:
        total += nd  # x, one storage for both norms
    if fused_norms and (ln1 or ln2):
        # `two_layer_norms`: one mean and 1/σ serve both norms (its compiled
        # backward recomputes x̂ from x and them)
        total += 2 * n * FP32
    else:
        total += (int(ln1) + int(ln2)) * 2 * n * FP32  # mean, 1/σ: [B, T, 1] fp32
    if input_saved("attention.query_key_value", d, 3 * d):
        total += nd  # LN1(x)
    if attn:
        # v (a copy) and the attention output, each [B, n_h, T, d_h]
        total += 2 * nd
        total += config.n_heads * n * FP32  # log-sum-exp [B, n_h, T] fp32
        if config.rotary_dim > 0:
            # q, k: one new tensor made by the rotation. The cos and sin it
            # saves too are the model's one table for all layers
            # (`RotaryTables`, $2 \cdot 2 T d_r$ bytes), held before and after
            # the backward pass: not counted, as the parameters are not.
            total += 2 * nd
        else:
            # Unrotated, q and k stay views of the fused QKV output, and saving
            # them keeps all of it, [B, T, 3d].
            total += 3 * nd
    if input_saved("attention.dense", d, d) and (config.rotary_dim > 0 or not attn):
        # The heads concatenated: a copy (see Note: the attention output is
        # copied). Without rotation q, and
        # so the attention output, is laid out [B, T, n_h, d_h] and this is a
        # view of the output, already saved when the attention saves it.
        total += nd
    if input_saved("mlp.dense_h_to_4h", d, d_ff):
        total += nd  # LN2(x)
    if mlp:
        total += n * d_ff * dtype_bytes  # h, read by the GELU's backward
    if input_saved("mlp.dense_4h_to_h", d_ff, d):
        total += n * d_ff * dtype_bytes  # GELU(h)
    # u = A x [n, r] of each adapter, read by B's gradient
    adapters = sum(name.endswith(".lora_B") for name in trains)
    total += adapters * n * lora_rank * dtype_bytes
    return total


def layer_activation_bytes(config: NeoXConfig, *, batch: int, seq: int,
                           finetune: str, lora_rank: int = 8,
                           lora_targets: Sequence[str] = tuple(TARGETS),
                           checkpointing: bool = False,
                           input_requires_grad: bool = True,
                           dtype_bytes: int = 2,
                           kernels: ModelKernels | None = None,
                           compiled: bool = False) -> int:
    r"""
    ### Bytes one transformer layer keeps from forward to backward

    Eager PyTorch; compiled (`compiled`, the bench's and the job's
    `--compile`) the partitioner chooses what a layer saves, which with the
    fused kernels is the same set, and with fp8 products the set without the
    products' inputs (`fp8_inputs_recomputed`). CUDA's memory-efficient attention backend saves $nd$ less
    under the full fine-tune (see Note: the attention output is copied).

    * `batch`, `seq` are $B$ and $T$ per rank; everything scales with
      $n = BT$.
    * `finetune` is a [fine-tuner](finetuners.html) name: `'all'`, `'ffn'`,
      `'biases'` or `'lora'`, the last with its rank $r$ (`lora_rank`) and the
      adapted projections (`lora_targets`, PEFT's names as in `FineTuneLoRA`).
    * `checkpointing`: the layer is recomputed in backward and keeps its input
      only.
    * `input_requires_grad`: `False` for the first layer behind a frozen
      embedding (see `activation_bytes` on [activation
      memory](activation_memory.html)).
    * `dtype_bytes`: bytes per activation element, 2 for bf16.
    * `kernels`: the model's [fused kernels](kernels.html); of a layer's, only
      `norms` changes what it saves (one mean and $1/\sigma$ for both norms,
      $2 \cdot 4n$ bytes less). The compiled rotation saves only the shared
      tables, as its plain twin does, and `bias_gelu` saves $h$ as `F.gelu`
      does.

    On the benchmark's {{see: W3}}, GPT-NeoX-20B trained bias-only at
    {{py: workloads.workloads()["W3"].batch}} ×
    {{py: workloads.workloads()["W3"].seq | d}} tokens, a layer keeps $9nd$
    elements of bf16, 216
    (tested: tests/neox/test_activation_memory.py::test_gpt_neox_20b_bias_only_layer)
    MiB, and 544
    (tested: tests/neox/test_activation_memory.py::test_gpt_neox_20b_bias_only_layer)
    KiB of the rest: the layer norms' statistics (32
    (tested: tests/neox/test_activation_memory.py::test_gpt_neox_20b_bias_only_layer)
    KiB) and the log-sum-exp (512
    (tested: tests/neox/test_activation_memory.py::test_gpt_neox_20b_bias_only_layer)
    KiB).

    *Recomputation.* With activation checkpointing (the layer under
    `torch.utils.checkpoint(..., use_reentrant=False)`) a layer keeps only its input,
    $2nd$ bytes, and its backward first recomputes its forward, which saves the
    full set of the table again for this one layer (its input is the one already
    kept). labml_zero's engine checkpoints every unit, the final norm and the
    readout too, which then keep their inputs ($2nd$ bytes each) instead of what
    they would save; only a readout that is given the targets and returns the
    loss runs without (`Zero3Sequential.forward` says why), and [activation
    memory](activation_memory.html) counts the readout that returns the logits.
    """
    _check(config, batch, seq, dtype_bytes)
    check_fp8_count(kernels, finetune)
    trains, _ = _trainable(config, finetune, lora_rank, lora_targets)
    if checkpointing:
        return batch * seq * config.d_model * dtype_bytes
    return _layer_bytes(config, trains, batch=batch, seq=seq,
                        input_requires_grad=input_requires_grad,
                        dtype_bytes=dtype_bytes, lora_rank=lora_rank,
                        fused_norms=(kernels or ModelKernels()).norms,
                        fp8_recomputed=fp8_inputs_recomputed(kernels, compiled))
