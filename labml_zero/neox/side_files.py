r"""
---
title: Beside the weights
summary: The tokenizer, its config and generation_config.json that a Hugging Face
  export needs to be a whole model again, and the dtype a snapshot is stored in.
---

# Beside the weights

A Hugging Face checkpoint is more than its tensors. `AutoTokenizer` needs
`tokenizer.json` and `tokenizer_config.json`: without them it builds a
2-token tokenizer that encodes any text to `[]`. `generate` needs
`generation_config.json`'s end-of-text id, $t_\text{eot}$, to know where to stop.
An export (the [fine-tune's](lora_export.html) or [a saved
checkpoint's](../export.html)) writes these beside the weights that
[`save_hf_checkpoint`](hf_checkpoint.html) writes, inside the same rename.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import torch

from labml_zero.hf.safetensors_reader import read_json
# the files' names, [the snapshot layout's](../hf/snapshot_layout.html)
from labml_zero.hf.snapshot_layout import (CONFIG_FILE, GENERATION_CONFIG,
                                           SIDE_FILES, TOKENIZER_CONFIG,
                                           TOKENIZER_FILE)
from labml_zero.neox.tokenizer import end_of_text_id, load_tokenizer
from labml_zero.zero3.checkpoint import CheckpointError

__all__ = ["hf_side_files", "snapshot_dtype", "SIDE_FILES"]


def snapshot_dtype(path: str | os.PathLike) -> torch.dtype | None:
    """
    ## The dtype a snapshot's `config.json` says its weights are stored in

    `torch_dtype` (transformers 4) or `dtype` (5): what an export of a model
    fine-tuned from it is written in, so a bf16 base leaves as bf16 even when
    a CPU run trained it in fp32. `None` when the file names no float dtype
    or does not read (the snapshot's own check says why).
    """
    try:
        hf = read_json(Path(path) / CONFIG_FILE)
    except (OSError, CheckpointError):
        return None
    name = hf.get("torch_dtype") or hf.get("dtype") if isinstance(hf, dict) else None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else None


def hf_side_files(tokenizer: str | os.PathLike,
                  snapshot: str | os.PathLike | None = None) -> dict[str, str]:
    """
    ## The files an export needs beside its weights, `{name: text}`

    * `tokenizer`: the `tokenizer.json` (or its `.gz`) the job encoded with;
    * `snapshot`: the directory the job started from; its own
      `tokenizer_config.json`, `special_tokens_map.json`, chat template and
      `generation_config.json` are copied as they are.

    Without a snapshot's, `tokenizer_config.json` names the generic fast
    tokenizer, which encodes exactly as `tokenizer.json` does (no BOS/EOS
    added, as [the job's `encode`](tokenizer.html)); without `tokenizer.json`
    `AutoTokenizer` would build a 2-token tokenizer that encodes any text to
    `[]`. The end-of-text token is BOS, EOS and UNK, as in GPT-NeoX's.
    """
    tokenizer = Path(tokenizer)
    loaded = load_tokenizer(tokenizer)  # refuses a file that does not load
    eot = end_of_text_id(loaded)
    eot_text = loaded.id_to_token(eot)
    text = (gzip.decompress(tokenizer.read_bytes()).decode()
            if tokenizer.suffix == ".gz" else tokenizer.read_text())
    files = {TOKENIZER_FILE: text,
             TOKENIZER_CONFIG: json.dumps({
                 "tokenizer_class": "PreTrainedTokenizerFast",
                 "bos_token": eot_text, "eos_token": eot_text,
                 "unk_token": eot_text, "add_bos_token": False,
                 "add_eos_token": False}, indent=2),
             GENERATION_CONFIG: json.dumps({"bos_token_id": eot,
                                            "eos_token_id": eot}, indent=2)}
    for name in SIDE_FILES:
        if name == TOKENIZER_FILE:  # the one the job encoded with, above
            continue
        own = Path(snapshot) / name if snapshot is not None else None
        if own is not None and own.is_file():
            files[name] = own.read_text()
    return files
