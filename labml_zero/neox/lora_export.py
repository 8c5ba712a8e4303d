r"""
---
title: Fine-tune exports
summary: Any fine-tune out of the sharded model as a Hugging Face GPT-NeoX
  checkpoint (LoRA's adapters merged in), or LoRA's adapter alone for PEFT,
  gathered one chunk at a time.
---

# Fine-tune exports

Every fine-tune goes back to Hugging Face: `--export-hf` writes the model as a
checkpoint that `AutoModelForCausalLM` and `AutoTokenizer` load alone, every
parameter as trained; after [LoRA](lora.html), each adapted weight is
replaced by $W' = W + \frac{\alpha}{r} B A$ (`--export-hf`, or its older name
`--export-merged`), or the adapter is written alone for PEFT
(`--export-adapter`). The merge, PEFT's files and [where an export may
go](../hf/export_destination.html) are [shared with the Llama
family](../hf/peft_adapter.html), and so is gathering a sharded model's
adapters; this page gathers a sharded GPT-NeoX model for the merged
checkpoint, one chunk at a time, and names its layers for the adapter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

# The shared export mechanism, re-exported where the fine-tune, the export
# command and the tests import it.
from labml_zero.hf.export_destination import (  # noqa: F401
    ADAPTER,
    MERGED,
    ExportDestinationError,
    check_export_destination,
    contains,
    export_bytes,
    marker_text,
)
from labml_zero.hf.peft_adapter import (  # noqa: F401
    TrainableOnly,
    blocks_adapter_config,
    export_blocks_adapter,
    hf_names,
    merged,
    peft_adapter_config,
    peft_name,
    write_adapter_dir,
)
from labml_zero.hf.snapshot_layout import (  # noqa: F401
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    EXPORT_MARKER,
)
from labml_zero.neox.hf_checkpoint import save_hf_checkpoint
from labml_zero.neox.lora import FineTuneLoRA
from labml_zero.neox.model import NeoXConfig, hf_prefix
from labml_zero.zero3.checkpoint import export_full_state_dict

__all__ = ["merged", "save_merged_checkpoint", "peft_adapter_config",
           "peft_name", "save_peft_adapter", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS",
           "EXPORT_MARKER", "ExportDestinationError", "check_export_destination",
           "export_bytes"]


# ## The merged checkpoint


def save_merged_checkpoint(out_dir: str | os.PathLike, model,
                           lora: FineTuneLoRA | None, config: NeoXConfig,
                           optimizer=None, *, dtype: torch.dtype | None = None,
                           overwrite: bool = False,
                           side_files: dict[str, str] | None = None
                           ) -> Path | None:
    """
    ### Write the model as a Hugging Face checkpoint, adapters merged

    Called by every rank of the sharded `model` (a `Zero3Sequential` of GPT-NeoX
    layers, with adapters when `lora` is given, else any fine-tune); rank 0
    writes `out_dir` and returns it, the others return `None`. `config` is the
    model's shape (for `config.json`); `dtype` casts every tensor (the merge
    itself is computed in higher precision; in a bf16 or fp16 checkpoint an
    update smaller than half a unit in the last place of $W$ is lost, while the
    fp32 masters stay in the sharded checkpoint): the base snapshot's, so a bf16
    base stays bf16 even when a CPU run trained it in fp32, else the training
    dtype. `side_files` (`{name: text}`, `hf_side_files`: `config.json`'s
    companions, the tokenizer the job encoded with and
    `generation_config.json`) go in beside the weights, inside the same
    rename.

    The checkpoint is written by [`save_hf_checkpoint`](hf_checkpoint.html); it
    loads with `GPTNeoXForCausalLM.from_pretrained` and runs at the base model's
    cost. Like the adapter export this is a collective: every rank calls it, and
    the tensors come to rank 0 [one chunk at a
    time](../zero3/checkpoint/export.html), from the fp32 master when the
    optimizer is given (the values training would continue from).
    """
    def write(tensors: Iterator[tuple[str, torch.Tensor]]) -> Path:
        if overwrite:  # again at the end: the directory may have changed since
            check_export_destination(out_dir, MERGED, flag="export", protected={})
        whole = merged(tensors, lora, dtype=dtype) if lora is not None else tensors
        return save_hf_checkpoint(out_dir, config, whole, dtype=dtype,
                                  overwrite=overwrite,
                                  extra_files={**(side_files or {}),
                                               EXPORT_MARKER: marker_text(MERGED)})

    return export_full_state_dict(write, model, optimizer,
                                  rename=hf_names(model, hf_prefix))


# ## The PEFT adapter


def save_peft_adapter(out_dir: str | os.PathLike, model, lora: FineTuneLoRA,
                      optimizer=None, *, base_model_name_or_path: str | None = None,
                      overwrite: bool = False) -> Path | None:
    """
    ### Write the adapter in PEFT's format

    Called by every rank of the sharded `model`: [the shared
    export](../hf/peft_adapter.html) of its GPT-NeoX layers' adapters, under
    PEFT's keys for `GPTNeoXForCausalLM`
    (`base_model.model.gpt_neox.layers.`$i$`.attention.query_key_value.lora_A.weight`).
    """
    return export_blocks_adapter(out_dir, model, lora, optimizer,
                                 hf_prefix=hf_prefix,
                                 base_model_name_or_path=base_model_name_or_path,
                                 overwrite=overwrite)
