r"""
---
title: The PEFT adapter
summary: LoRA's adapters as PEFT loads them (names, adapter_config.json,
  adapter_model.safetensors), or folded into their weights for an ordinary
  Hugging Face checkpoint; shared by every family.
---

# The PEFT adapter

A [LoRA](../layers/lora.html) fine-tune leaves two things worth keeping: **the
merged model**, each adapted weight replaced by

$$W' = W + \frac{\alpha}{r} B A,$$

an ordinary checkpoint again, and **the adapter alone**, in the format
`PeftModel.from_pretrained` loads, from unsharded layers or gathered from a
sharded model. Only the family's name prefix differs between families, so
this page serves both.

## Limitations

* In a bf16 or fp16 checkpoint an update smaller than half a unit in the
  last place of $W$ is lost (see `merged`).
* The adapter file has no `README.md` model card, which PEFT writes and does
  not need.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from labml_zero.files import (fsync_path, give_default_mode, replace_directory,
                              temporary_sibling)
from labml_zero.hf.export_destination import (ADAPTER, check_export_destination,
                                              marker_text)
from labml_zero.hf.snapshot_layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS,
                                           EXPORT_MARKER)
from labml_zero.layers.lora import ADAPTER_NAMES, LoRA, is_adapter
from labml_zero.zero3.checkpoint import export_full_state_dict, prefix_rename

__all__ = ["merged", "peft_name", "peft_adapter_config",
           "blocks_adapter_config", "write_adapter_dir", "save_layers_adapter",
           "hf_names", "TrainableOnly", "export_blocks_adapter", "PEFT_PREFIX"]

# PEFT's prefix for the wrapped model's modules (`PeftModel.base_model.model`).
PEFT_PREFIX = "base_model.model."


# ## The merged checkpoint


def merged(tensors: Iterable[tuple[str, torch.Tensor]], lora: LoRA, *,
           dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    r"""
    ## Fold the adapters into their weights

    `tensors` yields `(hf_name, tensor)` of a model with adapters; the result
    has the base model's names only, each adapted `weight` replaced by
    $W + \frac{\alpha}{r} B A$.

    ### Merging in order

    The chunks of a layer arrive in layout order, and a layer's frozen chunk
    (with $W$) may come before or after its trainable one (with $A$ and $B$). So
    this holds each adapted $W$ until its $A$ and $B$ have arrived, and each $A$,
    $B$ until its $W$ has: at most one layer on the host. The product is taken in
    fp32 and the sum is rounded once, to $W$'s dtype (or the export's `dtype`).
    In a bf16 or fp16 merged checkpoint $\frac{\alpha}{r} B A$ is thus rounded to
    $W$'s precision: an update smaller than half a unit in the last place of $W$
    is lost. Export in fp32 (`dtype=torch.float32`) to keep it exactly.
    """
    adapted = tuple("." + path for path in lora.paths())
    # module name -> {"weight" | "lora_A" | "lora_B": tensor}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf not in ("weight", *ADAPTER_NAMES) or not module.endswith(adapted) \
                or ".layers." not in module:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) < 3:
            continue
        del pending[module]
        w, a, b = parts["weight"], parts["lora_A"], parts["lora_B"]
        # [d_out, d_in] fp32; one rounding, at the end, to the output dtype
        update = lora.scale * (b.float() @ a.float())
        yield module + ".weight", (w.float() + update).to(dtype or w.dtype)
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted({"weight", *ADAPTER_NAMES} - parts.keys())
        raise ValueError(f"{module}: no {', '.join(missing)} among the tensors "
                         f"to merge")


# ## The adapter alone


def peft_name(hf_name: str) -> str:
    r"""
    ## PEFT's name of an adapter matrix

    PEFT names each matrix after the module it adapts, under its wrapper's
    prefix: `gpt_neox.layers.0.attention.dense.lora_A` is
    `base_model.model.gpt_neox.layers.0.attention.dense.lora_A.weight`, and
    Llama's `model.layers.0.self_attn.q_proj.lora_A` likewise. The directory
    holds `adapter_config.json` and `adapter_model.safetensors` with only the
    $A$ and $B$ matrices, $\Psi_\text{lora}$ numbers, not $\Psi$.
    """
    return PEFT_PREFIX + hf_name + ".weight"


def peft_adapter_config(lora: LoRA, layer_indices: list[int],
                        n_layers: int, *,
                        base_model_name_or_path: str | None = None) -> dict:
    """
    ## `adapter_config.json`

    The fields of PEFT's `LoraConfig` that describe this adapter; PEFT fills the
    rest with its defaults. With only some layers built (`filter_layers`),
    `layers_to_transform` names them, so PEFT adapts exactly those.
    """
    subset = sorted(layer_indices) != list(range(n_layers))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        # PEFT matches these against the last part of each module's name; a
        # family's names are each one projection's (in `GPTNeoXForCausalLM`
        # only `attention.dense` ends in `dense`: the MLP's are `dense_h_to_4h`
        # and `dense_4h_to_h`).
        "target_modules": list(lora.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": sorted(layer_indices) if subset else None,
        "layers_pattern": "layers" if subset else None,
    }


def blocks_adapter_config(lora: LoRA, blocks: Sequence[nn.Module], *,
                          base_model_name_or_path: str | None = None) -> dict:
    """`peft_adapter_config` of the blocks built, each with its `layer_idx` in
    a model of `config.n_layers` blocks."""
    if not blocks:
        raise ValueError("the model has no transformer blocks to adapt")
    return peft_adapter_config(lora, [block.layer_idx for block in blocks],
                               blocks[0].config.n_layers,
                               base_model_name_or_path=base_model_name_or_path)


def write_adapter_dir(out_dir: Path, config: dict,
                      tensors: dict[str, torch.Tensor], *, overwrite: bool) -> None:
    """
    ## Both files into a fresh directory, then one rename

    The steps of [atomic files](../files.html): a reader never sees a directory
    with one file and not the other, nor an old adapter's config beside a new
    adapter's weights.
    """
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"adapter directory exists: {out_dir} "
                              f"(pass overwrite=True)")
    if overwrite:  # only a previous adapter export (see check_export_destination)
        check_export_destination(out_dir, ADAPTER, flag="export", protected={})
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(out_dir)
    tmp.mkdir()
    try:
        # metadata {"format": "pt"} is what PEFT and transformers check for
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        give_default_mode(tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
        (tmp / EXPORT_MARKER).write_text(marker_text(ADAPTER))
        for path in (tmp / ADAPTER_WEIGHTS, tmp / ADAPTER_CONFIG,
                     tmp / EXPORT_MARKER, tmp):
            fsync_path(path)
        replace_directory(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_layers_adapter(out_dir: str | os.PathLike, layers: Sequence[nn.Module],
                        lora: LoRA, *, hf_prefix: Callable[[nn.Module], str],
                        base_model_name_or_path: str | None = None,
                        overwrite: bool = False) -> Path:
    """
    ## The adapters of unsharded blocks, in PEFT's format

    `layers` are a family's unsharded layers; its transformer blocks
    (`lora.BLOCK`, each with `layer_idx` and `config.n_layers`) hold the
    adapters; `hf_prefix(block)` is the family's checkpoint prefix of a
    block. Each $A$ and $B$ is written in its own
    dtype under PEFT's key. With only some layers built,
    `adapter_config.json`'s `layers_to_transform` names them.
    """
    blocks = [layer for layer in layers if isinstance(layer, lora.BLOCK)]
    config = blocks_adapter_config(
        lora, blocks, base_model_name_or_path=base_model_name_or_path)
    adapter = {peft_name(hf_prefix(block) + name): t.detach().cpu()
               for block in blocks for name, t in block.state_dict().items()
               if is_adapter(name)}
    if not adapter:
        raise ValueError("save_layers_adapter: the layers have no LoRA adapters")
    out_dir = Path(out_dir)
    write_adapter_dir(out_dir, config, adapter, overwrite=overwrite)
    return out_dir


# ## The adapters of a sharded model


def hf_names(model, hf_prefix: Callable[[nn.Module], str]) -> Callable[[str], str]:
    """`Zero3Sequential` names (`"3.self_attn.q_proj.weight"`) to the family's
    Hugging Face ones (`"model.layers.2.self_attn.q_proj.weight"`):
    `hf_prefix(layer)` replaces each layer's position."""
    return prefix_rename([hf_prefix(layer.module) for layer in model.layers])


class TrainableOnly(NamedTuple):
    """
    #### The trainable chunks of a sharded model, for `export_full_state_dict`

    It gathers `model.chunks` through `model.runtime`; given this, it gathers
    only the chunks that hold adapters.
    """

    runtime: object
    chunks: list


def export_blocks_adapter(out_dir: str | os.PathLike, model, lora: LoRA,
                          optimizer=None, *,
                          hf_prefix: Callable[[nn.Module], str],
                          base_model_name_or_path: str | None = None,
                          overwrite: bool = False) -> Path | None:
    r"""
    ## The adapters of a sharded model, in PEFT's format

    Called by every rank of the sharded `model`, whose layers include
    `lora.BLOCK`s, the family's transformer blocks; `hf_prefix` is the
    family's checkpoint prefix of a layer. Only the trainable chunks are
    gathered, since with LoRA they hold every adapter and nothing else:
    $r (d_\text{in} + d_\text{out})$ elements an adapted projection ($A$ is
    $r \times d_\text{in}$, $B$ is $d_\text{out} \times r$) rather than the
    whole model. They come to rank 0 [one chunk at a
    time](../zero3/checkpoint/export.html), from the fp32 masters when
    `optimizer` is given, and are written in the dtype they are gathered in;
    rank 0 writes `out_dir` in one rename (`write_adapter_dir`) and returns
    it, the others `None`.
    """
    blocks = [layer.module for layer in model.layers
              if isinstance(layer.module, lora.BLOCK)]
    if not blocks:
        raise ValueError(f"export_blocks_adapter: the model has no "
                         f"{lora.BLOCK.__name__} layers")
    config = blocks_adapter_config(
        lora, blocks, base_model_name_or_path=base_model_name_or_path)
    out_dir = Path(out_dir)

    def write(tensors: Iterator[tuple[str, torch.Tensor]]) -> Path:
        adapter = {peft_name(name): tensor for name, tensor in tensors
                   if is_adapter(name)}
        if not adapter:
            raise ValueError("export_blocks_adapter: the model has no LoRA "
                             "adapters")
        write_adapter_dir(out_dir, config, adapter, overwrite=overwrite)
        return out_dir

    trainable = TrainableOnly(model.runtime,
                              [c for c in model.chunks if c.trainable])
    return export_full_state_dict(write, trainable, optimizer,
                                  rename=hf_names(model, hf_prefix))
