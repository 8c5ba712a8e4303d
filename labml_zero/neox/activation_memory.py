r"""
---
title: Activation memory
summary: Bytes that autograd keeps for backward in each GPT-NeoX layer, in the
  readout and the loss, per fine-tuner and with recomputation; checked tensor by
  tensor against what PyTorch saves.
---

# Activation memory

The [memory model](../zero3/memory_model.html) counts model states and gathered
chunks; at long sequences most of a rank's peak is neither, but the tensors that
autograd keeps from the forward pass for the backward pass. This page counts
them without allocating any, for eager PyTorch and bf16 activations.

With $n = BT$ tokens per rank, width $d$, MLP width $d_{ff}$ ($= 4d$), $n_h$
heads and $d_r$ rotary dimensions, a [layer](model.html) computes
$y = \operatorname{MLP}(\operatorname{LN}_2(x)) + \operatorname{Attn}
(\operatorname{LN}_1(x)) + x$, and an operation saves a tensor only if a
gradient that is needed reads it. What a layer keeps depends on the
[fine-tuner](finetuners.html) (the table beside `_layer_bytes`); with
$d_{ff} = 4d$ its bf16 tensors add up to $c\,nd$ elements, and a layer keeps

$$M_{\text{layer}} = 2 c\, nd + 4 \cdot 4n + 4 n_h n
\text{ bytes}, \qquad c = 16, 14, 9 \text{ for all, ffn, biases}.$$
(tested: tests/neox/test_activation_memory.py::test_layer_counts_by_finetuner)
The rotary $\cos$ and $\sin$ that the rotation saves are not a layer's: the
model holds one table for all its layers, before and after the backward pass
(the model's `RotaryTables`, $2 \cdot 2 T d_r$ bytes in bf16), and it is not
counted here, as the parameters are not.

[LoRA](lora.html) of rank $r$ on a set of projections keeps the biases'
set, each target's input once, and each adapter's $A x$ `[n, r]`: on all four
$2 \cdot 4 n r$ bytes more than $M_{\text{layer}}$ at $c = 16$
(tested: tests/neox/test_activation_memory.py::test_layer_counts_by_finetuner).

The [fused kernels](kernels.html) change two parts. The chunked readout loss
(`kernels.loss`) never holds the logits: it computes both gradients in the
forward pass and keeps them, $2nd + 4Vd$ bytes in place of the plain loss's
$14nV$
(tested: tests/neox/test_activation_memory.py::test_chunked_loss_peaks_by_hand)
at its peak (`chunked_loss_bytes`); on Pythia-1.4B at
{{py: workloads.workloads()["W1"].batch}} ×
{{py: workloads.workloads()["W1"].seq | d}} tokens that is {{py:
activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8,
seq=2048, finetune="all").readout_loss.peak / 2**30 | .2f}} GiB against {{py:
activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8,
seq=2048, finetune="all", kernels=neox_model.ModelKernels.from_names(
"loss,rotary,norms")).readout_loss.peak / 2**30 | .2f}}. Fused `norms` keep one
mean and $1/\sigma$ for both norms of a layer. The compiled rotation and
bias + GELU save what their plain twins save.

The tests check each count tensor by tensor against what PyTorch saves
(`torch.autograd.graph.saved_tensors_hooks`) on CPU.

## Limitations

* Eager PyTorch only. `torch.compile` (the bench's `--compile`) lets the
  partitioner choose what to save and what to recompute, e.g. the GELU output
  from $h$, which this count does not know.
* Gradients in flight, kernel workspaces and the allocator's rounding are not
  counted (see `activation_bytes`).
* CUDA's memory-efficient attention backend saves $nd$ less under the full
  fine-tune (see Note: the attention output is copied).
* With recomputation the step's peak can lie in the backward pass, beyond
  this count: a recomputed layer's gradients in flight, and, when each shard
  is updated during the backward pass on a side stream, the gradients of the
  units whose updates are still queued. The allocator frees those only when
  the side stream has read them (`record_stream`), so how many are alive
  depends on how far the host runs ahead of the GPU, not on tensor sizes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Sequence

from labml_zero.neox.finetuners import finetuner
from labml_zero.neox.kernels import ModelKernels
from labml_zero.neox.lora import TARGETS
from labml_zero.neox.model import NeoXConfig, build_layers

__all__ = [
    "ActivationMemory",
    "ReadoutLoss",
    "activation_bytes",
    "layer_activation_bytes",
    "chunked_loss_bytes",
    "readout_loss_bytes",
]

# Layer norm statistics, attention's log-sum-exp and the loss's softmax are fp32
# whatever the activation dtype (CUDA's accumulate type for bf16 and fp16).
FP32 = 4


class ReadoutLoss(NamedTuple):
    """
    ## Final norm, readout and loss

    Bytes, all of them including `saved`.
    """

    saved: int
    """Kept by the final norm and the readout from forward to backward."""
    logits: int
    """The bf16 logits `[n, V]`, held by the caller until backward is done
    (0 when it lets them go after the loss)."""
    forward_peak: int
    """During the loss's forward: `saved`, the logits, their fp32 copy and the
    fp32 log-probabilities."""
    backward_peak: int
    """During `log_softmax`'s backward: `saved`, the held logits, the saved
    log-probabilities and two fp32 gradients `[n, V]`."""

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


class ActivationMemory(NamedTuple):
    """
    ## Activations of the whole model, per rank
    """

    per_layer: int
    """What one transformer layer keeps from forward to backward: the full set,
    or with recomputation its input."""
    layers: int
    """All transformer layers at the start of backward; with recomputation the
    layers' inputs plus one layer's recomputed set."""
    readout_loss: ReadoutLoss
    """Final norm, readout and loss."""
    total: int
    r"""The largest activation bytes alive at one time: `layers` plus
    `readout_loss.peak`; with recomputation the layers' inputs plus the larger
    of the loss's peak and a recomputed layer (beside the held logits), since
    the two never coexist."""


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
                 lora_rank: int = 0, fused_norms: bool = False) -> int:
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
    the adapters' rank. A model without
    rotary dimensions (`rotary_pct=0`, none released) differs and is counted so:
    $q$ and $k$ are then views of the fused QKV output and keep all of it ($nd$
    more), and the attention output comes out `[B, T, n_h, d_h]`, so the dense
    linear's input is a view of it (under the full fine-tune $nd$ less).
    """
    n, d, d_ff = batch * seq, config.d_model, config.ff_dim
    nd = n * d * dtype_bytes

    def any_trains(prefix: str) -> bool:
        return any(name.startswith(prefix) for name in trains)

    def input_saved(path: str) -> bool:
        # W's gradient, or an adapter's A's, reads the linear's input
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
    if input_saved("attention.query_key_value"):
        total += nd  # LN1(x)
    if attn:
        # v (a copy) and the attention output, each [B, n_h, T, d_h]
        total += 2 * nd
        total += config.n_heads * n * FP32  # log-sum-exp [B, n_h, T] fp32
        if config.rotary_dim > 0:
            # q, k: one new tensor made by the rotation (cos and sin, which
            # the rotation saves too, are the model's shared tables)
            total += 2 * nd
        else:
            # Unrotated, q and k stay views of the fused QKV output, and saving
            # them keeps all of it, [B, T, 3d].
            total += 3 * nd
    if input_saved("attention.dense") and (config.rotary_dim > 0 or not attn):
        # The heads concatenated: a copy (see Note: the attention output is
        # copied). Without rotation q, and
        # so the attention output, is laid out [B, T, n_h, d_h] and this is a
        # view of the output, already saved when the attention saves it.
        total += nd
    if input_saved("mlp.dense_h_to_4h"):
        total += nd  # LN2(x)
    if mlp:
        total += n * d_ff * dtype_bytes  # h, read by the GELU's backward
    if input_saved("mlp.dense_4h_to_h"):
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
                           kernels: ModelKernels | None = None) -> int:
    r"""
    ### Bytes one transformer layer keeps from forward to backward

    * `batch`, `seq` are $B$ and $T$ per rank; everything scales with
      $n = BT$.
    * `finetune` is a [fine-tuner](finetuners.html) name: `'all'`, `'ffn'`,
      `'biases'` or `'lora'`, the last with its rank $r$ (`lora_rank`) and the
      adapted projections (`lora_targets`, PEFT's names as in `FineTuneLoRA`).
    * `checkpointing`: the layer is recomputed in backward and keeps its input
      only.
    * `input_requires_grad`: `False` for the first layer behind a frozen
      embedding (see the intro).
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
    loss runs without (`Zero3Sequential.forward` says why), and this page counts
    the readout that returns the logits.
    """
    _check(config, batch, seq, dtype_bytes)
    trains, _ = _trainable(config, finetune, lora_rank, lora_targets)
    if checkpointing:
        return batch * seq * config.d_model * dtype_bytes
    return _layer_bytes(config, trains, batch=batch, seq=seq,
                        input_requires_grad=input_requires_grad,
                        dtype_bytes=dtype_bytes, lora_rank=lora_rank,
                        fused_norms=(kernels or ModelKernels()).norms)


# ## Readout and loss


def readout_loss_bytes(config: NeoXConfig, *, batch: int, seq: int, finetune: str,
                       checkpointing: bool = False, logits_held: bool = True,
                       dtype_bytes: int = 2,
                       kernels: ModelKernels | None = None) -> ReadoutLoss:
    r"""
    ### Bytes of the final norm, the readout and the fp32 cross-entropy

    * `checkpointing`: the final norm and the readout are recomputed too (as
      labml_zero's engine does with a readout that returns the logits), so each
      keeps its input, $2nd$ bytes.
    * `logits_held`: the caller keeps the bf16 logits until backward is done,
      as the benchmark and the fine-tune do.

    The final norm's input $x_L$ is taken to require grad: every fine-tuner
    trains something in every layer.

    The loss of the benchmark (`bench/engine.py`) and of the
    [fine-tune](../finetune/job.html) is
    `F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())` with the
    readout's bf16 logits `[n, V]` held in a variable until backward is done. With
    $nV$ elements per vocabulary-sized tensor:

    * forward: the bf16 logits ($2nV$), their fp32 copy ($4nV$) and the fp32
      log-probabilities that `log_softmax` returns and saves ($4nV$); the copy
      dies when the loss returns, so $10nV$
      (tested: tests/neox/test_activation_memory.py::test_readout_loss_options)
      at the peak and $6nV$
      (tested: tests/neox/test_activation_memory.py::test_readout_and_loss_peaks)
      after it;
    * backward, at `log_softmax`'s backward: the logits ($2nV$), the saved
      log-probabilities ($4nV$), the fp32 gradient of the log-probabilities that
      `nll_loss` wrote ($4nV$) and the fp32 gradient of the logits being written
      ($4nV$): $14nV$
      (tested: tests/neox/test_activation_memory.py::test_readout_loss_options).
      After it the two fp32 gradients of 4 become one of 4 and one bf16 of 2,
      never more.

    Besides, the final norm keeps its input $x_L$ and statistics, and the readout
    keeps its input when its weight trains. On the benchmark's W1 (Pythia-1.4B
    at {{py: workloads.workloads()["W1"].batch}} ×
    {{py: workloads.workloads()["W1"].seq | d}} tokens) that backward peak, less
    `saved`, is 10.75
    (tested: tests/neox/test_activation_memory.py::test_figures_in_the_notes)
    GiB, as much as 10.7
    (tested: tests/neox/test_activation_memory.py::test_figures_in_the_notes)
    of its {{py: neox_model.pythia_1_4b().n_layers}} layers keep.

    The int64 targets (`targets.flatten()` copies a strided slice: $8n$ bytes)
    and the loss's scalars are not counted. With the `loss` kernel
    (`kernels.loss`) the count is `chunked_loss_bytes`'.
    """
    _check(config, batch, seq, dtype_bytes)
    if kernels is not None and kernels.loss:
        return chunked_loss_bytes(config, batch=batch, seq=seq,
                                  chunk_rows=kernels.loss_chunk_rows,
                                  checkpointing=checkpointing,
                                  dtype_bytes=dtype_bytes)
    _, trains = _trainable(config, finetune)
    n = batch * seq
    nd = n * config.d_model * dtype_bytes
    if checkpointing:
        saved = 2 * nd
    else:
        # x_L and the norm's mean, 1/σ; the readout's input if its weight trains
        saved = nd + 2 * n * FP32
        if "embed_out.weight" in trains:
            saved += nd
    logits = n * config.n_vocab * dtype_bytes  # [n, V] bf16
    fp32 = n * config.n_vocab * FP32  # one [n, V] fp32 tensor
    # forward: logits, their fp32 copy, the log-probabilities
    forward_peak = saved + logits + 2 * fp32
    # backward: log-probabilities, their gradient, the logits' fp32 gradient
    held = logits if logits_held else 0
    backward_peak = saved + held + 3 * fp32
    return ReadoutLoss(saved=saved, logits=held, forward_peak=forward_peak,
                       backward_peak=backward_peak)


def chunked_loss_bytes(config: NeoXConfig, *, batch: int, seq: int,
                       chunk_rows: int, checkpointing: bool = False,
                       dtype_bytes: int = 2) -> ReadoutLoss:
    r"""
    ### The same, with the chunked readout loss

    The [`loss` kernel](kernels.html) (`ChunkedReadoutLoss`) computes both
    gradients in the forward pass, $c$ = `chunk_rows` rows at a time
    ($c \le n$), and never holds the logits `[n, V]`. What it keeps from
    forward to backward is $\partial L / \partial x$ `[n, d]` in bf16 and
    $\partial L / \partial W$ `[V, d]` in fp32: $2nd + 4Vd$ bytes, the second
    whether $W$ trains or not. The readout is the loss head, so the engine
    runs it without recomputation (`Zero3Sequential.forward`) and it keeps
    no input; the final norm keeps $x_L$ and its statistics, or under
    recomputation $x_L$ alone.

    * forward: besides `saved`'s norm part, the norm's output $x$ (the
      readout's input, $2nd$), $\partial L / \partial x$ being written ($2nd$),
      and one chunk's work, the larger of two moments: the next chunk's bf16
      logits made while this chunk's logits and gradient are still referenced
      ($3 \cdot 2cV$, beside the fp32 $\partial L / \partial W$), and the
      fp32 product that adds a chunk to $\partial L / \partial W$, which is a
      new `[V, d]` beside the old one ($2 \cdot 2cV + 2 \cdot 4Vd$);
    * backward: both stored gradients scaled by $\partial \text{out} /
      \partial L$, new tensors ($2nd + 4Vd$), and the weight's cast to bf16
      ($2Vd$).

    The compiled loss of a chunk (`chunk_loss_and_grad`) writes its bf16
    gradient and keeps no fp32 `[c, V]` tensor; these are the CUDA path's
    sizes. On a CPU the chunk's loss runs eagerly, with its fp32 temporaries,
    and only `saved` is the same.
    """
    n = batch * seq
    d, V = config.d_model, config.n_vocab
    nd = n * d * dtype_bytes
    c = min(chunk_rows, n)
    chunk = c * V * dtype_bytes  # one chunk's logits or gradient, [c, V] bf16
    grad_w = V * d * FP32  # [V, d] fp32
    # x_L (and, without recomputation, the final norm's mean and 1/σ)
    norm = nd if checkpointing else nd + 2 * n * FP32
    saved = norm + nd + grad_w
    work = max(3 * chunk + grad_w, 2 * chunk + 2 * grad_w)
    forward_peak = norm + nd + nd + work
    backward_peak = saved + nd + grad_w + V * d * dtype_bytes
    return ReadoutLoss(saved=saved, logits=0, forward_peak=forward_peak,
                       backward_peak=backward_peak)


# ## The whole model


def activation_bytes(config: NeoXConfig, *, batch: int, seq: int, finetune: str,
                     lora_rank: int = 8, lora_targets: Sequence[str] = tuple(TARGETS),
                     checkpointing: bool = False,
                     kernels: ModelKernels | None = None) -> ActivationMemory:
    r"""
    ### Activation bytes of the whole model per rank

    `[Embedding, TransformerLayer × L, FinalNorm, Readout]` in bf16 with the
    benchmark's loss, the logits held through backward. The embedding keeps no
    activation (its backward needs only the ids); its output is the first
    layer's input, counted there when that layer keeps it, which it does not
    behind a frozen embedding: its layer norms then save nothing, and under the
    `ffn` tuner its whole attention branch saves nothing either ($8nd$ for
    biases, $9nd$ for ffn). Gradients in flight during backward (the residual
    stream's, a layer's intermediate ones, at most a few $nd$), the attention
    kernels' workspaces and the allocator's rounding and fragmentation are not
    counted. `lora_rank`, `lora_targets` and `kernels` are as in
    `layer_activation_bytes`; with the `loss` kernel the last part is
    `chunked_loss_bytes`, which holds no logits.

    Per rank, for the five jobs of the benchmark ({{see: W1}}, {{see: W2}},
    {{see: W3}}, {{see: W4}} and {{see: W5}}), computed by this function when the
    site is built:

    | job | model | B × T | trains | layer MiB | layers GiB | loss GiB | total GiB |
    | --- | --- | --- | --- | --- | --- | --- | --- |
    | W1 | pythia_1_4b | {{py: workloads.workloads()["W1"].batch}} × {{py:
    workloads.workloads()["W1"].seq | d}} | all | {{py:
    activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8, seq=2048,
    finetune="all").per_layer / 2**20 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8, seq=2048,
    finetune="all").layers / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8, seq=2048,
    finetune="all").readout_loss.peak / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8, seq=2048,
    finetune="all").total / 2**30 | .2f}} |
    | W2 | pythia_6_9b | {{py: workloads.workloads()["W2"].batch}} × {{py:
    workloads.workloads()["W2"].seq | d}} | all | {{py:
    activation_memory.activation_bytes(neox_model.pythia_6_9b(), batch=2, seq=2048,
    finetune="all").per_layer / 2**20 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_6_9b(), batch=2, seq=2048,
    finetune="all").layers / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_6_9b(), batch=2, seq=2048,
    finetune="all").readout_loss.peak / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_6_9b(), batch=2, seq=2048,
    finetune="all").total / 2**30 | .2f}} |
    | W3 | gpt_neox_20b | {{py: workloads.workloads()["W3"].batch}} × {{py:
    workloads.workloads()["W3"].seq | d}} | biases | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=16, seq=128,
    finetune="biases").per_layer / 2**20 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=16, seq=128,
    finetune="biases").layers / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=16, seq=128,
    finetune="biases").readout_loss.peak / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=16, seq=128,
    finetune="biases").total / 2**30 | .2f}} |
    | W4 | pythia_160m | {{py: workloads.workloads()["W4"].batch}} × {{py:
    workloads.workloads()["W4"].seq | d}} | all | {{py:
    activation_memory.activation_bytes(neox_model.pythia_160m(), batch=16, seq=1024,
    finetune="all").per_layer / 2**20 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_160m(), batch=16, seq=1024,
    finetune="all").layers / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_160m(), batch=16, seq=1024,
    finetune="all").readout_loss.peak / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.pythia_160m(), batch=16, seq=1024,
    finetune="all").total / 2**30 | .2f}} |
    | W5 | gpt_neox_20b | {{py: workloads.workloads()["W5"].batch}} × {{py:
    workloads.workloads()["W5"].seq | d}} | all, recomputed | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=4, seq=2048,
    finetune="all", checkpointing=True).per_layer / 2**20 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=4, seq=2048,
    finetune="all", checkpointing=True).layers / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=4, seq=2048,
    finetune="all", checkpointing=True).readout_loss.peak / 2**30 | .2f}} | {{py:
    activation_memory.activation_bytes(neox_model.gpt_neox_20b(), batch=4, seq=2048,
    finetune="all", checkpointing=True).total / 2**30 | .2f}} |

    "layer" is what one layer keeps from forward to backward (its input, for
    W5), "layers" all of them at the start of backward (for W5 also the one layer
    being recomputed), "loss" the peak of final norm, readout and loss, "total"
    the largest sum of the two parts alive at one time.
    """
    _check(config, batch, seq, 2)
    block, others = _trainable(config, finetune, lora_rank, lora_targets)
    kernels = kernels or ModelKernels()
    size = {"batch": batch, "seq": seq, "dtype_bytes": 2, "lora_rank": lora_rank,
            "fused_norms": kernels.norms}
    full = _layer_bytes(config, block, input_requires_grad=True, **size)
    readout_loss = readout_loss_bytes(config, batch=batch, seq=seq,
                                      finetune=finetune,
                                      checkpointing=checkpointing, kernels=kernels)
    L = config.n_layers
    if checkpointing:
        per_layer = batch * seq * config.d_model * 2  # the input, [B, T, d] bf16
        # The layer being recomputed saves its full set; its input is kept.
        recomputed = full - per_layer
        layers = L * per_layer + recomputed
        total = L * per_layer + max(readout_loss.peak,
                                    readout_loss.logits + recomputed)
    else:
        embedding_trains = any(name.startswith("embed_in.") for name in others)
        first = _layer_bytes(config, block, input_requires_grad=embedding_trains,
                             **size)
        per_layer = full
        layers = first + (L - 1) * full
        total = layers + readout_loss.peak
    return ActivationMemory(per_layer=per_layer, layers=layers,
                            readout_loss=readout_loss, total=total)
