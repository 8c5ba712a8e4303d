r"""
---
title: Llama model
summary: Llama, Qwen2.5, Mistral and SmolLM2 as one list of layers: RMSNorm,
  grouped-query attention with full rotary embeddings, SwiGLU, and a readout
  that may be the embedding's own matrix; named like Hugging Face.
---

# Llama model

A Llama layer is a *sequential* pre-norm residual, where GPT-NeoX's is
parallel ([its model page](../neox/model.html)): the MLP reads the output of
attention,

$$h = x + \operatorname{Attn}(\operatorname{RMS}_1(x)), \qquad
x_{l+1} = h + \operatorname{MLP}(\operatorname{RMS}_2(h)).$$

Three parts differ from GPT-NeoX, each beside its class below: RMSNorm,
grouped-query attention and SwiGLU.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from labml_zero.layers.float8 import to_float8
from labml_zero.layers.layer_list import (LayerChain, count_parameters,
                                          init_like_hf, layer_indices,
                                          token_table)
from labml_zero.llama.config import LlamaConfig
from labml_zero.llama import kernels as K
from labml_zero.llama.kernels import LlamaKernels
from labml_zero.llama.rotary import LlamaRotary, rotate_qk, rotate_qk_fused
from labml_zero.neox.kernels import fused_readout_loss, plain_readout_loss

__all__ = ["RMSNorm", "Embedding", "Attention", "MLP", "DecoderLayer",
           "FinalNorm", "Readout", "build_layers", "tie_embeddings", "LlamaChain",
           "hf_prefix", "count_parameters"]


def init_llama(module: nn.Module, std: float) -> None:
    r"""
    #### HF Llama init

    [The shared one](../layers/layer_list.html) with RMSNorms:
    $\mathcal{N}(0, \sigma^2)$ for linear and embedding weights, zero biases,
    unit RMSNorm weights.
    """
    init_like_hf(module, std, norms=(RMSNorm,))


# ## RMSNorm


class RMSNorm(nn.Module):
    r"""
    ## RMSNorm: $w \odot x / \sqrt{\overline{x^2} + \epsilon}$

    [Zhang and Sennrich](https://arxiv.org/abs/1910.07467): no mean and no
    bias, so one weight vector of $d$ per norm where LayerNorm has two.
    The mean of the squares over the $d$ features, in fp32 whatever the
    activations' dtype; the normalised value is cast back before the weight
    multiplies it, in Hugging Face's order, so bf16 results agree bit for bit.
    The formula is `kernels.rms_norm`; `fused` runs it compiled on the GPU.
    """

    def __init__(self, d: int, eps: float, *, fused: bool = False, device=None,
                 dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))
        self.normalize = K.rms_norm_fused if fused else K.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight, self.eps)  # [B, T, d]


# ## Embedding


class Embedding(nn.Module):
    """
    ## Token embedding

    `embed_tokens`: `[B, T]` ids to `[B, T, d]`. With tied embeddings its
    weight is also the readout's (see `tie_embeddings`).
    """

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.embed_tokens = token_table(config.n_vocab, config.d_model,
                                        device=device, dtype=dtype)

    def reset_parameters(self):
        init_llama(self, self.config.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Shapes are Python ints: no device sync.
        if ids.shape[-1] > self.config.max_sequence:
            raise ValueError(f"sequence length {ids.shape[-1]} exceeds the "
                             f"model's {self.config.max_sequence} (max_position "
                             f"or sliding_window)")
        return self.embed_tokens(ids)  # [B, T, d]


# ## Grouped-query attention


class Attention(nn.Module):
    r"""
    ## Causal grouped-query attention

    Four projections with Hugging Face's names. Query head $j$ reads key-value
    head $\lfloor j / (n_h / n_{kv}) \rfloor$; `scaled_dot_product_attention`
    with `enable_gqa` does that indexing itself, without copying K and V out
    to $n_h$ heads as Hugging Face's eager path does.

    $W_k$ and $W_v$ have $n_{kv} d_h$ rows instead of $n_h d_h$, so a layer's
    attention holds

    $$2 d \cdot n_h d_h + 2 d \cdot n_{kv} d_h$$

    parameters (plus $(n_h + 2 n_{kv}) d_h$ biases in Qwen2): for Llama-3.1-8B,
    with four query heads to a key-value head, the K and V projections are a
    quarter of the Q projection each
    (tested: tests/llama/test_flops.py::test_gqa_saves_the_kv_projections_share).
    No KV cache, no mask other than causal, no dropout.
    """

    def __init__(self, config: LlamaConfig, rotary: LlamaRotary, *,
                 kernels: LlamaKernels | None = None, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.rotary = rotary
        self.rotate = (rotate_qk_fused if (kernels or LlamaKernels()).rotary
                       else rotate_qk)
        d, d_h = config.d_model, config.head_width
        n_h, n_kv = config.n_heads, config.n_kv_heads
        factory = dict(device=device, dtype=dtype)
        bias = config.qkv_bias
        self.q_proj = nn.Linear(d, n_h * d_h, bias=bias, **factory)
        # n_kv d_h rows, not n_h d_h: GQA's saving in parameters and in the
        # K and V activations a layer keeps for its backward pass.
        self.k_proj = nn.Linear(d, n_kv * d_h, bias=bias, **factory)
        self.v_proj = nn.Linear(d, n_kv * d_h, bias=bias, **factory)
        self.o_proj = nn.Linear(n_h * d_h, d, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.config
        d_h = c.head_width
        # [B, n_h, T, d_h] for q; [B, n_kv, T, d_h] for k and v
        q = self.q_proj(x).view(B, T, c.n_heads, d_h).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, d_h).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, d_h).transpose(1, 2)
        cos, sin = self.rotary(T, x.device, q.dtype)  # each [T, d_h]
        q, k = self.rotate(q, k, cos, sin)
        # softmax(q kᵀ / √d_h + causal mask) v, each query head on its group's k, v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=c.n_kv_heads != c.n_heads)
        y = y.transpose(1, 2).reshape(B, T, c.n_heads * d_h)  # heads concatenated
        return self.o_proj(y)


# ## SwiGLU


class MLP(nn.Module):
    r"""
    ## SwiGLU: $W_\text{down}\,(\operatorname{SiLU}(W_\text{gate} x) \odot W_\text{up} x)$

    [Shazeer](https://arxiv.org/abs/2002.05202): three matrices instead of
    two, $3 d\, d_{ff}$ parameters. $\operatorname{SiLU}(z) = z\,\sigma(z)$. The gate makes the unit
    multiplicative; to keep the parameter count of a $4d$ GELU MLP, the hidden
    width is about $\frac{2}{3} \cdot 4d$ (Llama rounds it up; others choose
    freely).
    """

    def __init__(self, config: LlamaConfig, *, kernels: LlamaKernels | None = None,
                 device=None, dtype=None):
        super().__init__()
        d, d_ff = config.d_model, config.d_ff
        factory = dict(device=device, dtype=dtype, bias=False)
        self.gate_proj = nn.Linear(d, d_ff, **factory)
        self.up_proj = nn.Linear(d, d_ff, **factory)
        self.down_proj = nn.Linear(d_ff, d, **factory)
        self.gate = (K.swiglu_fused if (kernels or LlamaKernels()).swiglu
                     else K.swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(self.gate_proj(x), self.up_proj(x))  # [B, T, d_ff]
        return self.down_proj(h)


# ## Decoder layer


class DecoderLayer(nn.Module):
    """
    ## A sequential pre-norm layer

    `layer_idx` is the index in the full model, so the checkpoint name of each
    parameter is known also when `build_layers` keeps only some layers.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int, rotary: LlamaRotary, *,
                 kernels: LlamaKernels | None = None, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        factory = dict(device=device, dtype=dtype)
        kernels = kernels or LlamaKernels()
        d, eps = config.d_model, config.rms_norm_eps
        norm = dict(fused=kernels.rms_norm, **factory)
        self.input_layernorm = RMSNorm(d, eps, **norm)
        self.self_attn = Attention(config, rotary, kernels=kernels, **factory)
        self.post_attention_layernorm = RMSNorm(d, eps, **norm)
        self.mlp = MLP(config, kernels=kernels, **factory)
        self.register_forward_pre_hook(DecoderLayer.prepare_rotary_tables)

    def prepare_rotary_tables(self, args: tuple) -> None:
        """The rotary tables' entry, made outside a compiled forward
        (`RotaryTables.prepare`), so that its recomputation under activation
        checkpointing traces the same graph as the forward."""
        attention = self.self_attn
        attention.rotary.prepare(args[0], attention.q_proj.weight.dtype)

    def reset_parameters(self):
        init_llama(self, self.config.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


# ## Final norm and readout


class FinalNorm(nn.Module):
    """## The last RMSNorm, before the readout"""

    def __init__(self, config: LlamaConfig, *, kernels: LlamaKernels | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.config = config
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps,
                            fused=(kernels or LlamaKernels()).rms_norm,
                            device=device, dtype=dtype)

    def reset_parameters(self):
        init_llama(self, self.config.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class Readout(nn.Module):
    """
    ## Readout: `[B, T, d]` to logits `[B, T, n_vocab]`, or the loss

    Given `targets` `[B, T]` it returns the mean next-token cross-entropy in
    fp32, as GPT-NeoX's plain readout does, or, with the `loss` kernel, its
    chunked readout and loss that never holds the logits. With tied
    embeddings `lm_head`'s weight is the embedding's parameter, and
    `reset_parameters` leaves it to the embedding.
    """

    def __init__(self, config: LlamaConfig, *, kernels: LlamaKernels | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.d_model, config.n_vocab, bias=False,
                                 device=device, dtype=dtype)
        kernels = kernels or LlamaKernels()
        self.loss = (partial(fused_readout_loss,
                             chunk_rows=kernels.loss_chunk_rows)
                     if kernels.loss else plain_readout_loss)

    def reset_parameters(self):
        if not self.config.tie_embeddings:
            init_llama(self, self.config.init_std)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor:
        if targets is None:
            return self.lm_head(x)  # [B, T, n_vocab]
        return self.loss(x, self.lm_head, targets)  # [] fp32


# ## Building the list
#
# As for GPT-NeoX, `[Embedding, DecoderLayer × L, FinalNorm, Readout]`, with
# one `LlamaRotary` for all layers. A tied model has one parameter in two
# layers, which both the first and the last layer read (see Note: a tied
# embedding in the chunk layout).


def tie_embeddings(layers: list[nn.Module]) -> None:
    r"""
    ### Make the readout's weight the embedding's parameter

    #### Note: a tied embedding in the chunk layout

    Tying is one `nn.Parameter` registered in two modules. The engine lays
    every parameter out once; the readout reads it long after the embedding's
    forward, so whichever unit holds it must stay gathered until the end of
    the backward pass. [`zero3_layers`](../zero3/sharded_model.html), which
    the fine-tune job shards with, lays it out in the embedding layer, held
    gathered for the whole step, and the readout borrows it, left with no
    chunks of its own; `shard_model` puts it in its root unit, gathered as
    long. Either way the matrix takes the sum of both uses' gradients, reduced
    once, and costs $V d$ elements that every rank holds gathered during the
    step, instead of the second matrix of an untied model. Building on the
    meta device and then calling `to_empty` layer by layer gives each layer
    its own tensor: call this again after `to_empty`.
    """
    embedding, readout = layers[0], layers[-1]
    if not (isinstance(embedding, Embedding) and isinstance(readout, Readout)):
        raise ValueError("tie_embeddings: the list must start with an Embedding "
                         "and end with a Readout")
    readout.lm_head.weight = embedding.embed_tokens.weight


def build_layers(config: LlamaConfig, *, filter_layers: Iterable[int] | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None,
                 kernels: LlamaKernels | None = None) -> list[nn.Module]:
    """
    ### Build `[Embedding, DecoderLayer × n, FinalNorm, Readout]`

    The model is this list: the unit the engine gathers and releases.

    * `filter_layers` keeps only the decoder layers with these indices.
    * `device='meta'` allocates nothing; after `to_empty`, call
      `tie_embeddings` again (tied models) and `reset_parameters` or load a
      checkpoint.
    * Off meta, weights are initialised as Hugging Face does.
    * `kernels` chooses the [fused kernels](kernels.html) once for every
      layer; `None` is the plain model (no fused kernel). One `LlamaRotary`
      is made here for every layer; its tables are computed by the first
      layer's forward pre-hook, outside any compiled forward. With `kernels.fp8` the
      decoder layers' linears become `Float8Linear` ([fp8
      products](../layers/float8.html)).
    """
    indices = layer_indices(config.n_layers, filter_layers)
    factory = dict(device=device, dtype=dtype)
    kernels = kernels or LlamaKernels()
    rotary = LlamaRotary(config)
    layers: list[nn.Module] = [Embedding(config, **factory)]
    layers += [DecoderLayer(config, i, rotary, kernels=kernels, **factory)
               for i in indices]
    layers += [FinalNorm(config, kernels=kernels, **factory),
               Readout(config, kernels=kernels, **factory)]
    if kernels.fp8:  # the decoder layers' linears only, before any chunk exists
        for layer in layers[1:-2]:
            to_float8(layer, emulate=kernels.fp8_emulate,
                      every_linear=kernels.fp8_every_linear)
    if config.tie_embeddings:
        tie_embeddings(layers)
    if torch.device(device or "cpu").type != "meta":
        for layer in layers:
            layer.reset_parameters()
    return layers


class LlamaChain(LayerChain):
    """
    ## The layers in a chain, with the loss at its end

    `LlamaChain(*build_layers(config))(ids)` is the logits; `(ids, targets)`
    hands the targets to the `Readout`, which returns the loss ([the shared
    chain](../layers/layer_list.html)).
    """


def hf_prefix(layer: nn.Module) -> str:
    """
    ### The Hugging Face name prefix of a layer

    `hf_prefix(layer) + name` is the checkpoint name of each entry of
    `layer.state_dict()`: `model.embed_tokens.weight`,
    `model.layers.`$i$`.self_attn.q_proj.weight`, `model.norm.weight`,
    `lm_head.weight`. A tied checkpoint has no `lm_head.weight`; its readout
    reads `model.embed_tokens.weight` ([the checkpoint page](hf_checkpoint.html)).
    """
    if isinstance(layer, DecoderLayer):
        return f"model.layers.{layer.layer_idx}."
    if isinstance(layer, (Embedding, FinalNorm)):
        return "model."
    if isinstance(layer, Readout):
        return ""
    raise ValueError(f"hf_prefix: {type(layer).__name__} is not a Llama layer")
