r"""
---
title: GPT-NeoX model
summary: GPT-NeoX as a list of layers (embedding, transformer layers, final norm,
  readout) with partial rotary embeddings and parallel (or sequential)
  residuals, named like
  Hugging Face so checkpoints map one to one.
---

# GPT-NeoX model

GPT-NeoX ([Black et al.](https://arxiv.org/abs/2204.06745)) and the Pythia
suite ([Biderman et al.](https://arxiv.org/abs/2304.01373)) are decoder-only
transformers with two departures from GPT-2: **partial rotary embeddings**
(see [rotary embeddings](rotary.html)) and the **parallel residual**, attention
and the MLP both reading the *same* input $x_l$, each through its own layer
norm:

$$x_{l+1} = x_l + \operatorname{Attn}(\operatorname{LN}_1(x_l))
                + \operatorname{MLP}(\operatorname{LN}_2(x_l)).$$

The model is a list of layers, since the ZeRO engine shards and gathers one
layer at a time (`build_layers`), with shapes from a `NeoXConfig` (see
[GPT-NeoX configuration](config.html)).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch import nn

from labml_zero.layers.float8 import to_float8
from labml_zero.layers.layer_list import (LayerChain, count_parameters,
                                          init_like_hf, layer_indices,
                                          token_table)
from labml_zero.neox import kernels as K
from labml_zero.neox.kernels import ModelKernels

# The rotary embeddings have their own page; re-exported here, where the
# attention uses them.
from labml_zero.neox.rotary import (  # noqa: F401
    RotaryTables,
    apply_rotary,
    rotary_cos_sin,
    rotary_fused,
    rotary_joint_fused,
    rotary_joint_plain,
    rotary_plain,
    rotary_table_bytes,
    rotate_half,
)

# The configuration and its presets live on their own page; they are re-exported
# here, so `from labml_zero.neox.model import NeoXConfig, pythia_160m` keeps
# working.
from labml_zero.neox.config import (  # noqa: F401
    NeoXConfig,
    from_hf_config,
    gpt_neox_20b,
    pythia_1_4b,
    pythia_1b,
    pythia_2_8b,
    pythia_6_9b,
    pythia_12b,
    pythia_70m,
    pythia_160m,
    pythia_410m,
    tiny,
    to_hf_config,
)

__all__ = [
    "NeoXConfig",
    "ModelKernels",
    "NeoXChain",
    "build_layers",
    "hf_prefix",
    "from_hf_config",
    "to_hf_config",
    "Embedding",
    "TransformerLayer",
    "FinalNorm",
    "Readout",
    "count_parameters",
    "tiny",
    "pythia_70m",
    "pythia_160m",
    "pythia_410m",
    "pythia_1b",
    "pythia_1_4b",
    "pythia_2_8b",
    "pythia_6_9b",
    "pythia_12b",
    "gpt_neox_20b",
]


# ## Initialisation


def _init_like_hf(module: nn.Module, std: float):
    r"""
    #### HF GPT-NeoX init

    [The shared one](../layers/layer_list.html) with layer norms: $\mathcal{N}(0,
    \sigma^2)$ for linear and embedding weights, $\sigma$ the config's
    `init_std` ({{py: neox_model.NeoXConfig().init_std | .2f}} by default),
    zero biases, unit/zero layer norms.
    """
    init_like_hf(module, std, norms=(nn.LayerNorm,))


def init_parameter(config: NeoXConfig) -> Callable[[str, torch.Tensor], None]:
    r"""
    #### The same initialisation, one parameter at a time

    For `zero3_layers(..., init_param=...)`, which initialises meta-built layers
    chunk by chunk: layer-norm weights 1, biases 0, every other weight
    $\mathcal{N}(0, \sigma^2)$. The distributions of `_init_like_hf`; the draws
    differ, since parameters are visited in chunk order.
    """

    def init(name: str, param: torch.Tensor) -> None:
        if name.endswith(".bias"):
            param.zero_()
        elif "layernorm" in name or "layer_norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, config.init_std)

    return init



class Embedding(nn.Module):
    """
    ## Token embedding

    `embed_in`: `[B, T]` long ids to `[B, T, d]` vectors. There are no position
    embeddings; positions enter only through the rotary angles. Input and
    output embeddings are never tied, as in every released GPT-NeoX.
    """

    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.embed_in = token_table(config.n_vocab, config.d_model,
                                    device=device, dtype=dtype)

    def reset_parameters(self):
        _init_like_hf(self, self.config.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Shapes are Python ints: this check costs no device sync.
        if ids.shape[-1] > self.config.max_position:
            raise ValueError(f"sequence length {ids.shape[-1]} exceeds "
                             f"max_position={self.config.max_position}")
        return self.embed_in(ids)  # [B, T, d]



class Attention(nn.Module):
    """
    ## Causal self-attention with a fused QKV projection

    `query_key_value` is one `d → 3d` linear whose output is laid out
    **head-major**: for each head, its $q$, $k$ and $v$ are adjacent
    (`[n_h, 3, d_h]`), not `[3, n_h, d_h]` as in GPT-2. Reading it in the wrong
    order still runs, and silently gives nonsense. Causal, with no other mask
    and no KV cache: every forward sees whole sequences of equal length
    (training and the simple sampler of `generate.py`); no dropout (the
    released models use none).
    """

    def __init__(self, config: NeoXConfig, *, kernels: ModelKernels | None = None,
                 rotary_tables: RotaryTables | None = None,
                 device=None, dtype=None):
        super().__init__()
        kernels = kernels or ModelKernels()
        self.config = config
        d = config.d_model
        self.query_key_value = nn.Linear(d, 3 * d, device=device, dtype=dtype)
        self.dense = nn.Linear(d, d, device=device, dtype=dtype)
        # chosen once: the fused rotation or its plain twin, same signature
        self.rotate = rotary_joint_fused if kernels.rotary else rotary_joint_plain
        # the model's shared tables (see `RotaryTables`), else this layer's own
        self.rotary_tables = (RotaryTables(config) if rotary_tables is None
                              else rotary_tables)
        self.backend = kernels.attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        n_h, d_h = self.config.n_heads, self.config.head_dim
        qkv = self.query_key_value(x).view(B, T, n_h, 3, d_h)  # head-major
        # Views; in the backward pass one `cat` writes the gradient of `qkv`
        # in the linear's own layout, so it needs no copy to become `[B, T, 3d]`.
        qk, v = qkv.split([2, 1], dim=3)  # [B, T, n_h, 2 | 1, d_h]
        # q and k as one view, [2, B, n_h, T, d_h]: one pass rotates both.
        qk = qk.permute(3, 0, 2, 1, 4)
        v = v.squeeze(3).transpose(1, 2)  # [B, n_h, T, d_h]
        # Attention saves v for its backward pass. As a view, v would keep all of
        # `qkv` alive until then, three times its own size (q and k below are a
        # new tensor); its own copy frees the other two thirds, $2 \cdot 2BTd$ bytes in
        # bf16 per layer; for Pythia-1.4B at 8 sequences of its full context
        # ($T = d$) that is
        # $2 \cdot 2 \cdot 8 \cdot 2048^2 \text{ B} \approx 134 \text{ MB}$
        # (tested: tests/neox/test_model.py::test_figure_in_the_attention_notes).
        v = v.contiguous()
        if self.config.rotary_dim > 0:
            q, k = self.rotate(qk, self.config, self.rotary_tables)
        else:
            q, k = qk.unbind(0)  # views of the QKV output
        # softmax(q kᵀ / √d_h + causal mask) v; PyTorch picks the backend
        # unless the kernels pin one.
        y = K.attention(q, k, v, self.backend)
        y = y.transpose(1, 2).reshape(B, T, d)  # [B, T, d], heads concatenated
        return self.dense(y)



class MLP(nn.Module):
    r"""
    ## Feed-forward: $W_2 \operatorname{GELU}(W_1 x + b_1) + b_2$

    Pythia's configs say `hidden_act: "gelu"`, the exact erf GELU; GPT-NeoX-20B's
    says `"gelu_fast"`, the tanh approximation

    $$\operatorname{GELU}(x) \approx \frac{x}{2}\left(1 + \tanh\left(
      \sqrt{2/\pi}\,(x + 0.044715\, x^3)\right)\right).$$
    (tested: tests/neox/test_model.py::test_tanh_gelu_is_the_formula_of_the_notes)

    `NeoXConfig.gelu_approximate` is `'none'` or `'tanh'` accordingly, and each
    preset sets the one its checkpoint was trained with.
    """

    def __init__(self, config: NeoXConfig, *, kernels: ModelKernels | None = None,
                 device=None, dtype=None):
        super().__init__()
        kernels = kernels or ModelKernels()
        self.approximate = config.gelu_approximate
        d, d_ff = config.d_model, config.ff_dim
        self.dense_h_to_4h = nn.Linear(d, d_ff, device=device, dtype=dtype)
        self.dense_4h_to_h = nn.Linear(d_ff, d, device=device, dtype=dtype)
        # GELU(W_1 x + b_1): fused bias and GELU, or the plain linear then GELU
        self.up = K.up_fused if kernels.bias_gelu else K.up_plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x, self.dense_h_to_4h, self.approximate)  # [B, T, d_ff]
        return self.dense_4h_to_h(h)



class TransformerLayer(nn.Module):
    r"""
    ## Transformer layer with a parallel residual

    $x + \operatorname{Attn}(\operatorname{LN}_1(x))
       + \operatorname{MLP}(\operatorname{LN}_2(x))$, or, with
    `config.use_parallel_residual=False`, the sequential $y + \operatorname{MLP}(
    \operatorname{LN}_2(y))$ of $y = x + \operatorname{Attn}(\operatorname{LN}_1(x))$,
    GPT-2's sequential residual, with the same parameters under the same names
    (none of the released checkpoints has it). The parallel branches are
    independent, so they could run at the same time.

    The passes between the matrix products (rotary embeddings, the two layer
    norms, bias and GELU) are plain PyTorch or [fused kernels](kernels.html),
    chosen once by `build_layers(config, kernels=...)`. The fused `norms`
    kernel reads one $x$ for both norms, so it serves the parallel residual
    only; a sequential layer runs its two norms in turn.

    `layer_idx` is the index in the *full* model, also when `build_layers` keeps
    only some layers, so the checkpoint name of every parameter is known.
    `rotary_tables` is the model's shared `RotaryTables`; a layer built alone
    makes its own.
    """

    def __init__(self, config: NeoXConfig, layer_idx: int, *,
                 kernels: ModelKernels | None = None,
                 rotary_tables: RotaryTables | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        kernels = kernels or ModelKernels()
        d, eps = config.d_model, config.layer_norm_eps
        factory = dict(device=device, dtype=dtype)
        self.input_layernorm = nn.LayerNorm(d, eps=eps, **factory)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=eps, **factory)
        self.attention = Attention(config, kernels=kernels,
                                   rotary_tables=rotary_tables, **factory)
        self.mlp = MLP(config, kernels=kernels, **factory)
        # both norms of x in one pass, or each LayerNorm module in turn
        self.norms = K.norms_fused if kernels.norms else K.norms_plain
        if config.rotary_dim > 0:
            self.register_forward_pre_hook(TransformerLayer.prepare_rotary_tables)

    def prepare_rotary_tables(self, args: tuple) -> None:
        """
        #### The rotary tables' entry, made before the forward

        So that a compiled forward reads the tables as graph inputs
        (`RotaryTables.prepare` on the [rotary page](rotary.html)).
        """
        attention = self.attention
        attention.rotary_tables.prepare(args[0],
                                        attention.query_key_value.weight.dtype)

    def reset_parameters(self):
        _init_like_hf(self, self.config.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.config.use_parallel_residual:
            # GPT-2's order; HF sums `attn + x`, then `mlp + y`, as here
            y = self.attention(self.input_layernorm(x)) + x
            return self.mlp(self.post_attention_layernorm(y)) + y
        h_attn, h_mlp = self.norms(x, self.input_layernorm,
                                   self.post_attention_layernorm)
        attn = self.attention(h_attn)
        mlp = self.mlp(h_mlp)
        # Same summation order as HF (mlp + attn + x), so fp32 results agree to
        # the last few ulps.
        return mlp + attn + x

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"



class FinalNorm(nn.Module):
    """
    ## Final layer norm, before the readout
    """

    def __init__(self, config: NeoXConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.final_layer_norm = nn.LayerNorm(config.d_model,
                                             eps=config.layer_norm_eps,
                                             device=device, dtype=dtype)

    def reset_parameters(self):
        _init_like_hf(self, self.config.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(x)


class Readout(nn.Module):
    """
    ## Readout: `[B, T, d]` to logits `[B, T, n_vocab]`, no bias, not tied

    Given `targets` `[B, T]` as well, it returns the mean next-token
    cross-entropy instead, the fp32 scalar of
    `F.cross_entropy(logits.float()...)`: with the `loss` kernel computed in
    chunks that never hold the logits ([fused kernels](kernels.html)), else
    from the logits by the plain twin.
    """

    def __init__(self, config: NeoXConfig, *, kernels: ModelKernels | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.config = config
        kernels = kernels or ModelKernels()
        self.embed_out = nn.Linear(config.d_model, config.n_vocab, bias=False,
                                   device=device, dtype=dtype)
        self.loss = (functools.partial(K.fused_readout_loss,
                                       chunk_rows=kernels.loss_chunk_rows)
                     if kernels.loss else K.plain_readout_loss)

    def reset_parameters(self):
        _init_like_hf(self, self.config.init_std)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor:
        if targets is None:
            return self.embed_out(x)  # [B, T, n_vocab]
        return self.loss(x, self.embed_out, targets)  # [] fp32


# ## Building the list
#
# The ZeRO engine shards and gathers one *layer* at a time, so the model is not
# one module but a list, `[Embedding, TransformerLayer × n, FinalNorm, Readout]`,
# and `nn.Sequential(*build_layers(config))` maps token ids `[B, T]` to logits
# `[B, T, n_vocab]`. A layer carries no buffers and no state besides its
# parameters (the transformer layers share a `RotaryTables`, a cache rebuilt
# on whatever device they run on), so a layer built on the meta device needs
# nothing but `to_empty` and `reset_parameters`.


def build_layers(config: NeoXConfig, *, filter_layers: Iterable[int] | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None,
                 kernels: ModelKernels | None = None) -> list[nn.Module]:
    """
    ### Build `[Embedding, TransformerLayer × n, FinalNorm, Readout]`

    * `filter_layers` keeps only the transformer layers with these indices (to
      try a big model with a few of its layers); the embedding, final norm and
      readout are always built.
    * `device='meta'` allocates nothing; call `to_empty(device=...)` and then
      `reset_parameters()` on each layer, or load a checkpoint into it.
    * Weights are initialised as HF does (see `_init_like_hf`) unless on meta.
    * `kernels` chooses the [fused kernels](kernels.html), once for every
      layer; by default none, the plain PyTorch model. With `kernels.fp8` the
      transformer layers' linears become `Float8Linear` ([fp8
      products](../layers/float8.html)).
    """
    indices = layer_indices(config.n_layers, filter_layers)
    factory = dict(device=device, dtype=dtype)
    kernels = kernels or ModelKernels()
    layers: list[nn.Module] = [Embedding(config, **factory)]
    rotary_tables = RotaryTables(config)  # one for every layer
    layers += [TransformerLayer(config, i, kernels=kernels,
                                rotary_tables=rotary_tables, **factory)
               for i in indices]
    layers += [FinalNorm(config, **factory),
               Readout(config, kernels=kernels, **factory)]
    if kernels.fp8:  # the layers' linears only, before any chunk exists
        for layer in layers[1:-2]:
            to_float8(layer, emulate=kernels.fp8_emulate,
                      every_linear=kernels.fp8_every_linear)
    if torch.device(device or "cpu").type != "meta":
        for layer in layers:
            layer.reset_parameters()
    return layers


class NeoXChain(LayerChain):
    """
    ## The layers in a chain, with the loss at its end

    `NeoXChain(*build_layers(config))(ids)` is the logits; `(ids, targets)`
    hands the targets to the `Readout`, which returns the loss ([the shared
    chain](../layers/layer_list.html)).
    """


def hf_prefix(layer: nn.Module) -> str:
    """
    ### The Hugging Face name prefix of a layer

    Inside each layer the submodules have Hugging Face's names, so checkpoints
    map one to one.
    `hf_prefix(layer) + name` is the checkpoint name of each
    `layer.state_dict()` entry:

    * `Embedding`: `embed_in.weight` is `gpt_neox.embed_in.weight`;
    * `TransformerLayer` $i$: `attention.dense.weight` is
      `gpt_neox.layers.`$i$`.attention.dense.weight`, and likewise
      `input_layernorm`, `post_attention_layernorm`, `attention.query_key_value`,
      `mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`;
    * `FinalNorm`: `final_layer_norm.*` is `gpt_neox.final_layer_norm.*`;
    * `Readout`: `embed_out.weight` is `embed_out.weight`.
    """
    if isinstance(layer, TransformerLayer):
        return f"gpt_neox.layers.{layer.layer_idx}."
    if isinstance(layer, (Embedding, FinalNorm)):
        return "gpt_neox."
    if isinstance(layer, Readout):
        return ""
    raise ValueError(f"hf_prefix: {type(layer).__name__} is not a GPT-NeoX layer")


# ## The plain path's launches, kernel by kernel


def plain_launches(kernel: str, config) -> int:
    """
    #### The plain twin's forward launches for one layer of `config`

    `kernel` is `'rotary'`, `'rotary_tables'`, `'norms'` or `'bias_gelu'`, run
    on a small meta batch; here, on the model's page, because these are the
    model's own plain paths (the rotation's from [its page](rotary.html)).
    `'rotary'` is a layer's rotation as `Attention` runs it, the tables already
    built by an earlier layer; `'rotary_tables'` is building them once.
    """
    meta = dict(device="meta", dtype=torch.bfloat16)
    d, n_h, d_h = config.d_model, config.n_heads, config.head_dim
    x = torch.empty(1, 16, d, **meta)
    if kernel == "rotary":
        qkv = torch.empty(1, 16, n_h, 3, d_h, **meta)
        qk = qkv[:, :, :, :2].permute(3, 0, 2, 1, 4)  # as `Attention.forward`
        tables = RotaryTables(config)
        tables(16, qk.device, qk.dtype)
        return K.forward_launches(rotary_joint_plain, qk, config, tables)
    if kernel == "rotary_tables":
        return K.forward_launches(RotaryTables(config), 16, x.device, x.dtype)
    if kernel == "norms":
        ln = nn.LayerNorm(d, **meta)
        return K.forward_launches(K.norms_plain, x, ln, ln)
    if kernel == "bias_gelu":
        linear = nn.Linear(d, config.ff_dim, **meta)
        return K.forward_launches(K.up_plain, x, linear, config.gelu_approximate)
    raise ValueError(f"plain_launches: no kernel {kernel!r}")
