r"""
---
title: Llama activation memory
summary: The bytes autograd keeps from forward to backward in a whole Llama
  model, tensor by tensor, for every kernel set, fine-tuner and recomputation;
  checked against what PyTorch saves.
---

# Llama activation memory

GPT-NeoX's [activation memory](../neox/activation_memory.html) for the
[Llama layer](model.html): the tensors the forward pass leaves for the
backward pass, counted from the shapes without allocating any, for eager
PyTorch and bf16 activations. With $n = BT$ tokens a rank, the whole model
holds, when its last backward pass starts,

$$A = \sum_{l=1}^{L} M_{\text{layer}, l} + M_{\text{loss}}$$

(without recomputation; `activation_bytes`). What a layer keeps depends on
three choices, each beside the code it changes: the [fused
kernels](kernels.html) (the compiled RMSNorm and SwiGLU keep less than their
plain twins), the fine-tuner (a frozen weight's product keeps no input) and
recomputation (a layer keeps only its input). The tests check each count
against the storages `torch.autograd.graph.saved_tensors_hooks` sees on CPU,
the compiled kernels run by the partitioner that Inductor runs on the GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple, Sequence

from labml_zero.llama.config import LlamaConfig
from labml_zero.llama.finetuners import finetuner
from labml_zero.layers.float8 import check_fp8_count, fp8_inputs_recomputed, no_fp8
from labml_zero.llama.kernels import LlamaKernels
from labml_zero.llama.model import build_layers

__all__ = ["FP32", "ReadoutLoss", "ActivationMemory", "layer_activation_bytes",
           "readout_loss_bytes", "activation_bytes", "activation_memory"]

FP32 = 4
r"""Bytes of the fp32 tensors a bf16 model keeps: the RMSNorms' $1/\mathrm{rms}$,
attention's log-sum-exp, the plain loss's log-probabilities and the chunked
loss's weight gradient."""
FP8_BYTES = 1
"""Bytes of an fp8 cast an fp8 product keeps beside a bf16 input."""


def _check(config: LlamaConfig, batch: int, seq: int, dtype_bytes: int) -> None:
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got {batch} x {seq}")
    if seq > config.max_sequence:
        raise ValueError(f"seq {seq} exceeds the model's {config.max_sequence} "
                         f"(max_position or sliding_window)")
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1, got {dtype_bytes}")


def _trainable(config: LlamaConfig, finetune: str, lora_rank: int,
               lora_targets: Sequence[str] | None) -> tuple[set[str], set[str]]:
    """
    #### The fine-tuner's choice, read off a model on the meta device

    The trainable parameter names of a decoder layer (`self_attn.q_proj.weight`,
    or `self_attn.q_proj.lora_A` under LoRA) and of the other units
    (`embed_tokens.weight`, `norm.weight`, `lm_head.weight`). The family's
    own [fine-tuner](finetuners.html) decides, so this page cannot drift from
    it; on the meta device it allocates nothing.
    """
    options = {}
    if finetune == "lora":
        options = {"rank": lora_rank}
        if lora_targets is not None:
            options["targets"] = tuple(lora_targets)
    layers = build_layers(replace(config, n_layers=1), device="meta")
    finetuner(finetune, **options)(layers)
    block = {name for name, p in layers[1].named_parameters() if p.requires_grad}
    others = {name for layer in (layers[0], layers[2], layers[3])
              for name, p in layer.named_parameters() if p.requires_grad}
    return block, others


# ## RMSNorm


def _rms_norm_bytes(d: int, p: int, *, input_grad: bool, weight_trains: bool,
                    fused: bool) -> int:
    r"""
    #### Bytes a token's RMSNorm keeps

    `rms_norm` computes $x_{32}$ (the input in fp32), $r = 1/\mathrm{rms}$,
    $\hat x = (x_{32} r)$ cast back and $w \odot \hat x$. Plain, autograd saves
    what each step's derivative reads: $x_{32}$ and $r$ when the input needs
    a gradient ($4d + 4$ bytes: a copy for a bf16 input, the input itself in
    fp32), $\hat x$ when the weight trains ($p d$).

    Compiled (`rms_norm_fused`, on CUDA), the min-cut partitioner keeps the
    cheapest set from which the backward pass recomputes the rest: the bf16
    input and $r$, $p d + 4$, whichever needs the gradient; $\hat x$ and
    $x_{32}$ are recomputed from them in the backward kernel (tested:
    tests/llama/test_activation_memory.py::test_fused_rms_norm_keeps_its_input).
    The normalised output is the next products' input, counted with them.
    """
    if not (input_grad or weight_trains):
        return 0
    if fused:
        return p * d + FP32
    return (FP32 * d + FP32 if input_grad else 0) + (p * d if weight_trains else 0)


# ## SwiGLU


def _swiglu_bytes(d_ff: int, p: int, *, gate_grad: bool, up_grad: bool,
                  fused: bool) -> int:
    r"""
    #### Bytes a token's $\operatorname{SiLU}(g) \odot u$ keeps

    Plain: $\operatorname{SiLU}$'s derivative reads $g$ and the product's
    reads the other factor, so $g$ and $u$ when $g$ needs a gradient and
    $\operatorname{SiLU}(g)$ when $u$ does: three `[n, d_ff]` tensors under
    full training. Compiled, the backward kernel recomputes
    $\operatorname{SiLU}(g)$ from $g$: $g$ and $u$, two (`swiglu`'s
    derivatives). With only $u$ needing a gradient (the first layer under
    LoRA, behind a frozen embedding) each keeps one factor.
    """
    if fused and gate_grad:
        return 2 * p * d_ff
    return p * d_ff * (2 * int(gate_grad) + int(up_grad))


# ## One decoder layer


def _layer_bytes(config: LlamaConfig, trains: set[str], *, n: int, p: int,
                 input_requires_grad: bool, lora_rank: int,
                 kernels: LlamaKernels,
                 fp8_recomputed: Callable[[int, int], bool] = no_fp8) -> int:
    r"""
    #### Bytes a decoder layer keeps, without recomputation

    A product $z = a W^\top$ keeps its input $a$ only when $W$ trains (or, under
    LoRA, when its adapter's $A$ does: $\partial L / \partial A$ reads the same
    $a$); its $\partial L / \partial a$ reads only $W$, a parameter. So, per
    token, with $p$ bytes an element and ✓ where the fine-tuner makes the row
    needed (`all` trains everything; `lora` its targets' adapters):

    | saved tensor | bytes | all | lora |
    | --- | --- | --- | --- |
    | $\operatorname{RMS}_1$: $x$ in fp32 and $1/\mathrm{rms}$ (`_rms_norm_bytes`); fused, $x$ and $1/\mathrm{rms}$ | $4d + 4$, fused $pd + 4$ | ✓ | ✓ |
    | $\operatorname{RMS}_1$, plain: $\hat x$, read by its weight's gradient | $pd$ | ✓ | |
    | $\operatorname{RMS}_1(x)$, input of $W_q$, $W_k$, $W_v$ | $pd$ | ✓ | q, k or v |
    | $q$ and $k$ rotated (new tensors), $v$ (a view of $W_v$'s output) | $p (n_h + 2 n_{kv}) d_h$ | ✓ | ✓ |
    | attention's output, also $W_o$'s input (a view) | $p\, n_h d_h$ | ✓ | ✓ |
    | attention's log-sum-exp | $4 n_h$ | ✓ | ✓ |
    | $\operatorname{RMS}_2$: the same two rows for $h$ | as $\operatorname{RMS}_1$ | ✓ | as $\operatorname{RMS}_1$ |
    | $\operatorname{RMS}_2(h)$, input of $W_\text{gate}$, $W_\text{up}$ | $pd$ | ✓ | gate or up |
    | SwiGLU's $g$, $u$ and, plain, $\operatorname{SiLU}(g)$ (`_swiglu_bytes`) | $3 p d_{ff}$, fused $2 p d_{ff}$ | ✓ | ✓ |
    | $\operatorname{SiLU}(g) \odot u$, input of $W_\text{down}$ | $p\, d_{ff}$ | ✓ | down |
    | each adapter's $A a$, input of its $B$ | $p r$ | | ✓ |

    The rotation multiplies by tables that need no gradient, so it keeps only
    the tables, one pair shared by every layer (`LlamaRotary`), counted as the
    parameters are, not at all; the compiled rotation keeps the same. The
    attention kernel keeps its inputs, its output and the log-sum-exp of each
    query's row, never the $T \times T$ probabilities (flash-style kernels;
    the CPU's and CUDA's): q, k and v of the grouped heads, $n_{kv}$ of them,
    not copied out to $n_h$ (CUDA's flash and cuDNN kernels read the groups
    themselves, as the CPU's does; cuDNN's log-sum-exp is `[B, n_h, T, 1]`,
    the same bytes, and its two 8-byte RNG scalars are not counted; the
    probe `bench/activation_probe.py` counts a layer on the GPU). q comes out of the rotation laid out
    `[B, T, n_h, d_h]`, and the kernel lays its output out as q, so the heads
    concatenated are a view of the output, not a copy.

    The conditions below are the table's ✓: each tensor is kept when a
    gradient that reads it is needed; `trains` are the layer's trainable
    names, and `input_requires_grad` is false only for a first layer behind a
    frozen embedding, which keeps only what its own trainable weights need.
    `fp8_recomputed`: of a product's shape, whether it runs in fp8, compiled,
    so its input is kept only where another row keeps it, or where a bf16
    product reads it too, and then beside it the fp8 cast, one byte an
    element (measured: Llama-3.2-1B's norm output, read by an fp8 $W_q$ and
    by $W_k$, $W_v$ too narrow for fp8, held exactly that much more
    (tested: tests/test_bench_predictions.py::test_one_ranks_peak_is_the_states_and_activations_alone)) ([fp8
    products](../layers/float8.html), `fp8_inputs_recomputed`; the attention's
    output, $W_o$'s input, is kept by the attention).
    """
    d, d_ff, d_h = config.d_model, config.d_ff, config.head_width
    n_h, n_kv = config.n_heads, config.n_kv_heads

    def trains_any(*paths: str) -> bool:
        return any(name.startswith(path + ".") for path in paths for name in trains)

    def input_saved(*paths: str) -> bool:
        # W's gradient, or an adapter's A's, reads the product's input
        return any(f"{path}.weight" in trains or f"{path}.lora_A" in trains
                   for path in paths)

    def input_kept(*shapes: tuple[int, int]) -> bool:
        # unless every product reading it runs in fp8, compiled: then the
        # backward recomputes it
        return not all(fp8_recomputed(*s) for s in shapes)

    def fp8_cast_bytes(*shapes: tuple[int, int]) -> int:
        # an input kept for a bf16 product that an fp8 product reads too:
        # the compiled layer keeps the fp8 cast as well, one byte an element
        # (measured once: RMS1(x) read by an fp8 q and bf16 k, v)
        return FP8_BYTES * any(fp8_recomputed(*s) for s in shapes)

    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    gate_up = ("mlp.gate_proj", "mlp.up_proj")
    # Does each norm's output need a gradient, does attention's input?
    norm1_grad = input_requires_grad or trains_any("input_layernorm")
    attention_grad = norm1_grad or trains_any(*qkv)
    # h = x + Attn(RMS1(x)): its gradient is needed if anything before trains
    h_grad = attention_grad or trains_any("self_attn.o_proj")
    norm2_grad = h_grad or trains_any("post_attention_layernorm")

    per_token = _rms_norm_bytes(d, p, input_grad=input_requires_grad,
                                weight_trains=trains_any("input_layernorm"),
                                fused=kernels.rms_norm)
    if input_saved(*qkv) and input_kept((d, n_h * d_h), (d, n_kv * d_h)):
        # RMS1(x), one storage read by all three, and q's fp8 cast of it
        per_token += (p + fp8_cast_bytes((d, n_h * d_h), (d, n_kv * d_h))) * d
    if attention_grad:
        per_token += p * (2 * n_h + 2 * n_kv) * d_h  # q, k, v; the output
        per_token += FP32 * n_h  # log-sum-exp [B, n_h, T] fp32
    elif input_saved("self_attn.o_proj"):
        per_token += p * n_h * d_h  # the output, kept only by W_o's adapter
    per_token += _rms_norm_bytes(d, p, input_grad=h_grad,
                                 weight_trains=trains_any("post_attention_layernorm"),
                                 fused=kernels.rms_norm)
    if input_saved(*gate_up) and input_kept((d, d_ff)):
        per_token += p * d  # RMS2(h)
    per_token += _swiglu_bytes(d_ff, p, gate_grad=norm2_grad or trains_any(gate_up[0]),
                               up_grad=norm2_grad or trains_any(gate_up[1]),
                               fused=kernels.swiglu)
    if input_saved("mlp.down_proj") and input_kept((d_ff, d)):
        per_token += p * d_ff  # SiLU(g) ⊙ u
    adapters = sum(name.endswith(".lora_B") for name in trains)
    per_token += adapters * p * lora_rank  # A a, [n, r] each
    return n * per_token


def layer_activation_bytes(config: LlamaConfig, *, batch: int, seq: int,
                           finetune: str = "all", lora_rank: int = 8,
                           lora_targets: Sequence[str] | None = None,
                           checkpointing: bool = False,
                           input_requires_grad: bool = True, dtype_bytes: int = 2,
                           kernels: LlamaKernels | None = None,
                           compiled: bool = False) -> int:
    r"""
    ### Bytes one decoder layer keeps from forward to backward

    * `finetune`: the family's fine-tuner, `'all'` or `'lora'`, the latter
      with `lora_rank` $r$ and `lora_targets` (PEFT's names, `None` for
      `LlamaLoRA`'s default, all seven).
    * `checkpointing`: the layer runs under `torch.utils.checkpoint`
      (non-reentrant) and keeps its input alone, $p\,nd$; its backward pass
      recomputes the forward, which keeps the full set again, for one layer at
      a time.
    * `input_requires_grad`: `False` for the first layer behind a frozen
      embedding.
    * `kernels`: the fused kernels as compiled on CUDA. On a CPU the fused
      functions run as their plain twins and keep the plain set; count them
      with `kernels=None` there. `rotary` and `loss` change nothing a layer
      keeps.
    * `compiled`: the layer runs under `torch.compile` (`--compile`): with
      the fused kernels it keeps the same set, with fp8 products the set
      without their inputs (`fp8_inputs_recomputed`).

    Under the full fine-tune, with $d_{ff}$ and the heads as they are, the
    bf16 layer keeps

    $$M_\text{layer} = n\,\bigl(2 (4d + 4 + 2d) + 2d \cdot 2
      + 2 (2 n_h + 2 n_{kv}) d_h + 4 n_h + 4 \cdot 2 d_{ff}\bigr)$$

    bytes plain, and $n\,(8d + 8 + 2 (2n_h + 2n_{kv}) d_h + 4 n_h
    + 3 \cdot 2 d_{ff})$ with the fused RMSNorm and SwiGLU
    (tested: tests/llama/test_activation_memory.py::test_the_fused_layer_formula):
    on the benchmark's Llama-3.2-1B job, at
    {{py: workloads.workloads()["L1"].batch}} ×
    {{py: workloads.workloads()["L1"].seq | d}} tokens, {{py:
    llama_activations.layer_activation_bytes(workloads.workloads()["L1"].model,
    batch=workloads.workloads()["L1"].batch,
    seq=workloads.workloads()["L1"].seq) / 2**20 | ,.0f}} MiB plain and {{py:
    llama_activations.layer_activation_bytes(workloads.workloads()["L1"].model,
    batch=workloads.workloads()["L1"].batch, seq=workloads.workloads()["L1"].seq,
    kernels=llama_kernels.LlamaKernels.all_fused()) / 2**20 | ,.0f}} MiB fused.
    """
    _check(config, batch, seq, dtype_bytes)
    check_fp8_count(kernels, finetune)  # fp8 only where every weight trains
    trains, _ = _trainable(config, finetune, lora_rank, lora_targets)
    if checkpointing:
        return batch * seq * config.d_model * dtype_bytes
    return _layer_bytes(config, trains, n=batch * seq, p=dtype_bytes,
                        input_requires_grad=input_requires_grad,
                        lora_rank=lora_rank, kernels=kernels or LlamaKernels(),
                        fp8_recomputed=fp8_inputs_recomputed(kernels, compiled))


# ## Final norm, readout and loss


class ReadoutLoss(NamedTuple):
    """
    ## Final norm, readout and loss

    Bytes; the peaks include `saved`.
    """

    saved: int
    """Kept from the forward pass to the backward pass by the final norm, the
    readout and the loss."""
    forward_peak: int
    """The most alive during the loss's forward pass."""
    backward_peak: int
    """The most alive during the loss's backward pass, before the readout's
    own products."""

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


def readout_loss_bytes(config: LlamaConfig, *, batch: int, seq: int,
                       finetune: str = "all", checkpointing: bool = False,
                       dtype_bytes: int = 2,
                       kernels: LlamaKernels | None = None) -> ReadoutLoss:
    r"""
    ### Bytes of the final norm, the readout and the loss

    The readout is the loss head: given the targets it returns the loss
    (`Readout.forward`), as the benchmark's step and the fine-tune call it, so
    no caller holds the logits, and the engine never recomputes it
    (`Zero3Sequential.forward`) while it recomputes the final norm, which
    then keeps its input $x_L$ alone. $x_L$ needs a gradient under every
    fine-tuner: each trains something in every layer.

    *The plain loss* (`plain_readout_loss`) writes the logits `[n, V]` in bf16,
    their fp32 copy and the fp32 log-probabilities that `log_softmax` keeps:
    $(2 + 4 + 4) nV$ bytes at once in the forward pass, of which $4nV$ stay.
    In the backward pass the log-probabilities, `nll_loss`'s fp32 gradient and
    `log_softmax`'s fp32 gradient of the logits are alive together, $12 nV$
    (tested: tests/llama/test_activation_memory.py::test_plain_loss_peaks).
    The readout keeps its input, the normed $x_L$, when its weight trains.

    *The chunked loss* (`kernels.loss`, [GPT-NeoX's
    `chunked_loss_bytes`](../neox/activation_memory.html) with its reasons)
    keeps $\partial L / \partial x$ in bf16 and $\partial L / \partial W$ in
    fp32, $p\,nd + 4Vd$, whether $W$ trains or not, and never the logits; one
    chunk of $c$ rows is alive at a time, at most three bf16 `[c, V]` beside
    the fp32 $\partial L / \partial W$, or two beside the old and the new
    $\partial L / \partial W$. These are the compiled chunk's sizes (CUDA);
    eager on a CPU, a chunk also writes fp32 temporaries, and only `saved` is
    the same. Its backward pass scales both gradients (new tensors) and casts
    the weight's to bf16.
    """
    _check(config, batch, seq, dtype_bytes)
    kernels = kernels or LlamaKernels()
    _, others = _trainable(config, finetune, 8, None)
    n, d, V, p = batch * seq, config.d_model, config.n_vocab, dtype_bytes
    nd = n * p * d
    if checkpointing:
        norm = nd  # x_L, kept by the checkpoint
    else:
        norm = n * _rms_norm_bytes(d, p, input_grad=True,
                                   weight_trains="norm.weight" in others,
                                   fused=kernels.rms_norm)
    if kernels.loss:
        c = min(kernels.loss_chunk_rows, n)
        chunk = c * V * p  # one chunk's logits or their gradient, [c, V]
        grad_w = V * d * FP32  # [V, d] fp32
        saved = norm + nd + grad_w
        # the normed x_L is the readout's input while its forward runs
        work = max(3 * chunk + grad_w, 2 * chunk + 2 * grad_w)
        forward_peak = norm + nd + nd + work
        backward_peak = saved + nd + grad_w + V * d * p
        return ReadoutLoss(saved, forward_peak, backward_peak)
    readout_input = nd if "lm_head.weight" in others else 0
    nV = n * V
    saved = norm + readout_input + FP32 * nV  # the log-probabilities
    # logits bf16, their fp32 copy, the log-probabilities; the normed x_L
    forward_peak = norm + nd + (p + 2 * FP32) * nV
    backward_peak = norm + readout_input + 3 * FP32 * nV
    return ReadoutLoss(saved, forward_peak, backward_peak)


# ## The whole model


class ActivationMemory(NamedTuple):
    """
    ## Activations of the whole model, per rank
    """

    first_layer: int
    """What the first decoder layer keeps (less behind a frozen embedding);
    its input with recomputation."""
    per_layer: int
    """What each other decoder layer keeps; its input with recomputation."""
    layers: int
    """All decoder layers when the backward pass starts."""
    recomputed: int
    """With recomputation, what a layer's recomputed forward adds beside its
    kept input, for one layer at a time; 0 without."""
    readout_loss: ReadoutLoss
    total: int
    """The most alive at one time: `layers` plus the loss's peak; with
    recomputation, `layers` plus the larger of the loss's peak and a
    recomputed layer, which never coexist."""
    beside_gradients: int
    """What is alive while the layers' gradients are made: `layers`, and
    with recomputation a recomputed layer; the loss's peak has passed."""


def activation_bytes(config: LlamaConfig, *, batch: int, seq: int,
                     finetune: str = "all", lora_rank: int = 8,
                     lora_targets: Sequence[str] | None = None,
                     checkpointing: bool = False,
                     kernels: LlamaKernels | None = None,
                     compiled: bool = False) -> ActivationMemory:
    r"""
    ### Activation bytes of the whole model, per rank

    `[Embedding, DecoderLayer × L, FinalNorm, Readout]` in bf16, the readout
    returning the loss. The embedding keeps its ids (int64, the batch's own
    storage) and nothing else; its output needs a gradient only when it trains
    (`all`), so behind LoRA's frozen embedding the first layer keeps less
    (`input_requires_grad=False`). Not counted: the gradients in flight during
    the backward pass, the attention kernels' workspace and RNG scalars, the
    allocator's rounding. `compiled`: the layers run under `torch.compile`
    (`--compile`), whose partitioner chooses what they keep: as
    `layer_activation_bytes` says.

    With recomputation (the engine's `activation_checkpointing`) every unit but
    the loss head keeps its input, and the backward pass recomputes one layer
    at a time after the loss's backward pass is done.

    On the benchmark's Llama-3.2-1B job (full fine-tune, no recomputation)
    the whole model
    keeps {{py: llama_activations.activation_memory(workloads.workloads()["L1"].model,
    batch=workloads.workloads()["L1"].batch,
    seq=workloads.workloads()["L1"].seq) / 2**30 | .2f}} GiB plain and {{py:
    llama_activations.activation_memory(workloads.workloads()["L1"].model,
    batch=workloads.workloads()["L1"].batch, seq=workloads.workloads()["L1"].seq,
    kernels=llama_kernels.LlamaKernels.all_fused()) / 2**30 | .2f}} GiB with
    every fused kernel, most of the difference the plain loss's logits.
    """
    _check(config, batch, seq, 2)
    kernels = kernels or LlamaKernels()
    trains, others = _trainable(config, finetune, lora_rank, lora_targets)
    n, L = batch * seq, config.n_layers
    readout_loss = readout_loss_bytes(config, batch=batch, seq=seq,
                                      finetune=finetune,
                                      checkpointing=checkpointing, kernels=kernels)
    embedding_trains = "embed_tokens.weight" in others
    size = dict(n=n, p=2, lora_rank=lora_rank, kernels=kernels,
                fp8_recomputed=fp8_inputs_recomputed(kernels, compiled))
    full = _layer_bytes(config, trains, input_requires_grad=True, **size)
    first = _layer_bytes(config, trains, input_requires_grad=embedding_trains,
                         **size)
    if checkpointing:
        kept = n * config.d_model * 2  # the input, [B, T, d] bf16
        # The recomputed forward saves its set again; the fused RMSNorm's
        # saved input is the kept storage itself, the plain one's an fp32 copy.
        shared = kept if kernels.rms_norm else 0
        recomputed = (full if L > 1 else first) - shared
        layers = L * kept
        total = layers + max(readout_loss.peak, recomputed)
        return ActivationMemory(kept, kept, layers, recomputed, readout_loss,
                                total, layers + recomputed)
    layers = first + (L - 1) * full
    return ActivationMemory(first, full, layers, 0, readout_loss,
                            layers + readout_loss.peak, layers)


def activation_memory(config: LlamaConfig, *, batch: int, seq: int,
                      finetune: str = "all", checkpointing: bool = False,
                      kernels: LlamaKernels | None = None, compiled: bool = False,
                      lora_rank: int = 8,
                      lora_targets: Sequence[str] | None = None,
                      beside_gradients: bool = False) -> int:
    """
    ### The family's question: `activation_bytes(...).total`

    The bytes a rank's activations take at their peak, which the benchmark's
    predicted peak adds to the model states and gathered chunks; with
    `beside_gradients`, those alive while the layers' gradients are made.
    """
    count = activation_bytes(config, batch=batch, seq=seq, finetune=finetune,
                             lora_rank=lora_rank, lora_targets=lora_targets,
                             checkpointing=checkpointing, kernels=kernels,
                             compiled=compiled)
    return count.beside_gradients if beside_gradients else count.total
