r"""
---
title: GPT-NeoX configuration
summary: The shape of a GPT-NeoX model as a dataclass, the released shapes as
  preset functions, and the map to and from Hugging Face's config.json.
---

# GPT-NeoX configuration

Everything that fixes the shape of a [GPT-NeoX model](model.html) is one frozen
dataclass, `NeoXConfig`, with a note under each field and a check of each in
`__post_init__`. Its one derived quantity that the model needs everywhere is the
head width and, from it, the number of rotated dimensions of each head:

$$d_h = \frac{d}{n_{\text{heads}}}, \qquad
d_r = \lfloor d_h \cdot \text{rotary\_pct} \rfloor$$

## Limitations

* Only the settings of the released GPT-NeoX models are accepted (and the
  sequential residual, `use_parallel_residual=False`): untied embeddings,
  attention biases, default (unscaled) rotary embeddings; any other value is
  refused with the field's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = [
    "NeoXConfig",
    "from_hf_config",
    "to_hf_config",
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


@dataclass(frozen=True)
class NeoXConfig:
    """
    ## Configuration

    The defaults are a tiny model that runs on a laptop CPU with the real
    tokenizer; the presets below give the released shapes.
    """

    n_vocab: int = 50432
    """Rows of the embedding and the readout. The tokenizer has 50,281
    (tested: tests/neox/test_tokenizer.py::test_vocab_size_fits_every_preset_embedding)
    tokens; the released models pad the matrix to a multiple of 128
    (tested: tests/neox/test_config.py::test_figures_in_the_notes), each preset
    to its checkpoint's size. Ids past the tokenizer are never produced by it."""
    d_model: int = 64
    """Width of the residual stream, $d$."""
    n_heads: int = 4
    r"""Attention heads; the head width is $d_h = d / n_\text{heads}$."""
    n_layers: int = 2
    """Transformer layers."""
    d_ff: int | None = None
    """Width of the MLP's hidden layer; `None` means $4d$ (every released model).
    Kept as `None` rather than resolved, so `dataclasses.replace(c, d_model=...)`
    still gets $4d$ of the new width; read `ff_dim`."""
    rotary_pct: float = 0.25
    r"""Fraction of each head's dimensions that are rotated;
    $d_r = \lfloor d_h \cdot \text{rotary\_pct} \rfloor$ must be even."""
    rotary_base: float = 10000.0
    r"""$b$ in $\theta_i = b^{-2i/d_r}$."""
    layer_norm_eps: float = 1e-5
    r"""$\epsilon$ of every layer norm."""
    gelu_approximate: str = "tanh"
    """`'tanh'` (GPT-NeoX-20B's `gelu_fast`, the tanh approximation) or `'none'`
    (Pythia's exact erf `gelu`); passed to `torch.nn.functional.gelu` (see the
    model's MLP)."""
    use_parallel_residual: bool = True
    """`True` in every released GPT-NeoX and Pythia; `False` is GPT-2's
    sequential residual (see [the model](model.html))."""
    max_position: int = 2048
    """Longest sequence the model was trained on; longer inputs are rejected."""
    init_std: float = 0.02
    """Standard deviation of the normal init of weight matrices (HF's
    `initializer_range`)."""

    def __post_init__(self):
        for name in ("n_vocab", "d_model", "n_heads", "n_layers", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"NeoXConfig.{name} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"NeoXConfig.d_model={self.d_model} is not divisible "
                             f"by n_heads={self.n_heads}")
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"NeoXConfig.d_ff must be >= 1 or None, got {self.d_ff}")
        if not 0.0 <= self.rotary_pct <= 1.0:
            raise ValueError(f"NeoXConfig.rotary_pct must be in [0, 1], "
                             f"got {self.rotary_pct}")
        # `rotate_half` pairs dimension i with i + d_r/2, so d_r must be even.
        if self.rotary_dim % 2 != 0:
            raise ValueError(f"NeoXConfig: rotary dims = int({self.head_dim} * "
                             f"{self.rotary_pct}) = {self.rotary_dim} must be even")
        if self.rotary_base <= 0:
            raise ValueError(f"NeoXConfig.rotary_base must be > 0, "
                             f"got {self.rotary_base}")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"NeoXConfig.layer_norm_eps must be > 0, "
                             f"got {self.layer_norm_eps}")
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"NeoXConfig.gelu_approximate must be 'tanh' or "
                             f"'none', got {self.gelu_approximate!r}")
        if self.init_std <= 0:
            raise ValueError(f"NeoXConfig.init_std must be > 0, got {self.init_std}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        # int() truncation, as HF and the original GPT-NeoX code do.
        return int(self.head_dim * self.rotary_pct)

    @property
    def ff_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff


# ### Presets
#
# The defaults are a tiny model that runs on a laptop CPU with the real
# tokenizer; the released shapes (every Pythia, and GPT-NeoX-20B) are preset
# functions that return a config. Derive variants with `dataclasses.replace`,
# e.g. `replace(pythia_70m(), n_layers=2)`. Shapes from the `config.json` of
# each `EleutherAI/pythia-*` and `EleutherAI/gpt-neox-20b` on the Hugging Face
# hub. Every Pythia has
# `hidden_act: "gelu"` (exact), `rotary_pct=0.25`, `rotary_base=10000` and
# `max_position=2048` (tested: tests/neox/test_config.py::test_figures_in_the_notes).


def tiny() -> NeoXConfig:
    """A laptop model with the real vocabulary: 2 layers of width 64
    (tested: tests/neox/test_config.py::test_figures_in_the_notes)."""
    return NeoXConfig()


def _pythia(*, n_vocab: int, d_model: int, n_heads: int, n_layers: int
            ) -> NeoXConfig:
    return NeoXConfig(n_vocab=n_vocab, d_model=d_model, n_heads=n_heads,
                      n_layers=n_layers, gelu_approximate="none")


def pythia_70m() -> NeoXConfig:
    return _pythia(n_vocab=50304, d_model=512, n_heads=8, n_layers=6)


def pythia_160m() -> NeoXConfig:
    return _pythia(n_vocab=50304, d_model=768, n_heads=12, n_layers=12)


def pythia_410m() -> NeoXConfig:
    return _pythia(n_vocab=50304, d_model=1024, n_heads=16, n_layers=24)


def pythia_1b() -> NeoXConfig:
    return _pythia(n_vocab=50304, d_model=2048, n_heads=8, n_layers=16)


def pythia_1_4b() -> NeoXConfig:
    return _pythia(n_vocab=50304, d_model=2048, n_heads=16, n_layers=24)


def pythia_2_8b() -> NeoXConfig:
    return _pythia(n_vocab=50304, d_model=2560, n_heads=32, n_layers=32)


def pythia_6_9b() -> NeoXConfig:
    return _pythia(n_vocab=50432, d_model=4096, n_heads=32, n_layers=32)


def pythia_12b() -> NeoXConfig:
    return _pythia(n_vocab=50688, d_model=5120, n_heads=40, n_layers=36)


def gpt_neox_20b() -> NeoXConfig:
    # Its config says "gelu_fast": the tanh approximation.
    return NeoXConfig(n_vocab=50432, d_model=6144, n_heads=64, n_layers=44,
                      gelu_approximate="tanh")


# `--model` names to the preset functions; the job and the family read them here.
PRESETS = {"tiny": tiny, "pythia-70m": pythia_70m, "pythia-160m": pythia_160m,
           "pythia-410m": pythia_410m, "pythia-1b": pythia_1b,
           "pythia-1.4b": pythia_1_4b, "pythia-2.8b": pythia_2_8b,
           "pythia-6.9b": pythia_6_9b, "pythia-12b": pythia_12b,
           "gpt-neox-20b": gpt_neox_20b}


# ### Hugging Face `config.json`
#
# `from_hf_config` and `to_hf_config` translate a Hugging Face `config.json`, so
# a checkpoint on the hub maps to a config and back.

# HF activation names -> our `gelu_approximate`. "gelu" is erf-exact; the other
# three are the same tanh formula under different names.
_HF_ACTS = {"gelu": "none", "gelu_fast": "tanh", "gelu_new": "tanh",
            "gelu_pytorch_tanh": "tanh"}


def from_hf_config(hf: Mapping[str, Any]) -> NeoXConfig:
    """
    ### Read a Hugging Face `config.json` (as a dict)

    Handles both spellings of the rotary settings: `rotary_pct`/`rotary_emb_base`
    (the hub's Pythia and GPT-NeoX-20B files, transformers 4) and `rope_parameters`
    (transformers 5).
    """
    if hf.get("model_type", "gpt_neox") != "gpt_neox":
        raise ValueError(f"config.json: model_type {hf['model_type']!r} is not "
                         f"'gpt_neox'")
    act = hf.get("hidden_act", "gelu")
    if act not in _HF_ACTS:
        raise ValueError(f"config.json: hidden_act {act!r} is not one of "
                         f"{sorted(_HF_ACTS)}")
    if hf.get("tie_word_embeddings", False):
        raise ValueError("config.json: tie_word_embeddings=true is not supported")
    if not hf.get("attention_bias", True):
        raise ValueError("config.json: attention_bias=false is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    # transformers 4 spelled the scaling's kind `type`, transformers 5
    # `rope_type`: a scaling in either spelling is refused, not dropped
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported")
    rotary_pct = rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    rotary_base = rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
    d_model = hf["hidden_size"]
    d_ff = hf.get("intermediate_size")
    return NeoXConfig(
        n_vocab=hf["vocab_size"], d_model=d_model,
        n_heads=hf["num_attention_heads"], n_layers=hf["num_hidden_layers"],
        d_ff=None if d_ff in (None, 4 * d_model) else d_ff,
        rotary_pct=float(rotary_pct), rotary_base=float(rotary_base),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        gelu_approximate=_HF_ACTS[act],
        use_parallel_residual=hf.get("use_parallel_residual", True),
        max_position=hf.get("max_position_embeddings", 2048),
        init_std=float(hf.get("initializer_range", 0.02)))


def to_hf_config(config: NeoXConfig, *, dtype: torch.dtype = torch.float32
                 ) -> dict[str, Any]:
    """
    ### Write a Hugging Face `config.json` (as a dict)

    In the hub's transformers-4 spelling, which transformers 5 still reads.
    """
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": config.n_vocab,
        "hidden_size": config.d_model,
        "num_attention_heads": config.n_heads,
        "num_hidden_layers": config.n_layers,
        "intermediate_size": config.ff_dim,
        "rotary_pct": config.rotary_pct,
        "rotary_emb_base": config.rotary_base,
        "layer_norm_eps": config.layer_norm_eps,
        "hidden_act": "gelu_fast" if config.gelu_approximate == "tanh" else "gelu",
        "use_parallel_residual": config.use_parallel_residual,
        "max_position_embeddings": config.max_position,
        "initializer_range": config.init_std,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
