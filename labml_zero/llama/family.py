r"""
---
title: The Llama family as one object
summary: Everything the job asks of a model family (presets, config.json, build
  on meta, checkpoint checks and loading, tokenizer, FLOPs, activations) as
  one frozen object, so the job never imports a model package.
---

# The Llama family as one object

The fine-tune job should ask a family, not import it (torchtitan's
ModelSpec): one frozen object names its presets, how to read and check a
snapshot, how to build the layers on the meta device and give them weights,
how to load a layer from a checkpoint, its tokenizer, and its cost,
$C$ FLOPs a token ([the FLOPs page](flops.html)) and the bytes a layer keeps.
[`ModelFamily`](../family.html) holds functions, not a base class to
override; `LLAMA` is this package's one instance. The job, given a `--model` path, would

1. call `check_snapshot(path)` before any rank starts (one-line refusals);
2. on each rank, `build(config, device='meta')`, then `materialize(layers,
   device)` or, per layer, `load_layer(checkpoint, layer)` into the shards;
3. read `tokenizer(path, config)` for its data;
4. size its batch with `activation_bytes` and report MFU with
   `flops_per_token`;
5. pick its fine-tuner, `finetuner('lora', rank=..., targets=...)` (any of
   `lora_targets`) or `finetuner('all')`, and call it on the layers before
   sharding;
6. at the end, write `save_hf` (LoRA's adapters folded in by `save_merged`)
   or `save_adapter` for PEFT ([saving](hf_export.html), [LoRA](lora.html)).

## Limitations

* A tied model must be sharded with `shard_model`, which keeps the tied
  matrix in its root unit; `zero3_layers` refuses a parameter of two layers.
* Two fine-tuners, `all` and `lora`; GPT-NeoX's `biases` and `ffn` name
  GPT-NeoX's modules and are not offered here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from labml_zero.family import ModelFamily
from labml_zero.llama import config as llama_config
from labml_zero.llama.flops import activation_bytes, flops_per_token
from labml_zero.llama.hf_checkpoint import LlamaCheckpoint, check_llama_snapshot
from labml_zero.llama.hf_export import hf_named_tensors, save_llama_checkpoint
from labml_zero.llama.lora import (TARGETS, LlamaLoRA, base_layer,
                                   save_llama_adapter, save_merged_llama)
from labml_zero.llama.model import build_layers, count_parameters, tie_embeddings
from labml_zero.llama.tokenizer import checkpoint_tokenizer
from labml_zero.neox.finetuners import FineTuneAll
from labml_zero.neox.lora import LoRALinear

__all__ = ["ModelFamily", "LLAMA", "materialize", "finetuner"]


def materialize(layers: list[nn.Module], device: torch.device | str) -> None:
    """
    ### Meta-built layers to `device`, initialised, tied again

    `to_empty` gives each layer new storage, so a readout tied to the
    embedding would get a matrix of its own; re-tie, then initialise (see
    Note: a tied embedding in the chunk layout), LoRA's adapters included.
    """
    for layer in layers:
        layer.to_empty(device=device)
    config = layers[0].config
    if config.tie_embeddings:
        tie_embeddings(layers)
    for layer in layers:
        layer.reset_parameters()
        # LoRA's adapters, added on meta, came back as uninitialised memory
        # that the layer's own init does not touch: PEFT's init, B = 0.
        for module in layer.modules():
            if isinstance(module, LoRALinear):
                module.reset_adapter()


def load_layer(checkpoint: LlamaCheckpoint, layer: nn.Module, *,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One layer's `{name: tensor}` from the snapshot, shapes checked; a layer
    with LoRA's adapters gets its base tensors (the adapters keep their
    initialisation: `load_state_dict(..., strict=False)`)."""
    return checkpoint.layer_state_dict(base_layer(layer), dtype=dtype)


# The fine-tuners by name; `lora` takes `LlamaLoRA`'s fields as options.
FINETUNERS: dict[str, Callable[..., Any]] = {"all": FineTuneAll, "lora": LlamaLoRA}


def finetuner(name: str, **options: Any) -> Any:
    """
    ### The fine-tuner called `name`

    Refuses an unknown name, and options given to `all`, in one line, so a
    misspelt flag never trains something else.
    """
    if name not in FINETUNERS:
        raise ValueError(f"unknown fine-tuner {name!r} for the Llama family; "
                         f"expected one of {', '.join(FINETUNERS)}")
    if options and name != "lora":
        raise ValueError(f"fine-tuner {name!r} takes no options, got "
                         f"{', '.join(sorted(options))}")
    return FINETUNERS[name](**options)


LLAMA = ModelFamily(
    name="llama", model_types=tuple(llama_config.FAMILIES),
    presets=llama_config.PRESETS, read_config=llama_config.from_hf_config,
    write_config=llama_config.to_hf_config, check_snapshot=check_llama_snapshot,
    open_checkpoint=LlamaCheckpoint, build=build_layers, materialize=materialize,
    load_layer=load_layer, tokenizer=checkpoint_tokenizer,
    count_parameters=count_parameters, flops_per_token=flops_per_token,
    activation_bytes=activation_bytes, finetuner=finetuner,
    lora_targets=tuple(TARGETS), named_tensors=hf_named_tensors,
    save_hf=save_llama_checkpoint, save_merged=save_merged_llama,
    save_adapter=save_llama_adapter)
"""Llama 3, Qwen2.5, Mistral and SmolLM2."""
