r"""
---
title: The Llama family as one object
summary: Everything the job asks of a model family (presets, config.json, build
  on meta, checkpoint checks and loading, tokenizer, FLOPs, activations) as
  one frozen object, so the job never imports a model package.
---

# The Llama family as one object

The fine-tune job asks a family, never imports it (torchtitan's
ModelSpec): one frozen object names its presets, how to read and check a
snapshot, how to build the layers on the meta device and give them weights,
its tokenizer, its cost ($C$ FLOPs a token, [the FLOPs page](flops.html))
and the job's sharded build and exports.
[`ModelFamily`](../family.html) holds functions, not a base class to
override; `LLAMA` is this package's one instance, at the bottom of the page.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable, Iterator

import torch
from tokenizers import Tokenizer
from torch import nn

from labml_zero.assembly import Assembled, Recipe, assemble as assemble_layers
from labml_zero.family import HF_EXPORT, ModelFamily, TrainingBuild
from labml_zero.files import fsync_path
from labml_zero.llama import config as llama_config
from labml_zero.llama import flops as llama_flops
from labml_zero.llama.activation_memory import activation_memory
from labml_zero.llama.finetuners import FINETUNERS, finetuner
from labml_zero.llama.flops import flops_per_token
from labml_zero.llama.hf_checkpoint import (LlamaCheckpoint, check_llama_snapshot,
                                            llama_config_from_hf)
from labml_zero.llama.hf_export import hf_named_tensors, save_llama_checkpoint
from labml_zero.llama.lora import (TARGETS, LlamaLoRA, base_layer,
                                   save_llama_adapter)
from labml_zero.llama.model import (DecoderLayer, build_layers, count_parameters,
                                    hf_prefix, tie_embeddings)
from labml_zero.llama.tokenizer import TOKENIZER_FILE, checkpoint_tokenizer
from labml_zero.neox.generate import Sampling, generate
from labml_zero.layers import kernel_traffic
from labml_zero.layers.float8 import check_fp8, fp8_shapes
from labml_zero.llama.kernels import resolve_llama_kernels
from labml_zero.layers.lora import load_base_weights, reset_adapters
from labml_zero.hf.export_destination import (check_export_destination,
                                              export_bytes, marker_text)
from labml_zero.hf.peft_adapter import export_blocks_adapter, hf_names, merged
from labml_zero.hf.snapshot_layout import EXPORT_MARKER
from labml_zero.neox.side_files import snapshot_dtype
from labml_zero.neox.tokenizer import (BUNDLED_TOKENIZER, end_of_text_id,
                                       load_tokenizer, vocab_size)
from labml_zero.zero3.checkpoint import CheckpointError, export_full_state_dict

__all__ = ["ModelFamily", "LLAMA", "materialize", "finetuner", "assemble",
           "init_parameter", "export_hf", "export_adapter"]


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
        # LoRA's adapters, added on meta: PEFT's init, B = 0
        reset_adapters(layer)


def load_layer(checkpoint: LlamaCheckpoint, layer: nn.Module, *,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One layer's `{name: tensor}` from the snapshot, shapes checked; a layer
    with LoRA's adapters gets its base tensors (the adapters keep their
    initialisation: `load_state_dict(..., strict=False)`)."""
    return checkpoint.layer_state_dict(base_layer(layer), dtype=dtype)


def fp8_linears(config: llama_config.LlamaConfig, kernels) -> tuple[tuple[int, int], ...]:
    """Of the decoder layer's products ([the FLOPs page](flops.html),
    `layer_linears`), those `kernels` run in fp8."""
    return fp8_shapes(llama_flops.layer_linears(config), kernels)


def matmul_parameters(config: llama_config.LlamaConfig, finetune: str | None = None
                      ) -> int:
    """$N$ of [the FLOPs page](flops.html) (`matmul_parameters`); `all`
    trains every product, `lora` none of their weights."""
    return llama_flops.matmul_parameters(config) if finetune in (None, "all") else 0


# ## What the fine-tune job asks


def assemble(build: TrainingBuild, recipe: Recipe, *, device: torch.device,
             init_param=None, load=None, probe=None) -> Assembled:
    """
    ### The sharded model: built on meta, then assembled

    As GPT-NeoX's [build](../neox/build.html): the job's `--kernels` resolved
    for the device ([the family's kernels](kernels.html): `auto` is every
    fusion on CUDA, none elsewhere); with `compile`, each decoder layer's
    forward is compiled.
    """
    kernels = resolve_llama_kernels(build.kernels, device)
    check_fp8(kernels, device)
    layers = build_layers(build.model, filter_layers=build.filter_layers,
                          device="meta", kernels=kernels)
    compiled = (DecoderLayer,) if build.compile else ()
    return assemble_layers(layers, dataclasses.replace(recipe, compile_types=compiled),
                           device=device, init_param=init_param, load=load,
                           probe=probe)


def init_parameter(config: llama_config.LlamaConfig
                   ) -> Callable[[str, torch.Tensor], None]:
    r"""
    ### Hugging Face's initialisation, one parameter at a time

    RMSNorm weights 1 (`input_layernorm`, `post_attention_layernorm`, the
    final `norm`), biases 0, every other weight $\mathcal{N}(0, \sigma^2)$ with
    $\sigma$ `init_std`: the distributions of the model's `init_like_hf`,
    drawn in chunk order.
    """

    def init(name: str, param: torch.Tensor) -> None:
        if name.endswith(".bias"):
            param.zero_()
        elif name.endswith("layernorm.weight") or name == "norm.weight":
            param.fill_(1.0)
        else:
            param.normal_(0.0, config.init_std)

    return init


def load_sharded(checkpoint: LlamaCheckpoint, layer) -> None:
    """
    ### A sharded layer's base weights from the snapshot

    `layer` is a `Zero3Layer`; each rank copies only its slices. LoRA's
    adapters are in no checkpoint: they keep `init_param`'s values, so the
    model at step 0 is the snapshot's.
    """
    # [one layer] on the host, shapes checked before any tensor is read
    load_base_weights(layer, checkpoint.layer_state_dict(base_layer(layer.module)))


def tokenizer_file(path: str | os.PathLike | None) -> Path:
    """The snapshot's `tokenizer.json`; random weights (no snapshot) take the
    bundled GPT-NeoX one, as any tokenizer that fits the embedding would do."""
    return BUNDLED_TOKENIZER if path is None else Path(path) / TOKENIZER_FILE


def tokenizer(path: str | os.PathLike | None, config: llama_config.LlamaConfig
              ) -> tuple[Tokenizer, int]:
    """`checkpoint_tokenizer`, or for random weights the bundled one, refused in
    one line where it has more ids than the embedding has rows."""
    if path is not None:
        return checkpoint_tokenizer(path, config)
    loaded = load_tokenizer()
    if vocab_size(loaded) > config.n_vocab:
        raise CheckpointError(f"{BUNDLED_TOKENIZER}: {vocab_size(loaded)} ids, "
                              f"more than the model's vocab_size="
                              f"{config.n_vocab}; give --checkpoint")
    return loaded, end_of_text_id(loaded)


def save_hf(out_dir: str | os.PathLike, config: llama_config.LlamaConfig,
            named_tensors, *, marker: str | None = None, **options) -> Path:
    """`save_llama_checkpoint`, then an export's `marker` (its kind), which
    lets a later export of that kind replace the directory. The marker is
    written just after the checkpoint's rename: a crash between the two leaves
    a directory a later export refuses to replace."""
    path = save_llama_checkpoint(out_dir, config, named_tensors, **options)
    if marker is not None:
        (path / EXPORT_MARKER).write_text(marker_text(marker))
        fsync_path(path / EXPORT_MARKER)
    return path


def save_merged(out_dir: str | os.PathLike, config: llama_config.LlamaConfig,
                tensors, lora: LlamaLoRA, **options) -> Path:
    r"""$W' = W + \frac{\alpha}{r} B A$ (`merged`), then `save_hf`."""
    return save_hf(out_dir, config, merged(tensors, lora, dtype=options.get("dtype")),
                   **options)


def export_hf(out_dir: str | os.PathLike, model, lora: LlamaLoRA | None,
              config: llama_config.LlamaConfig, optimizer=None, *,
              dtype: torch.dtype | None = None, overwrite: bool = False,
              tokenizer: str | os.PathLike | None = None,
              snapshot: str | os.PathLike | None = None) -> Path | None:
    r"""
    ### The sharded model as a Hugging Face checkpoint, adapters merged

    Every rank calls it; the tensors come to the one writer (rank 0 of the
    first shard group) one chunk at a time, from the fp32 masters when
    `optimizer` is given, each adapted $W$ folded into
    $W + \frac{\alpha}{r} B A$ by `merged`, and `save_llama_checkpoint`
    writes them; the writer returns the directory, the others `None`.
    """
    def write(tensors: Iterator[tuple[str, torch.Tensor]]) -> Path:
        if overwrite:  # again at the end: the directory may have changed since
            check_export_destination(out_dir, HF_EXPORT, flag="export",
                                     protected={})
        whole = merged(tensors, lora, dtype=dtype) if lora is not None else tensors
        return save_hf(out_dir, config, whole, tokenizer=tokenizer,
                       snapshot=snapshot, dtype=dtype, overwrite=overwrite,
                       marker=HF_EXPORT)

    return export_full_state_dict(write, model, optimizer, rename=hf_names(model, hf_prefix))


def export_adapter(out_dir: str | os.PathLike, model, lora: LlamaLoRA,
                   optimizer=None, *, base_model_name_or_path: str | None = None,
                   overwrite: bool = False) -> Path | None:
    """
    ### The sharded model's adapters, in PEFT's format

    Every rank calls it: [the shared export](../hf/peft_adapter.html) of its
    decoder layers' adapters, under PEFT's keys for `LlamaForCausalLM`.
    """
    return export_blocks_adapter(out_dir, model, lora, optimizer,
                                 hf_prefix=hf_prefix,
                                 base_model_name_or_path=base_model_name_or_path,
                                 overwrite=overwrite)


LLAMA = ModelFamily(
    name="llama", model_types=tuple(llama_config.FAMILIES),
    config_type=llama_config.LlamaConfig,
    presets=llama_config.PRESETS, read_config=llama_config.from_hf_config,
    write_config=llama_config.to_hf_config, check_snapshot=check_llama_snapshot,
    open_checkpoint=LlamaCheckpoint, build=build_layers, materialize=materialize,
    load_layer=load_layer, tokenizer=tokenizer,
    count_parameters=count_parameters, flops_per_token=flops_per_token,
    matmul_parameters=matmul_parameters,
    layer_linears=llama_flops.layer_linears, fp8_linears=fp8_linears,
    activation_memory=activation_memory,
    unfused_bytes=functools.partial(kernel_traffic.unfused_bytes, build_layers),
    finetuner=finetuner,
    lora_targets=tuple(TARGETS), named_tensors=hf_named_tensors,
    save_hf=save_hf, save_merged=save_merged,
    save_adapter=save_llama_adapter, title="Llama", experiment="zero3_llama",
    snapshot_config=llama_config_from_hf, finetuners=tuple(FINETUNERS),
    resolve_kernels=resolve_llama_kernels, assemble=assemble,
    init_parameter=init_parameter, load_sharded=load_sharded, hf_prefix=hf_prefix,
    tokenizer_file=tokenizer_file, snapshot_dtype=snapshot_dtype,
    export_hf=export_hf, export_adapter=export_adapter,
    check_export_destination=check_export_destination, export_bytes=export_bytes,
    generate=generate, sampling=Sampling)
"""Llama 3, Qwen2.5, Mistral and SmolLM2. What differs from GPT-NeoX's: its
own [fused kernels](kernels.html), the snapshot's tokenizer
([its page](tokenizer.html); random weights take the bundled GPT-NeoX one),
and the exports' writers ([saving](hf_export.html), [LoRA](lora.html))."""
