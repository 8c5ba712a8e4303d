r"""
---
title: Saving Llama checkpoints
summary: Write a Llama, Qwen2 or Mistral model as a Hugging Face checkpoint,
  one tensor at a time, in the weights' own dtype, a tied embedding once, with
  config.json and the tokenizer beside it.
---

# Saving Llama checkpoints

The reverse of [reading a snapshot](hf_checkpoint.html). Tensors stream into
[the shared safetensors writer](../hf/safetensors_writer.html), which holds one
output shard: with at most $B_\text{shard}$ bytes a shard, the host's peak is

$$M \approx \max_p |p| + B_\text{shard},$$

whatever the model's size, and past one shard an index names each tensor's
file, as `save_pretrained` does. The directory appears whole or not at all
(the writer's Note: atomic checkpoint directory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from labml_zero.hf.safetensors_writer import (refuse_existing,
                                              save_safetensors_snapshot)
from labml_zero.llama.config import LlamaConfig, to_hf_config
from labml_zero.llama.model import Readout, hf_prefix
from labml_zero.neox.side_files import hf_side_files
from labml_zero.zero3.checkpoint import CheckpointError

__all__ = ["hf_named_tensors", "save_llama_checkpoint"]


def hf_named_tensors(layers: Iterable[nn.Module]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """
    ### `(hf_name, tensor)` for every tensor, in layer order

    The names are `hf_prefix(layer) + name`. A tied readout yields nothing:
    transformers' `tie_word_embeddings=True` reads `lm_head.weight` from
    `model.embed_tokens.weight`, and a second copy would be $V d$ wasted
    elements (and, after training the two apart, a silent disagreement).
    """
    for layer in layers:
        if isinstance(layer, Readout) and layer.config.tie_embeddings:
            continue
        prefix = hf_prefix(layer)
        for name, t in layer.state_dict().items():
            yield prefix + name, t


def save_llama_checkpoint(out_dir: str | os.PathLike, config: LlamaConfig,
                          named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                          tokenizer: str | os.PathLike | None = None,
                          snapshot: str | os.PathLike | None = None,
                          dtype: torch.dtype | None = None,
                          max_shard_bytes: int = 2 * 1024**3,
                          overwrite: bool = False) -> Path:
    """
    ### Write a Hugging Face checkpoint of the family, atomically

    * `named_tensors` yields `(hf_name, tensor)`: `hf_named_tensors(layers)`,
      or a generator that gathers a sharded model one layer at a time (with
      LoRA's adapters folded in by `merged`). It is consumed once.
    * `tokenizer`: the `tokenizer.json` to ship; `snapshot`: the directory the
      model came from, whose side files are copied. Without `tokenizer` no
      tokenizer is written (weights only). The snapshot's own
      `tokenizer_config.json` and `generation_config.json` are copied as they
      are ([side files](../neox/side_files.html)), `tokenizer.json` from the
      file the job encoded with.
    * `dtype` casts every tensor; `None` keeps each one's own. `config.json`
      comes from [the family's config writer](config.html), with the
      `torch_dtype` of the tensors written, so a bf16 model stays bf16.

    Every input is checked before a byte is written: the destination is new
    or `overwrite` is given, and the tokenizer loads (else one
    `CheckpointError` line naming it). Returns the directory.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    refuse_existing(out_dir, overwrite=overwrite)  # before loading the tokenizer
    try:
        side = hf_side_files(tokenizer, snapshot) if tokenizer is not None else {}
    except Exception as error:  # tokenizers raises a bare `Exception`
        raise CheckpointError(f"tokenizer {tokenizer} does not load: "
                              f"{str(error).splitlines()[0]}") from None
    return save_safetensors_snapshot(
        out_dir, named_tensors,
        hf_config=lambda written: to_hf_config(config, dtype=written),
        max_shard_bytes=max_shard_bytes, dtype=dtype, overwrite=overwrite,
        extra_files=side)
