r"""
---
title: Activation memory
summary: Bytes that autograd keeps for backward in the whole GPT-NeoX model, in
  its layers, the readout and the loss, per fine-tuner, with the fused kernels
  and with recomputation; checked tensor by tensor against what PyTorch saves.
---

# Activation memory

The [memory model](../planner/memory_model.html) counts model states and gathered
chunks; at long sequences most of a rank's peak is neither, but the tensors that
autograd keeps from the forward pass for the backward pass. This page adds them
up for the whole model per rank, without allocating any, for eager PyTorch and
bf16 activations: what each [layer](layer_memory.html) keeps, and the final
norm, readout and loss, whose peak comes on top,

$$A = \sum_{l=1}^{L} M_{\text{layer}, l} + M_{\text{loss}}$$

(without recomputation; `activation_bytes`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from labml_zero.layers.float8 import check_fp8_count, fp8_inputs_recomputed
from labml_zero.neox.kernels import ModelKernels
from labml_zero.neox.layer_memory import (FP32, _check, _layer_bytes,
                                          _trainable, layer_activation_bytes)
from labml_zero.neox.lora import TARGETS
from labml_zero.neox.model import NeoXConfig

__all__ = [
    "ActivationMemory",
    "ReadoutLoss",
    "activation_bytes",
    "layer_activation_bytes",
    "chunked_loss_bytes",
    "readout_loss_bytes",
]


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
    beside_gradients: int
    """What is alive while the layers' gradients are made: `layers` and the
    held logits; the loss's peak has passed."""


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
    keeps its input when its weight trains. On the benchmark's {{see: W1}}
    (Pythia-1.4B at {{py: workloads.workloads()["W1"].batch}} ×
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

    So the peak is $2nd + 4Vd$ bytes and their work where the plain loss's
    is $14nV$
    (tested: tests/neox/test_activation_memory.py::test_chunked_loss_peaks_by_hand):
    on Pythia-1.4B at {{py: workloads.workloads()["W1"].batch}} ×
    {{py: workloads.workloads()["W1"].seq | d}} tokens the readout and the
    loss peak at {{py:
    activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8,
    seq=2048, finetune="all").readout_loss.peak / 2**30 | .2f}} GiB with
    the plain loss and {{py:
    activation_memory.activation_bytes(neox_model.pythia_1_4b(), batch=8,
    seq=2048, finetune="all", kernels=neox_model.ModelKernels.from_names(
    "loss,rotary,norms")).readout_loss.peak / 2**30 | .2f}} GiB with this one.
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
                     kernels: ModelKernels | None = None,
                     compiled: bool = False) -> ActivationMemory:
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
    `chunked_loss_bytes`, which holds no logits. `compiled`: the layers run
    under `torch.compile` (the bench's `--compile`), whose partitioner chooses
    what to save and what to recompute; with the fused kernels it keeps the
    eager set, with fp8 products the set without their inputs (e.g. the GELU
    output, recomputed from $h$; `layer_activation_bytes`); with the plain
    model's element-wise operations it keeps less, which this count does not
    know. The tests check each count tensor by tensor against
    what PyTorch saves (`torch.autograd.graph.saved_tensors_hooks`) on CPU.

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
    check_fp8_count(kernels, finetune)  # fp8 only where every weight trains
    block, others = _trainable(config, finetune, lora_rank, lora_targets)
    kernels = kernels or ModelKernels()
    size = {"batch": batch, "seq": seq, "dtype_bytes": 2, "lora_rank": lora_rank,
            "fused_norms": kernels.norms,
            "fp8_recomputed": fp8_inputs_recomputed(kernels, compiled)}
    full = _layer_bytes(config, block, input_requires_grad=True, **size)
    readout_loss = readout_loss_bytes(config, batch=batch, seq=seq,
                                      finetune=finetune,
                                      checkpointing=checkpointing, kernels=kernels)
    L = config.n_layers
    if checkpointing:
        # The step's peak can then lie later in the backward pass, beyond this
        # count: a recomputed layer's gradients in flight. (The gradients that
        # early updates still queued hold are the memory model's
        # `early_update_grads`.)
        per_layer = batch * seq * config.d_model * 2  # the input, [B, T, d] bf16
        # The layer being recomputed saves its full set; its input is kept.
        recomputed = full - per_layer
        layers = L * per_layer + recomputed
        total = L * per_layer + max(readout_loss.peak,
                                    readout_loss.logits + recomputed)
        beside = layers + readout_loss.logits
    else:
        embedding_trains = any(name.startswith("embed_in.") for name in others)
        first = _layer_bytes(config, block, input_requires_grad=embedding_trains,
                             **size)
        per_layer = full
        layers = first + (L - 1) * full
        total = layers + readout_loss.peak
        beside = layers + readout_loss.logits
    return ActivationMemory(per_layer=per_layer, layers=layers,
                            readout_loss=readout_loss, total=total,
                            beside_gradients=beside)
