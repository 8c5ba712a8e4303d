r"""
---
title: Llama configuration
summary: The shape of a Llama-family model (Llama 3, Qwen2.5, Mistral, SmolLM2)
  as one dataclass, the released shapes as presets, and the map to and from
  Hugging Face's config.json.
---

# Llama configuration

Llama, Qwen2.5, Mistral and SmolLM2 are one architecture with different
shapes, so one frozen dataclass, `LlamaConfig`, describes them all. Where
[GPT-NeoX's configuration](../neox/config.html) has one head count, this one
has two: $n_h$ query heads and $n_{kv}$ key-value heads, each key-value head
shared by a group of $n_h / n_{kv}$ query heads (*grouped-query attention*,
[Ainslie et al.](https://arxiv.org/abs/2305.13245)). The head width $d_h$ is a
field of its own (most models have $d_h = d / n_h$), and the projections are

$$W_q \in \mathbb{R}^{n_h d_h \times d}, \qquad
W_k, W_v \in \mathbb{R}^{n_{kv} d_h \times d}.$$
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["LlamaConfig", "RopeScaling", "FAMILIES", "from_hf_config",
           "to_hf_config", "tiny", "smollm2_135m", "qwen2_5_0_5b", "llama_3_2_1b",
           "llama_3_2_3b", "qwen2_5_7b", "mistral_7b", "llama_3_1_8b", "PRESETS"]


@dataclass(frozen=True)
class RopeScaling:
    r"""
    ## Llama 3's rotary scaling

    Llama-3.1 and Llama-3.2 stretch the slow rotary frequencies to reach a longer
    context than they were pretrained on (HF's `rope_type: "llama3"`); the
    [rotary page](rotary.html) has the formula.
    """

    factor: float = 8.0
    """$s$: how much the slowest frequencies are divided by."""
    low_freq_factor: float = 1.0
    r"""$\alpha$: wavelengths above $L_0 / \alpha$ are divided by $s$."""
    high_freq_factor: float = 4.0
    r"""$\beta$: wavelengths below $L_0 / \beta$ are kept."""
    original_max_position: int = 8192
    """$L_0$: the context length of pretraining."""

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling: need 0 < low_freq_factor < "
                             f"high_freq_factor, got {self.low_freq_factor} and "
                             f"{self.high_freq_factor}")
        if self.original_max_position < 1:
            raise ValueError(f"rope_scaling.original_max_position_embeddings must "
                             f"be >= 1, got {self.original_max_position}")


# Hugging Face's `model_type` -> the architecture class its checkpoints name.
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM"}
# The window of Mistral-7B-v0.1, transformers' default for `sliding_window`.
MISTRAL_WINDOW = 4096


@dataclass(frozen=True)
class LlamaConfig:
    """
    ## Configuration

    The defaults are a tiny model that runs on a laptop CPU; the presets below
    give the released shapes.
    """

    n_vocab: int = 256
    """Rows of the embedding (and of the readout, tied or not)."""
    d_model: int = 64
    """Width of the residual stream, $d$."""
    n_heads: int = 4
    """Query heads, $n_h$."""
    n_kv_heads: int = 2
    """Key-value heads, $n_{kv}$; must divide $n_h$. $n_{kv} = n_h$ is plain
    multi-head attention, $n_{kv} = 1$ multi-query attention."""
    n_layers: int = 2
    """Transformer layers, $L$."""
    d_ff: int = 172
    """Width of the SwiGLU hidden layer, $d_{ff}$ (each of its two input
    projections has this many rows)."""
    head_dim: int | None = None
    """$d_h$; `None` means $d / n_h$ (kept unresolved, as NeoX's `d_ff`, so
    `dataclasses.replace(c, d_model=...)` follows); read `head_width`."""
    rope_theta: float = 10000.0
    r"""The rotary base $b$ in $\theta_i = b^{-2i/d_h}$."""
    rope_scaling: RopeScaling | None = None
    """Llama 3's scaling of the rotary frequencies, or `None` (HF's
    `default`)."""
    rms_norm_eps: float = 1e-5
    r"""$\epsilon$ of every RMSNorm."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2 and Qwen2.5); never on the
    output projection."""
    tie_embeddings: bool = False
    """The readout is the input embedding's matrix (one parameter): SmolLM2,
    Qwen2.5-0.5B, Llama-3.2."""
    max_position: int = 2048
    """Longest sequence accepted."""
    sliding_window: int | None = None
    """Mistral-7B-v0.1 attends to at most this many earlier tokens; sequences
    longer than it are refused, so inside a sequence the window never cuts."""
    init_std: float = 0.02
    """Standard deviation of the normal init (HF's `initializer_range`)."""
    model_type: str = "llama"
    """The family's name in `config.json`: `llama`, `qwen2` or `mistral`."""
    bos_token_id: int | None = None
    """The tokenizer's first and last tokens of a text and its padding (Llama 3
    ends a turn on any of several), carried from the snapshot's `config.json`
    into an export's, where `model.config` reads them; `None`: not given."""
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("n_vocab", "d_model", "n_heads", "n_kv_heads", "n_layers",
                     "d_ff", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(f"LlamaConfig.d_model={self.d_model} is not divisible "
                             f"by n_heads={self.n_heads}")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"LlamaConfig.head_dim must be >= 1, "
                             f"got {self.head_dim}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"LlamaConfig.n_heads={self.n_heads} is not divisible "
                             f"by n_kv_heads={self.n_kv_heads}")
        # `rotate_half` pairs dimension i with i + d_h/2.
        if self.head_width % 2 != 0:
            raise ValueError(f"LlamaConfig: the head width {self.head_width} "
                             f"must be even")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, "
                             f"got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, "
                             f"got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"LlamaConfig.sliding_window must be >= 1 or None, "
                             f"got {self.sliding_window}")
        if self.init_std <= 0:
            raise ValueError(f"LlamaConfig.init_std must be > 0, "
                             f"got {self.init_std}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"LlamaConfig.model_type must be one of "
                             f"{sorted(FAMILIES)}, got {self.model_type!r}")

    @property
    def head_width(self) -> int:
        """$d_h$."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key-value head, $n_h / n_{kv}$."""
        return self.n_heads // self.n_kv_heads

    @property
    def max_sequence(self) -> int:
        """The longest sequence the model accepts: the context, or the window."""
        if self.sliding_window is None:
            return self.max_position
        return min(self.max_position, self.sliding_window)


# ### Presets
#
# Shapes from each model's `config.json` on the Hugging Face hub; their
# parameter counts are checked against a count of transformers' own model
# built from `to_hf_config` (tests/llama/test_config.py). Derive variants with
# `dataclasses.replace`, e.g. `replace(llama_3_2_1b(), n_layers=2)`.


def tiny() -> LlamaConfig:
    """A laptop model: 2 layers, 4 query and 2 key-value heads."""
    return LlamaConfig()


def smollm2_135m() -> LlamaConfig:
    return LlamaConfig(n_vocab=49152, d_model=576, n_heads=9, n_kv_heads=3,
                       n_layers=30, d_ff=1536, rope_theta=100000.0,
                       tie_embeddings=True, max_position=8192)


def qwen2_5_0_5b() -> LlamaConfig:
    return LlamaConfig(n_vocab=151936, d_model=896, n_heads=14, n_kv_heads=2,
                       n_layers=24, d_ff=4864, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                       max_position=32768, model_type="qwen2")


def llama_3_2_1b() -> LlamaConfig:
    return LlamaConfig(n_vocab=128256, d_model=2048, n_heads=32, n_kv_heads=8,
                       n_layers=16, d_ff=8192, rope_theta=500000.0,
                       rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
                       max_position=131072)


def llama_3_2_3b() -> LlamaConfig:
    return LlamaConfig(n_vocab=128256, d_model=3072, n_heads=24, n_kv_heads=8,
                       n_layers=28, d_ff=8192, rope_theta=500000.0,
                       rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
                       max_position=131072)


def qwen2_5_7b() -> LlamaConfig:
    return LlamaConfig(n_vocab=152064, d_model=3584, n_heads=28, n_kv_heads=4,
                       n_layers=28, d_ff=18944, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, qkv_bias=True, max_position=131072,
                       model_type="qwen2")


def mistral_7b() -> LlamaConfig:
    """Mistral-7B-v0.1, with its sliding window."""
    return LlamaConfig(n_vocab=32000, d_model=4096, n_heads=32, n_kv_heads=8,
                       n_layers=32, d_ff=14336, max_position=32768,
                       sliding_window=MISTRAL_WINDOW, model_type="mistral")


def llama_3_1_8b() -> LlamaConfig:
    return LlamaConfig(n_vocab=128256, d_model=4096, n_heads=32, n_kv_heads=8,
                       n_layers=32, d_ff=14336, rope_theta=500000.0,
                       rope_scaling=RopeScaling(factor=8.0), max_position=131072)


PRESETS = {"smollm2-135m": smollm2_135m, "qwen2.5-0.5b": qwen2_5_0_5b,
           "llama-3.2-1b": llama_3_2_1b, "llama-3.2-3b": llama_3_2_3b,
           "qwen2.5-7b": qwen2_5_7b, "mistral-7b": mistral_7b,
           "llama-3.1-8b": llama_3_1_8b}
"""A preset's name, as a command line would spell it, to its function."""


# ### Hugging Face `config.json`
#
# `from_hf_config` reads both spellings of the rotary settings: transformers
# 4's `rope_theta` and `rope_scaling` (the hub's files) and transformers 5's
# `rope_parameters`. It raises `ValueError` naming the key;
# [the checkpoint page](hf_checkpoint.html) adds the file's name.


def from_hf_config(hf: Mapping[str, Any]) -> LlamaConfig:
    """
    ### Read a Hugging Face `config.json` (as a dict)

    Only what the four families' released checkpoints use: no attention bias
    on the output projection, no MLP biases, no sliding window inside a
    sequence (a sequence longer than the window is refused), rotary scaling
    `default` or `llama3` only; any other value is refused with the field's
    name.
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type {model_type!r} is not one of "
                         f"{sorted(FAMILIES)}")
    for key in ("vocab_size", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "num_hidden_layers"):
        if key not in hf:
            raise ValueError(f"config.json: no {key!r}")
    # Named here with config.json's fields, before `LlamaConfig` names its own.
    n_h, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    if n_kv < 1 or n_h % n_kv != 0:
        raise ValueError(f"config.json: num_attention_heads={n_h} is not "
                         f"divisible by num_key_value_heads={n_kv}")
    if hf.get("head_dim") is None and hf["hidden_size"] % n_h != 0:
        raise ValueError(f"config.json: hidden_size={hf['hidden_size']} is not "
                         f"divisible by num_attention_heads={n_h} (and no "
                         f"head_dim)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not 'silu'")
    if hf.get("mlp_bias", False):
        raise ValueError("config.json: mlp_bias=true is not supported")
    # Llama's `attention_bias` puts a bias on o_proj as well; Qwen2 has q, k
    # and v biases always and no such key.
    if model_type != "qwen2" and hf.get("attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported")
    if hf.get("use_sliding_window", False) and model_type == "qwen2":
        raise ValueError("config.json: use_sliding_window=true is not supported")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json: rope_type {rope_type!r} is not "
                         f"'default' or 'llama3'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json: partial_rotary_factor must be 1")
    scaling = None
    if rope_type == "llama3":
        try:
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position=int(rope["original_max_position_embeddings"]))
        except KeyError as error:
            raise ValueError(f"config.json: rope_scaling has no {error}") from None
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    # a missing key is transformers' Mistral default, `MISTRAL_WINDOW`; an
    # explicit null is no window
    window = hf.get("sliding_window", MISTRAL_WINDOW) if model_type == "mistral" \
        else None
    # `head_dim` as d / n_h is kept unresolved (`None`), as the presets have it
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_h == hf["hidden_size"]:
        head_dim = None
    return LlamaConfig(
        n_vocab=hf["vocab_size"], d_model=hf["hidden_size"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
        n_layers=hf["num_hidden_layers"], d_ff=hf["intermediate_size"],
        head_dim=head_dim, rope_theta=float(theta), rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=hf.get("max_position_embeddings", 2048),
        sliding_window=window, init_std=float(hf.get("initializer_range", 0.02)),
        model_type=model_type, bos_token_id=hf.get("bos_token_id"),
        eos_token_id=(tuple(eos) if isinstance(eos := hf.get("eos_token_id"), list)
                      else eos),
        pad_token_id=hf.get("pad_token_id"))


def to_hf_config(config: LlamaConfig, *, dtype: torch.dtype = torch.float32
                 ) -> dict[str, Any]:
    """
    ### Write a Hugging Face `config.json` (as a dict)

    In the hub's transformers-4 spelling (`rope_theta`, `rope_scaling`), which
    transformers 5 still reads.
    """
    scaling = config.rope_scaling
    hf = {
        "architectures": [FAMILIES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.n_vocab,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "num_hidden_layers": config.n_layers,
        "head_dim": config.head_width,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position},
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position,
        "initializer_range": config.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name)
        if value is not None:
            hf[name] = list(value) if isinstance(value, tuple) else value
    if config.model_type == "mistral":
        hf["sliding_window"] = config.sliding_window
    if config.model_type == "qwen2":
        hf["use_sliding_window"] = False
    return hf
