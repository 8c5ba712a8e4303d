r"""
---
title: Hugging Face Llama checkpoints
summary: Read a Llama, Qwen2 or Mistral snapshot one layer at a time, every
  config field and tensor shape checked before any rank starts; a tied
  checkpoint's readout reads the embedding.
---

# Hugging Face Llama checkpoints

Loading is per layer, by [the safetensors reader](../hf/safetensors_reader.html)
that GPT-NeoX's checkpoints use too, so a rank's peak is one layer. What is new
is the family's config and its failures: a `config.json` is an input someone
hands the job, and the shapes it implies are

$$W_q: (n_h d_h) \times d, \qquad W_k, W_v: (n_{kv} d_h) \times d.$$
"""

from __future__ import annotations

import os

import torch
from torch import nn

from labml_zero.hf.safetensors_reader import (ConfigKeys, SafetensorsSnapshot,
                                              Wanted, load_layers, read_hf_config,
                                              snapshot_directory)
from labml_zero.llama.config import LlamaConfig, from_hf_config
from labml_zero.llama.model import Readout, build_layers, hf_prefix
from labml_zero.zero3.checkpoint import CheckpointError

__all__ = ["llama_config_from_hf", "LlamaCheckpoint", "check_llama_snapshot",
           "hf_name", "load_layers"]

# `config.json` keys that must be integers (all six required ones present),
# and those that must be numbers
CONFIG_KEYS = ConfigKeys(
    required_ints=("vocab_size", "hidden_size", "intermediate_size",
                   "num_attention_heads", "num_key_value_heads",
                   "num_hidden_layers"),
    optional_ints=("head_dim", "max_position_embeddings", "sliding_window"),
    optional_numbers=("rope_theta", "rms_norm_eps", "initializer_range"))

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


def shape_fields(name: str) -> str:
    """The fields a tensor's shape comes from, by the end of its name."""
    return next((v for k, v in SHAPE_FIELDS.items() if name.endswith(k)),
                "sizes")


def llama_config_from_hf(path: str | os.PathLike) -> LlamaConfig:
    """
    ### A checked `LlamaConfig` from a snapshot's `config.json`

    Every key is checked for presence and type first, and `LlamaConfig`'s own
    checks (heads that do not divide, an odd head width) are reported with the
    file's name: one line, never a `KeyError`.
    """
    return read_hf_config(path, CONFIG_KEYS, from_hf_config)


# The input embedding's matrix, which a tied readout reads too.
EMBEDDING = "model.embed_tokens.weight"


def hf_name(layer: nn.Module, name: str) -> str:
    """The checkpoint name of `layer.state_dict()[name]`: `hf_prefix(layer) +
    name`, except a tied readout's, which is the embedding's."""
    if isinstance(layer, Readout) and layer.config.tie_embeddings:
        return EMBEDDING
    return hf_prefix(layer) + name


class LlamaCheckpoint(SafetensorsSnapshot):
    """
    ## A Hugging Face Llama-family snapshot, read lazily

    Safetensors only. Construction reads `config.json` and the index (or the
    single file's header); `layer_state_dict(layer)` opens only the files that
    hold that layer's tensors and reads only those. Writing a checkpoint is
    [its own page](hf_export.html).
    """

    def __init__(self, path: str | os.PathLike):
        self.config = llama_config_from_hf(snapshot_directory(path))
        super().__init__(path)

    def layer_state_dict(self, layer: nn.Module, *,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """
        ### Read one layer's tensors

        `{our name: tensor}` on the CPU, each shape checked in the header
        before its data is read; the layer may be on the meta device.
        """
        return self.read_tensors({n: Wanted(hf_name(layer, n), tuple(t.shape))
                                  for n, t in layer.state_dict().items()},
                                 dtype=dtype, shape_from=shape_fields)


def check_llama_snapshot(path: str | os.PathLike) -> LlamaConfig:
    """
    ### Check a whole snapshot without reading any tensor data

    `config.json` and every header the model needs, against the shapes the
    config implies (the model built on meta); the launcher calls it before any
    rank starts. Returns the config, or raises one `CheckpointError` line
    naming the file and the field. A wrong `num_key_value_heads` (or none:
    transformers would quietly take $n_{kv} = n_h$) yields K and V projections
    of the wrong size that a loader without checks would fail on deep inside
    a rank, or, where the sizes happen to fit, train on garbage.
    """
    checkpoint = LlamaCheckpoint(path)
    # a tied readout's name is the embedding's: one entry for both
    checkpoint.check_tensors({hf_name(layer, n): tuple(t.shape)
                              for layer in build_layers(checkpoint.config,
                                                        device="meta")
                              for n, t in layer.state_dict().items()},
                             shape_from=shape_fields)
    # A tied snapshot that stores a readout of its own as well: transformers
    # would load that one, this job reads the embedding; equal, they agree
    # (`save_pretrained` may write both), different, one of them is not the
    # model the file describes.
    readout = "lm_head.weight"
    if checkpoint.config.tie_embeddings and readout in checkpoint.weight_map \
            and not checkpoint.equal_tensors(readout, EMBEDDING):
        raise CheckpointError(f"checkpoint {checkpoint.path}: config.json ties the "
                              f"readout to the embedding (tie_word_embeddings), but "
                              f"its {readout} differs from {EMBEDDING}: set "
                              f"tie_word_embeddings to false to train the stored "
                              f"readout, or remove it")
    return checkpoint.config
