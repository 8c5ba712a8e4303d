r"""
---
title: A model family as one object
summary: What the fine-tune job asks of a model family (presets, config.json,
  the build on meta, checkpoints, fine-tuners, FLOPs, activations, tokenizer)
  as one frozen object of functions, so the job need not import a model package.
---

# A model family as one object

The job should ask a family, not import it (torchtitan's ModelSpec): one
frozen object names a family's presets, its `config.json`, its snapshots, its
build on the meta device and its weights, its fine-tuners, its tokenizer, and
its cost, training FLOPs a token

$$C = 6\,\Psi_m + 12\, L\, d\, T$$
(tested: tests/neox/test_family.py::test_flops_are_the_jobs_palm_count)

for $\Psi_m$ parameters in matrix products, $L$ layers of width $d$ and $T$
tokens of context (PaLM's count; a family may refine it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from tokenizers import Tokenizer
from torch import nn

from labml_zero.assembly import Assembled

__all__ = ["ModelFamily", "TrainingBuild", "HF_EXPORT", "ADAPTER_EXPORT"]

# The two kinds of export the job writes, as `check_export_destination` and
# `export_bytes` name them (each export's marker file records its kind).
HF_EXPORT, ADAPTER_EXPORT = "merged_checkpoint", "lora_adapter"


@dataclass(frozen=True)
class TrainingBuild:
    """
    ## What model the job asks `assemble` for
    """

    model: Any
    """The family's config: the shape."""
    kernels: str = "auto"
    """The fused kernels by the job's flag: `auto`, `none` or names; the family
    resolves them for the device (`resolve_kernels`)."""
    compile: bool = False
    """Compile each transformer layer's forward."""
    filter_layers: Sequence[int] | None = None
    """Keep only these transformer layers; `None` keeps all."""


@dataclass(frozen=True)
class ModelFamily:
    """
    ## What the job asks of a model family

    Each field is a function or a table; none holds state. The [fine-tune
    job](finetune/job.html), given a `--checkpoint` path,

    1. picks the family by `config.json`'s `model_type` (one of
       `model_types`), reads it (`snapshot_config`) and calls
       `check_snapshot(path)` before any rank starts;
    2. builds on meta (`build`) to size its checkpoints and exports, and
       reads `tokenizer(path, config)` for its data;
    3. on each rank, `assemble`s the sharded model, marked by
       `finetuner(name, ...)`, with `resolve_kernels`' choice, and gives it
       weights: `init_parameter` one parameter at a time, or `load_sharded`
       per layer from `open_checkpoint`;
    4. at the end, writes `export_hf` and `export_adapter` from the sharded
       model (every rank gathers) and samples with `generate`.

    The other fields (`materialize`, `load_layer`, `save_hf`, `save_merged`,
    `save_adapter`, `flops_per_token`, `matmul_parameters`, `layer_linears`,
    `fp8_linears`,
    `activation_memory`, `unfused_bytes`) serve unsharded layers (tests and small models), the
    offline export and [the planner](planner/index.html).

    It holds functions, not a base class to override: each family package
    (`neox/family.py`, `llama/family.py`) builds one instance from its own
    functions, and [the registry](families.html) lists them. The fields'
    signatures are the Llama family's; GPT-NeoX's family adapts its own
    functions to them. This page imports torch and [the
    assembly](assembly.html) (what a family's build returns), both below the
    model packages, so both families, and the registry above them, can import
    it.
    """

    name: str
    """The family's name on the command line and in records."""
    model_types: tuple[str, ...]
    """The `model_type`s of Hugging Face's `config.json` the family reads."""
    config_type: type
    """The class of its configs (`read_config`'s result, every preset's)."""
    presets: Mapping[str, Callable[[], Any]]
    """Preset name (`--model`) to a function returning its config."""
    read_config: Callable[[Mapping[str, Any]], Any]
    """A `config.json`, as a dict, to the family's config; `ValueError` on
    what it cannot build."""
    write_config: Callable[..., dict[str, Any]]
    """`write_config(config, dtype=...)`: the `config.json` as a dict."""
    check_snapshot: Callable[[str | os.PathLike], Any]
    """A snapshot's config, every header checked; one-line `CheckpointError`."""
    open_checkpoint: Callable[[str | os.PathLike], Any]
    """A lazy reader of a snapshot, for `load_layer`."""
    build: Callable[..., list[nn.Module]]
    """`build(config, device=..., dtype=...)`: the list of layers."""
    materialize: Callable[[list[nn.Module], torch.device | str], None]
    """Meta layers to real, initialised ones."""
    load_layer: Callable[..., dict[str, torch.Tensor]]
    """`load_layer(checkpoint, layer, dtype=...)`: one layer's tensors."""
    tokenizer: Callable[[str | os.PathLike | None, Any], tuple[Tokenizer, int]]
    """`tokenizer(path, config)`: the tokenizer and its end-of-text id."""
    count_parameters: Callable[[list[nn.Module]], int]
    r"""$\Psi$, the model's parameters in elements, a tied matrix once."""
    flops_per_token: Callable[[Any, int], float]
    """`flops_per_token(config, seq)`: training FLOPs a token."""
    matmul_parameters: Callable[..., int]
    r"""`matmul_parameters(config, finetune=None)`: $N$, the weights of the
    matrix products a token passes (the readout's; the embedding is a
    lookup); given a fine-tuner's name, those of the products whose weights
    it trains, which alone cost a weight gradient."""
    layer_linears: Callable[[Any], tuple[tuple[int, int], ...]]
    r"""`layer_linears(config)`: $(d_\text{in}, d_\text{out})$ of each matrix
    product of one repeating layer, in `lora_targets`' order, for the
    planner's step time."""
    fp8_linears: Callable[[Any, Any], tuple[tuple[int, int], ...]]
    r"""`fp8_linears(config, kernels)`: $(d_\text{in}, d_\text{out})$ of each
    matrix product of one repeating layer that `kernels` run in
    [fp8](layers/float8.html) (none without `fp8`), for the planner's step
    time."""
    activation_memory: Callable[..., int]
    """`activation_memory(config, *, batch, seq, finetune, checkpointing,
    kernels, compiled, lora_rank, lora_targets, beside_gradients)`: the activation bytes a rank
    holds when its last backward pass starts (every layer's saved tensors, or
    its checkpointed inputs, and the readout's and loss's), for the kernels
    `resolve_kernels` gave, the layers compiled or not; `lora_*` (LoRA's
    adapters) are given with `finetune='lora'` only. With
    `beside_gradients=True`: those alive while the layers' gradients are made,
    after the loss's peak."""
    unfused_bytes: Callable[..., Any]
    """`unfused_bytes(config, kernels, *, batch, seq)`: the bytes per token
    that the plain twins of the fusions `kernels` leave off add to a step,
    a layer's forward and backward and the rest's ([their
    count](layers/kernel_traffic.html)), for the planner's step time."""
    finetuner: Callable[..., Any]
    """`finetuner(name, **options)`: `all`, or `lora` with `rank`, `alpha`,
    `targets`, and any others the family has."""
    lora_targets: tuple[str, ...]
    """The names of the projections LoRA may adapt."""
    named_tensors: Callable[[list[nn.Module]], Any]
    """`(hf_name, tensor)` of unsharded layers, for the writers."""
    save_hf: Callable[..., Any]
    """`save_hf(dir, config, named_tensors, tokenizer=..., snapshot=...,
    dtype=..., marker=...)`: a Hugging Face checkpoint; `marker`, an export's
    kind, lets a later export of that kind replace it."""
    save_merged: Callable[..., Any]
    """`save_merged(dir, config, named_tensors, lora, ...)`: the same, each
    adapter folded into its weight."""
    save_adapter: Callable[..., Any]
    """`save_adapter(dir, layers, lora)`: the adapter alone, for PEFT."""

    # ### What the fine-tune job asks
    title: str
    """The family's name in the job's banner (`GPT-NeoX`, `Llama`)."""
    experiment: str
    """labml's experiment name for the family's fine-tunes: runs go to
    `<log_dir>/<experiment>/`, so one family's runs are listed apart from
    another's (`zero3_neox`, `zero3_llama`)."""
    snapshot_config: Callable[[str | os.PathLike], Any]
    """A snapshot's `config.json`, checked, as the family's config (no tensor
    read); one-line `CheckpointError` naming the file and the field."""
    finetuners: tuple[str, ...]
    """The names `finetuner` takes; `lora` alone takes options (`rank`,
    `alpha`, `targets`)."""
    resolve_kernels: Callable[[str, torch.device | str], Any]
    """`resolve_kernels(spec, device)`: the job's `--kernels` (`auto`, `none` or
    names) for `device`; the result's `loss` says whether the readout computes
    the loss itself. `ValueError` naming an unknown kernel."""
    assemble: Callable[..., Assembled]
    """`assemble(build, recipe, *, device, init_param, load, probe)`: a
    `TrainingBuild` built on meta and [assembled](assembly.html), sharded."""
    init_parameter: Callable[[Any], Callable[[str, torch.Tensor], None]]
    """`init_parameter(config)`: the initialiser of one parameter by its name in
    its layer, for `assemble` (random weights, chunk by chunk)."""
    load_sharded: Callable[[Any, nn.Module], None]
    """`load_sharded(checkpoint, zero3_layer)`: a sharded layer's base weights
    from `open_checkpoint`'s reader; LoRA's adapters keep their init."""
    hf_prefix: Callable[[nn.Module], str]
    """A layer's Hugging Face name prefix: `hf_prefix(layer) + name` is each
    entry of its `state_dict()` in a checkpoint."""
    tokenizer_file: Callable[[str | os.PathLike | None], Path]
    """The `tokenizer.json` the job encodes with for a snapshot (or `None`:
    random weights), and ships beside an export."""
    snapshot_dtype: Callable[[str | os.PathLike], torch.dtype | None]
    """The dtype a snapshot's `config.json` stores its weights in, or `None`."""
    export_hf: Callable[..., Any]
    """`export_hf(dir, model, lora, config, optimizer, *, dtype, overwrite,
    tokenizer, snapshot)`: the sharded model as a Hugging Face checkpoint,
    LoRA's adapters merged; every rank calls it, one writes (`writes_export`:
    rank 0 of the first shard group)."""
    export_adapter: Callable[..., Any]
    """`export_adapter(dir, model, lora, optimizer, *, base_model_name_or_path,
    overwrite)`: the sharded model's adapters in PEFT's format; every rank
    calls it."""
    check_export_destination: Callable[..., Path]
    """`check_export_destination(path, kind, *, flag, protected, need_bytes)`:
    a directory an export of `kind` may replace (new, empty, or an earlier
    export of that kind); `ValueError` in one line otherwise."""
    export_bytes: Callable[[Sequence[nn.Module], str, torch.dtype], int]
    """`export_bytes(layers, kind, dtype)`: the bytes an export writes."""
    generate: Callable[..., str]
    """`generate(model, tokenizer, prompt, *, n_tokens, sampling, generator,
    device)`: a continuation of `prompt` through the sharded model."""
    sampling: Callable[..., Any]
    """`sampling(top_k=..., max_context=...)`: `generate`'s settings."""
