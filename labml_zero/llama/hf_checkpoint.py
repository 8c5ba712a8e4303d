r"""
---
title: Hugging Face Llama checkpoints
summary: Read a Llama, Qwen2 or Mistral snapshot one layer at a time, every
  config field and tensor shape checked before any rank starts; a tied
  checkpoint's readout reads the embedding.
---

# Hugging Face Llama checkpoints

Loading is per layer, as for [GPT-NeoX](../neox/hf_checkpoint.html), whose
safetensors helpers this page reuses: `LlamaCheckpoint.layer_state_dict(layer)`
opens only the files that hold that layer's tensors and reads only those, so
a rank's peak is one layer. What is new is the family's config and its
failures. A `config.json` is an input someone hands the job; the shapes it
implies are

$$W_q: (n_h d_h) \times d, \qquad W_k, W_v: (n_{kv} d_h) \times d,$$

and a wrong `num_key_value_heads` (or none: transformers would quietly take
$n_{kv} = n_h$) yields K and V projections of the wrong size that a loader
without checks would fail on deep inside a rank, or, where the sizes happen to
fit, train on garbage. So `check_llama_snapshot` reads the config and every
safetensors *header* and refuses, in one `CheckpointError` line naming the
file and the field, before any rank starts.

## Limitations

* Safetensors only. Writing a checkpoint is [its own page](hf_export.html).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from labml_zero.llama.config import LlamaConfig, from_hf_config
from labml_zero.llama.model import Readout, build_layers, hf_prefix
from labml_zero.neox.hf_checkpoint import (CONFIG_FILE, INDEX_FILE, SINGLE_FILE,
                                           describe, open_safetensors, read_json)
from labml_zero.zero3.checkpoint import CheckpointError

__all__ = ["llama_config_from_hf", "LlamaCheckpoint", "check_llama_snapshot",
           "hf_name", "load_layers"]

# `config.json` keys that must be integers (the first six must be present),
# and those that must be numbers
REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size",
                 "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
OPTIONAL_INTS = ("head_dim", "max_position_embeddings", "sliding_window")
OPTIONAL_NUMBERS = ("rope_theta", "rms_norm_eps", "initializer_range")

# The tensor-name ending -> the `config.json` fields its shape comes from, so a
# contradicted shape names the field to look at.
SHAPE_FIELDS = {
    "q_proj.weight": "num_attention_heads, head_dim, hidden_size",
    "q_proj.bias": "num_attention_heads, head_dim",
    "k_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "k_proj.bias": "num_key_value_heads, head_dim",
    "v_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "v_proj.bias": "num_key_value_heads, head_dim",
    "o_proj.weight": "num_attention_heads, head_dim, hidden_size",
    "gate_proj.weight": "intermediate_size, hidden_size",
    "up_proj.weight": "intermediate_size, hidden_size",
    "down_proj.weight": "intermediate_size, hidden_size",
    "layernorm.weight": "hidden_size",
    "norm.weight": "hidden_size",
    "embed_tokens.weight": "vocab_size, hidden_size",
    "lm_head.weight": "vocab_size, hidden_size",
}


def llama_config_from_hf(path: str | os.PathLike) -> LlamaConfig:
    """
    ### A checked `LlamaConfig` from a snapshot's `config.json`

    Every key is checked for presence and type first, and `LlamaConfig`'s own
    checks (heads that do not divide, an odd head width) are reported with the
    file's name: one line, never a `KeyError`.
    """
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint config not found: {file}")
    hf = read_json(file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got a "
                              f"{type(hf).__name__}")

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for key in REQUIRED_INTS:
        if key not in hf:
            raise CheckpointError(f"{file}: no {key!r}")
    for key in REQUIRED_INTS + OPTIONAL_INTS:
        if hf.get(key) is not None and not integer(hf[key]):
            raise CheckpointError(f"{file}: {key!r} must be an integer, got "
                                  f"{describe(hf[key])}")
    for key in OPTIONAL_NUMBERS:
        value = hf.get(key)
        if value is not None and not (integer(value) or isinstance(value, float)):
            raise CheckpointError(f"{file}: {key!r} must be a number, got "
                                  f"{describe(value)}")
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise CheckpointError(f"{file}: {key!r} must be an object, got "
                                  f"{describe(hf[key])}")
    try:
        return from_hf_config(hf)
    except (ValueError, TypeError) as error:
        reason = str(error).removeprefix("config.json: ")
        raise CheckpointError(f"{file}: {reason}") from None


def hf_name(layer: nn.Module, name: str) -> str:
    """The checkpoint name of `layer.state_dict()[name]`: `hf_prefix(layer) +
    name`, except a tied readout's, which is the embedding's."""
    if isinstance(layer, Readout) and layer.config.tie_embeddings:
        return "model.embed_tokens.weight"
    return hf_prefix(layer) + name


def check_shape(f, file: Path, name: str, shape: tuple[int, ...]) -> None:
    """One header entry against the shape `config.json` implies; refuses with
    the fields that shape comes from."""
    try:
        sliced = f.get_slice(name)
    except Exception:
        raise CheckpointError(f"{file}: no tensor {name!r}, which the index "
                              "places there") from None
    found = tuple(sliced.get_shape())
    if found != shape:
        fields = next((v for k, v in SHAPE_FIELDS.items() if name.endswith(k)),
                      "the sizes")
        raise CheckpointError(f"{file}: tensor {name!r} has shape {found}, but "
                              f"config.json's {fields} imply {shape}")
    if sliced.get_dtype() not in ("F64", "F32", "F16", "BF16"):
        raise CheckpointError(f"{file}: tensor {name!r} is {sliced.get_dtype()}, "
                              f"not floating point")


class LlamaCheckpoint:
    """
    ## A Hugging Face Llama-family snapshot, read lazily

    Construction reads `config.json` and the index (or the single file's
    header); `layer_state_dict` reads one layer's tensors.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {self.path}")
        self.config_file = self.path / CONFIG_FILE
        self.config = llama_config_from_hf(self.config_file)
        self.weight_map = self.read_weight_map()  # tensor name -> file name

    def read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            value = read_json(index)
            weight_map = value.get("weight_map") if isinstance(value, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: no 'weight_map' object of files")
            return dict(weight_map)
        single = self.path / SINGLE_FILE
        if single.is_file():
            with open_safetensors(single) as f:
                return {name: SINGLE_FILE for name in f.keys()}
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}")

    def files_of(self, wanted: dict[str, tuple[str, tuple[int, ...]]]
                 ) -> dict[Path, list[str]]:
        """Our keys grouped by the file that holds their tensor."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for key, (name, _) in wanted.items():
            if name not in self.weight_map:
                raise CheckpointError(f"checkpoint {self.path} has no tensor "
                                      f"{name!r}, which {self.config_file} implies")
            file = self.path / self.weight_map[name]
            if not file.is_file():
                raise CheckpointError(f"checkpoint shard not found: {file}")
            by_file[file].append(key)
        return by_file

    def layer_state_dict(self, layer: nn.Module, *,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """
        ### Read one layer's tensors

        `{our name: tensor}` on the CPU, each shape checked in the header
        before its data is read; the layer may be on the meta device.
        """
        wanted = {n: (hf_name(layer, n), tuple(t.shape))
                  for n, t in layer.state_dict().items()}
        out = {}
        for file, keys in self.files_of(wanted).items():
            with open_safetensors(file) as f:
                for key in keys:
                    name, shape = wanted[key]
                    check_shape(f, file, name, shape)
                    t = f.get_tensor(name)
                    out[key] = t if dtype is None else t.to(dtype)
        return out


def check_llama_snapshot(path: str | os.PathLike) -> LlamaConfig:
    """
    ### Check a whole snapshot without reading any tensor data

    `config.json` and every header the model needs, against the shapes the
    config implies (the model built on meta); the launcher calls it before any
    rank starts. Returns the config, or raises one `CheckpointError` line.
    """
    checkpoint = LlamaCheckpoint(path)
    wanted = {}
    for layer in build_layers(checkpoint.config, device="meta"):
        for n, t in layer.state_dict().items():
            name = hf_name(layer, n)
            wanted[name] = (name, tuple(t.shape))
    for file, names in checkpoint.files_of(wanted).items():
        with open_safetensors(file) as f:
            for name in names:
                check_shape(f, file, name, wanted[name][1])
    return checkpoint.config


def load_layers(checkpoint: LlamaCheckpoint, layers: list[nn.Module]) -> None:
    """Load every layer, one at a time (an unsharded model: tests, sampling)."""
    for layer in layers:
        layer.load_state_dict(checkpoint.layer_state_dict(layer))
