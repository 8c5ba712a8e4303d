r"""
---
title: The GPT-NeoX family as one object
summary: GPT-NeoX's presets, config.json, build, checkpoints, fine-tuners,
  LoRA's targets, FLOPs, activation bytes and tokenizer as one ModelFamily.
---

# The GPT-NeoX family as one object

`NEOX` is this package's [`ModelFamily`](../family.html): the functions the
other pages of the package define, each adapted to the family's signature
where it differs. Its cost is PaLM's count,

$$C = 6\,\Psi_m + 12\, L\, d\, T$$
(tested: tests/neox/test_family.py::test_flops_are_the_jobs_palm_count)

with $\Psi_m$ every parameter but the embedding (the readout is a product,
the embedding a lookup), the job's MFU figure for a whole model.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tokenizers import Tokenizer
from torch import nn

from labml_zero.assembly import Assembled, Recipe
from labml_zero.family import ModelFamily, TrainingBuild
from labml_zero.hf.peft_adapter import save_layers_adapter
from labml_zero.layers import kernel_traffic
from labml_zero.layers.float8 import fp8_shapes
from labml_zero.layers.lora import reset_adapters
from labml_zero.neox import build as neox_build
from labml_zero.neox import config as neox_config
from labml_zero.neox.activation_memory import activation_bytes
from labml_zero.neox.finetuners import FINETUNERS, finetuner
from labml_zero.neox.generate import Sampling, generate
from labml_zero.neox.hf_checkpoint import (HFCheckpoint, check_hf_snapshot,
                                           config_from_hf, hf_named_tensors,
                                           save_hf_checkpoint)
from labml_zero.neox.lora import TARGETS, FineTuneLoRA, base_layer, load_hf_layer
from labml_zero.neox.lora_export import (EXPORT_MARKER, check_export_destination,
                                         export_bytes, marker_text, merged,
                                         save_merged_checkpoint,
                                         save_peft_adapter)
from labml_zero.neox.model import (build_layers, count_parameters, hf_prefix,
                                   init_parameter)
from labml_zero.neox.side_files import hf_side_files, snapshot_dtype
from labml_zero.neox.tokenizer import (end_of_text_id, job_tokenizer_path,
                                       load_tokenizer)
from labml_zero.zero3.checkpoint.export import writes_export

__all__ = ["NEOX", "flops_per_token", "matmul_parameters", "materialize",
           "assemble", "export_hf"]


def materialize(layers: list[nn.Module], device: torch.device | str) -> None:
    """
    ### Meta-built layers to `device`, initialised

    As Hugging Face initialises GPT-NeoX; LoRA's adapters, added on meta,
    get their own init ($B = 0$), which the layer's does not touch.
    """
    for layer in layers:
        layer.to_empty(device=device)
        layer.reset_parameters()
        reset_adapters(layer)


def load_layer(checkpoint: HFCheckpoint, layer: nn.Module, *,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One layer's `{name: tensor}`, shapes checked; a layer with adapters gets
    its base tensors (load with `strict=False`)."""
    return checkpoint.layer_state_dict(base_layer(layer), dtype=dtype)


def tokenizer(path: str | os.PathLike | None, config: neox_config.NeoXConfig
              ) -> tuple[Tokenizer, int]:
    """The snapshot's own `tokenizer.json`, else the bundled GPT-NeoX-20B one,
    and its end-of-text id."""
    loaded = load_tokenizer(job_tokenizer_path(path))
    return loaded, end_of_text_id(loaded)


@functools.lru_cache(maxsize=64)
def meta_parameter_count(config: neox_config.NeoXConfig) -> int:
    r"""$\Psi_m$, counted on the meta device; kept per shape (a config is frozen),
    as the planner asks for it once per setting it weighs and building every
    layer of a large model, even on meta, runs each layer's constructor."""
    return count_parameters(build_layers(config, device="meta"))


def flops_per_token(config: neox_config.NeoXConfig, seq: int) -> float:
    r"""$C$ of the introduction; $\Psi_m$ counted on the meta device."""
    psi = meta_parameter_count(config)
    matmul = psi - config.n_vocab * config.d_model  # all but the embedding
    return 6.0 * matmul + 12.0 * config.n_layers * config.d_model * seq


def layer_linears(config: neox_config.NeoXConfig) -> tuple[tuple[int, int], ...]:
    r"""$(d_\text{in}, d_\text{out})$ of a layer's four products: the fused
    QKV, the attention's output, the MLP's two."""
    d, d_ff = config.d_model, config.ff_dim
    return ((d, 3 * d), (d, d), (d, d_ff), (d_ff, d))


def fp8_linears(config: neox_config.NeoXConfig, kernels) -> tuple[tuple[int, int], ...]:
    """Of `layer_linears`, those `kernels` run in fp8."""
    return fp8_shapes(layer_linears(config), kernels)


def matmul_parameters(config: neox_config.NeoXConfig, finetune: str | None = None
                      ) -> int:
    r"""$N$: the four products of every layer ($3d^2 + d^2 + 2 d\, d_{ff}$) and
    the readout ($d V$); `ffn` trains the MLP's two, `biases` and `lora` none
    of them (an adapter's weights are too few to count)."""
    d, L = config.d_model, config.n_layers
    mlp = 2 * d * config.ff_dim
    if finetune in (None, "all"):
        return L * (4 * d * d + mlp) + d * config.n_vocab
    return L * mlp if finetune == "ffn" else 0


def activation_memory(config: neox_config.NeoXConfig, *, batch: int, seq: int,
                      finetune: str = "all", checkpointing: bool = False,
                      kernels=None, compiled: bool = False, lora_rank: int = 8,
                      lora_targets: Sequence[str] = tuple(TARGETS),
                      beside_gradients: bool = False) -> int:
    """The whole model's activation bytes per rank, [activation
    memory](activation_memory.html)'s total (or, `beside_gradients`, those
    alive while the layers' gradients are made), LoRA's adapters at their
    rank and targets."""
    count = activation_bytes(config, batch=batch, seq=seq, finetune=finetune,
                             lora_rank=lora_rank, lora_targets=lora_targets,
                             checkpointing=checkpointing, kernels=kernels,
                             compiled=compiled)
    return count.beside_gradients if beside_gradients else count.total


def save_hf(out_dir: str | os.PathLike, config: neox_config.NeoXConfig,
            named_tensors: Iterable[tuple[str, torch.Tensor]], *,
            tokenizer: str | os.PathLike | None = None,
            snapshot: str | os.PathLike | None = None, marker: str | None = None,
            **options) -> Path:
    """`save_hf_checkpoint`, with the tokenizer and the snapshot's side files
    beside the weights when `tokenizer` is given, and an export's `marker`
    (its kind) inside the same rename."""
    extra = hf_side_files(tokenizer, snapshot) if tokenizer is not None else {}
    if marker is not None:
        extra[EXPORT_MARKER] = marker_text(marker)
    return save_hf_checkpoint(out_dir, config, named_tensors,
                              extra_files=extra or None, **options)


def save_merged(out_dir: str | os.PathLike, config: neox_config.NeoXConfig,
                tensors: Iterable[tuple[str, torch.Tensor]], lora: FineTuneLoRA,
                **options) -> Path:
    r"""$W' = W + \frac{\alpha}{r} B A$ (`merged`), then `save_hf`."""
    return save_hf(out_dir, config,
                   merged(tensors, lora, dtype=options.get("dtype")), **options)


def save_adapter(out_dir: str | os.PathLike, layers: Sequence[nn.Module],
                 lora: FineTuneLoRA, *, base_model_name_or_path: str | None = None,
                 overwrite: bool = False) -> Path:
    """The adapters of unsharded layers in PEFT's format, each $A$ and $B$ in
    its own dtype ([`save_layers_adapter`](../hf/peft_adapter.html))."""
    return save_layers_adapter(out_dir, layers, lora, hf_prefix=hf_prefix,
                               base_model_name_or_path=base_model_name_or_path,
                               overwrite=overwrite)


def assemble(build: TrainingBuild, recipe: Recipe, *, device: torch.device,
             init_param=None, load=None, probe=None) -> Assembled:
    """
    ### The job's sharded model: [`build_neox`](build.html), the bench's path

    `build.kernels` resolved for `device`; looked up in its module when
    called, so that a test sees the job take the benchmark's path.
    """
    neox = neox_build.NeoXBuild(
        build.model, kernels=neox_build.resolve_kernels(build.kernels, device),
        compile=build.compile, filter_layers=build.filter_layers)
    return neox_build.build_neox(neox, recipe, device=device, init_param=init_param,
                                 load=load, probe=probe)


def load_sharded(checkpoint: HFCheckpoint, layer) -> None:
    """`load_hf_layer`: a `Zero3Layer`'s base weights, each rank its slices."""
    load_hf_layer(layer, checkpoint)


def export_hf(out_dir: str | os.PathLike, model, lora: FineTuneLoRA | None,
              config: neox_config.NeoXConfig, optimizer=None, *,
              tokenizer: str | os.PathLike | None = None,
              snapshot: str | os.PathLike | None = None, **options) -> Path | None:
    """`save_merged_checkpoint` with the tokenizer and the snapshot's side
    files, read by the export's one writer only (`writes_export`: with hybrid
    sharding, `comm.rank` 0 is one rank in each shard group)."""
    side = (hf_side_files(tokenizer, snapshot)
            if tokenizer is not None and writes_export(model) else None)
    return save_merged_checkpoint(out_dir, model, lora, config, optimizer,
                                  side_files=side, **options)


NEOX = ModelFamily(
    name="gpt-neox", model_types=("gpt_neox",),
    config_type=neox_config.NeoXConfig, presets=neox_config.PRESETS,
    read_config=neox_config.from_hf_config, write_config=neox_config.to_hf_config,
    check_snapshot=check_hf_snapshot, open_checkpoint=HFCheckpoint,
    build=build_layers, materialize=materialize, load_layer=load_layer,
    tokenizer=tokenizer, count_parameters=count_parameters,
    flops_per_token=flops_per_token, matmul_parameters=matmul_parameters,
    layer_linears=layer_linears, fp8_linears=fp8_linears,
    activation_memory=activation_memory,
    unfused_bytes=functools.partial(kernel_traffic.unfused_bytes, build_layers),
    finetuner=finetuner, lora_targets=tuple(TARGETS),
    named_tensors=hf_named_tensors, save_hf=save_hf, save_merged=save_merged,
    save_adapter=save_adapter, title="GPT-NeoX", experiment="zero3_neox",
    snapshot_config=config_from_hf,
    finetuners=FINETUNERS, resolve_kernels=neox_build.resolve_kernels,
    assemble=assemble, init_parameter=init_parameter, load_sharded=load_sharded,
    hf_prefix=hf_prefix, tokenizer_file=job_tokenizer_path,
    snapshot_dtype=snapshot_dtype, export_hf=export_hf,
    export_adapter=save_peft_adapter,
    check_export_destination=check_export_destination, export_bytes=export_bytes,
    generate=generate, sampling=Sampling)
"""Pythia and GPT-NeoX-20B. `save_merged` and `save_adapter` take unsharded
layers; the job's exports of the sharded model, `export_hf` and
`export_adapter`, are [the export page](lora_export.html)'s writers, which
every rank calls."""
