r"""
---
title: Hugging Face GPT-NeoX checkpoints
summary: Stream GPT-NeoX / Pythia safetensors into our layers one layer at a time,
  with every shape checked, and export sharded safetensors atomically.
---

# Hugging Face GPT-NeoX checkpoints

GPT-NeoX-20B in fp16 is
{{py: 2 * neox_model.count_parameters(neox_model.build_layers(
    neox_model.gpt_neox_20b(), device='meta')) / 1e9 | .0f}}
GB; a ZeRO-3 rank should never hold all of it. So loading is **per layer**,
by [the safetensors reader](../hf/safetensors_reader.html) every family
shares, and writing streams through [its writer](../hf/safetensors_writer.html).
This page adds GPT-NeoX's own: the `config.json` keys its config reads, the
name of each of our tensors, `hf_prefix(layer) + name` ([the
model](model.html)), and EleutherAI's original two-partition files of
GPT-NeoX-20B. Not the engine's [sharded
checkpoints](../zero3/checkpoint/index.html), which resume a run.

## Limitations

* `.bin` (pickle) checkpoints are not read; safetensors only.
* Tied input/output embeddings are not supported (no released GPT-NeoX ties them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

# The layout's names and the reader's helpers, re-exported where they were
# first defined.
from labml_zero.hf.safetensors_reader import (  # noqa: F401
    ConfigKeys,
    SafetensorsSnapshot,
    Wanted,
    describe,
    load_layers,
    open_safetensors,
    read_hf_config,
    read_json,
    snapshot_directory,
)
from labml_zero.hf.safetensors_writer import save_safetensors_snapshot
from labml_zero.hf.snapshot_layout import (  # noqa: F401
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
)
from labml_zero.neox.model import (Embedding, FinalNorm, NeoXConfig, Readout,
                                   TransformerLayer, build_layers, from_hf_config,
                                   gpt_neox_20b, hf_prefix, to_hf_config)

__all__ = ["HFCheckpoint", "NeoX20BCheckpoint", "check_hf_snapshot",
           "config_from_hf", "save_hf_checkpoint", "hf_named_tensors",
           "load_layers"]

# The `config.json` keys `from_hf_config` reads, by the type each must be.
CONFIG_KEYS = ConfigKeys(
    required_ints=("vocab_size", "hidden_size", "num_attention_heads",
                   "num_hidden_layers"),
    optional_ints=("intermediate_size", "max_position_embeddings"),
    optional_numbers=("rotary_pct", "rotary_emb_base", "layer_norm_eps",
                      "initializer_range"))


def config_from_hf(path: str | os.PathLike) -> NeoXConfig:
    """
    ### A checked `NeoXConfig` from a snapshot's `config.json`

    `path` is the snapshot directory or the file itself. Every key
    `from_hf_config` reads is checked for its type first, so a bad file gives
    one `CheckpointError` naming it, never a `KeyError` or a `TypeError`.
    """
    return read_hf_config(path, CONFIG_KEYS, from_hf_config)


class HFCheckpoint(SafetensorsSnapshot):
    """
    ## A Hugging Face GPT-NeoX checkpoint directory, read lazily

    Construction reads only `config.json` and the index (or the header of the
    single file); tensors are read by `layer_state_dict`.
    """

    def __init__(self, path: str | os.PathLike):
        # the config first: a directory without one is refused by its name
        self.config: NeoXConfig = config_from_hf(snapshot_directory(path))
        super().__init__(path)

    def layer_state_dict(self, layer: nn.Module, *,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """
        ### Read one layer's tensors

        Returns `{our_name: tensor}` (CPU; cast to `dtype` if given) for every
        entry of `layer.state_dict()`, ready for `layer.load_state_dict`. The
        layer may be on the meta device: only its names and shapes are used.
        Old checkpoints also store buffers (`attention.bias`,
        `attention.masked_bias`, `attention.rotary_emb.inv_freq`); we ask only
        for the names our layers have, so these are never read.
        """
        prefix = hf_prefix(layer)
        return self.read_tensors({name: Wanted(prefix + name, tuple(t.shape))
                                  for name, t in layer.state_dict().items()},
                                 dtype=dtype)


class NeoX20BCheckpoint:
    r"""
    ## The original two-partition GPT-NeoX-20B files

    EleutherAI first released GPT-NeoX-20B as DeepSpeed pipeline files
    `layer_XX-model_0P-model_states.pt`: `XX` is the pipeline position (`00` the
    embedding, `i + 2` transformer layer $i$, `n + 3` the final norm, `n + 4` the
    readout) and `P` one of the two tensor-parallel partitions. This class, with
    `HFCheckpoint`'s interface, merges the two per layer, the same way as labml-nn
    and EleutherAI's HF conversion:

    * column-parallel weights and biases (QKV, `dense_h_to_4h`, embeddings,
      readout) are split along the output dim: concatenate on dim 0. Partition 0
      holds heads $0 \ldots n_h/2 - 1$ in the same head-major layout, so the
      concatenation is HF's QKV layout;
    * row-parallel weights (`attention.dense`, `dense_4h_to_h`) are split along
      the input dim: concatenate on dim 1;
    * row-parallel biases are **summed**: with the parallel residual, GPT-NeoX
      adds each partition's bias before the all-reduce that sums the partitions,
      so the effective bias is the sum of the two stored ones;
    * layer norms are replicated; the two copies drift apart by rounding during
      training, so they are averaged.

    Each file is read with `torch.load(mmap=True)`; its shapes are checked after
    the merge, not before the read (`.pt` files have no separate header).
    """

    # our name -> (name in the .pt file, how the two partitions merge)
    LAYER_NAMES = {
        "input_layernorm.weight": ("input_layernorm.weight", "mean"),
        "input_layernorm.bias": ("input_layernorm.bias", "mean"),
        "post_attention_layernorm.weight": ("post_attention_layernorm.weight",
                                            "mean"),
        "post_attention_layernorm.bias": ("post_attention_layernorm.bias", "mean"),
        "attention.query_key_value.weight": ("attention.query_key_value.weight",
                                             "cat0"),
        "attention.query_key_value.bias": ("attention.query_key_value.bias",
                                           "cat0"),
        "attention.dense.weight": ("attention.dense.weight", "cat1"),
        "attention.dense.bias": ("attention.dense.bias", "sum"),
        "mlp.dense_h_to_4h.weight": ("mlp.dense_h_to_4h.weight", "cat0"),
        "mlp.dense_h_to_4h.bias": ("mlp.dense_h_to_4h.bias", "cat0"),
        "mlp.dense_4h_to_h.weight": ("mlp.dense_4h_to_h.weight", "cat1"),
        "mlp.dense_4h_to_h.bias": ("mlp.dense_4h_to_h.bias", "sum"),
    }
    OTHER_NAMES = {
        "embed_in.weight": ("word_embeddings.weight", "cat0"),
        "final_layer_norm.weight": ("norm.weight", "mean"),
        "final_layer_norm.bias": ("norm.bias", "mean"),
        "embed_out.weight": ("final_linear.weight", "cat0"),
    }

    def __init__(self, path: str | os.PathLike, *,
                 config: NeoXConfig | None = None, n_partitions: int = 2):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {self.path}")
        self.config = config or gpt_neox_20b()
        self.n_partitions = n_partitions

    def _position(self, layer: nn.Module) -> int:
        """Pipeline position `XX` of a layer in the file names."""
        n = self.config.n_layers
        if isinstance(layer, Embedding):
            return 0
        if isinstance(layer, TransformerLayer):
            return layer.layer_idx + 2
        if isinstance(layer, FinalNorm):
            return n + 3
        if isinstance(layer, Readout):
            return n + 4
        raise ValueError(f"{type(layer).__name__} is not a GPT-NeoX layer")

    def layer_state_dict(self, layer: nn.Module, *,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """### Read both partitions of one layer and merge them"""
        position = self._position(layer)
        parts = []
        for p in range(self.n_partitions):
            file_path = (self.path
                         / f"layer_{position:02d}-model_{p:02d}-model_states.pt")
            if not file_path.is_file():
                raise FileNotFoundError(f"checkpoint shard not found: {file_path}")
            # mmap: only the tensors touched below are paged in.
            parts.append(torch.load(file_path, map_location="cpu", mmap=True,
                                    weights_only=True))
        names = (self.LAYER_NAMES if isinstance(layer, TransformerLayer)
                 else self.OTHER_NAMES)
        out = {}
        for name, expected in layer.state_dict().items():
            file_name, how = names[name]
            if file_name not in parts[0]:
                raise ValueError(f"checkpoint {self.path} layer {position:02d} has "
                                 f"no tensor '{file_name}'")
            ts = [part[file_name] for part in parts]
            match how:
                case "cat0":
                    t = torch.cat(ts, dim=0)
                case "cat1":
                    t = torch.cat(ts, dim=1)
                case "sum":
                    t = torch.stack(ts).sum(dim=0)
                case _:  # "mean"
                    t = torch.stack(ts).mean(dim=0)
            if tuple(t.shape) != tuple(expected.shape):
                raise ValueError(f"tensor '{file_name}' of layer {position:02d} "
                                 f"merges to shape {tuple(t.shape)}, the model "
                                 f"expects {tuple(expected.shape)}")
            out[name] = t if dtype is None else t.to(dtype)
        return out


def check_hf_snapshot(path: str | os.PathLike) -> NeoXConfig:
    """
    ### Check a whole snapshot without reading any tensor data

    #### Note: checking a snapshot before any rank starts

    A snapshot is an input someone hands the job, and a bad one should cost one
    line, not a traceback after the ranks started. This reads `config.json` and
    every safetensors *header* (no tensor data) and compares each tensor the model
    needs with the shape `config.json` implies, so the launcher can call it first.
    `HFCheckpoint` runs the same `config.json` and index checks when it is built.

    Returns the snapshot's `NeoXConfig`; raises a one-line `CheckpointError`
    naming the file otherwise, for

    * a `config.json` that is not a JSON object, lacks a size, or has a size
      that is not an integer (`"hidden_size": "64"`), or that the model cannot
      be (an odd rotary width, say: `NeoXConfig`'s own checks);
    * an index without a `weight_map`, or one that maps a tensor to a missing
      file;
    * a file that is not safetensors (a garbled header, an HTML error page);
    * a tensor that is missing, not floating point, or of another shape.

    Needs no process group and no device: the model is built on the meta
    device for its shapes only.
    """
    checkpoint = HFCheckpoint(path)
    # hf_name -> shape, for every tensor of every layer of the full model
    checkpoint.check_tensors({hf_prefix(layer) + name: tuple(t.shape)
                              for layer in build_layers(checkpoint.config,
                                                        device="meta")
                              for name, t in layer.state_dict().items()})
    return checkpoint.config


def hf_named_tensors(layers: Iterable[nn.Module]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` for every tensor of the layers, in layer order."""
    for layer in layers:
        prefix = hf_prefix(layer)
        for name, t in layer.state_dict().items():
            yield prefix + name, t


# ## Export


def save_hf_checkpoint(out_dir: str | os.PathLike, config: NeoXConfig,
                       named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       max_shard_bytes: int = 2 * 1024**3,
                       dtype: torch.dtype | None = None,
                       overwrite: bool = False,
                       extra_files: dict[str, str] | None = None) -> Path:
    """
    ### Write a sharded Hugging Face checkpoint atomically

    The same layout, from an iterable of `(hf_name, tensor)`:
    `hf_named_tensors(layers)`, or a generator that gathers a ZeRO model one
    layer at a time; [the shared writer](../hf/safetensors_writer.html) holds
    at most one shard in memory and renames the directory into place whole.
    `config.json` is `to_hf_config(config)` with the dtype written;
    `extra_files` (`{name: text}`) go in beside the weights, inside the same
    rename (the tokenizer, the LoRA export's marker). The other options are
    `save_safetensors_snapshot`'s. Returns the checkpoint directory.
    """
    return save_safetensors_snapshot(
        out_dir, named_tensors,
        hf_config=lambda written: to_hf_config(config, dtype=written),
        max_shard_bytes=max_shard_bytes, dtype=dtype, overwrite=overwrite,
        extra_files=extra_files)
