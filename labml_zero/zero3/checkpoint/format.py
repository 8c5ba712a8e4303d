r"""
---
title: The checkpoint format
summary: What a sharded checkpoint directory holds, what its manifest records, and
  the error every reader and writer raises.
---

# The checkpoint format

A [sharded checkpoint](index.html) is a directory:

```
manifest.json             rank 0: world size, chunks, parameters, optimizer
                            groups, every file's size and digest
rank-00000.safetensors    rank r's shards: "<chunk>.param" [S] in the chunk dtype,
rank-00001.safetensors      "<chunk>.master", "<chunk>.exp_avg", "<chunk>.exp_avg_sq"
                            in the dtypes of the optimizer's state layout
rank-00000.pt             rank r's RNG states and its `rank_extra`
extra.pt                  rank 0: the global `extra` (a loss scaler's state, say)
```

`<chunk>` is the chunk's position in `model.chunks`. The tensors are in
[safetensors](https://huggingface.co/docs/safetensors): a JSON header, then raw
bytes, so a reader maps the file and copies out a slice of one tensor without
reading the rest, and loading runs no pickled code. The `.pt` files hold small
Python values; they are loaded with `weights_only=True`, which runs no code
either.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..state_layout import FP32_STATES, StateLayout

__all__ = ["CheckpointError", "FORMAT", "MANIFEST"]

# ## The manifest
#
# The {{term: manifest}} lists every chunk: its size $C$, dtype, whether it is
# trainable, its optimizer step, and its parameters with qualified name, shape and
# offset. It
# records every file with its size in bytes (`files`) and its
# {{term: digest}}, its SHA-256 ([checked before use](digest.html), `digests`).
# It carries
#
# * a *fingerprint*, a hash of the sorted `(name, shape)` pairs, so a checkpoint
#   of another model is refused before anything is read;
# * a *save id* that every shard file repeats in its header, so a stray file from
#   another save is refused too;
# * `meta`: small JSON values the job chose to record (its step, batch size,
#   seed), which a launcher reads [before any process starts](preflight.html);
# * `states`, when an optimizer was saved: its
#   [state layout](../state_layout.html): its `name` (`"bf16-moments"`) and
#   `dtypes`, each state's dtype by name; with 8-bit moments also `blocks`,
#   the states kept one value per block of $B$ elements (their scales) and
#   $B$. A manifest without `states` was saved with fp32 states, the only
#   layout there was.
#
# `master` is written only when it is not the parameter itself: for a bf16/fp16 chunk
# with an optimizer state, or whose exact fp32 initial weights the engine kept
# (`master_init`, before the first step). For fp32 chunks the parameter *is* the
# master. Frozen chunks have only `param`.
FORMAT = "labml_zero.zero3.checkpoint/2"
"""What `save_checkpoint` writes."""
FORMAT_1 = "labml_zero.zero3.checkpoint/1"
"""
Before digests: still read, with no digest to check. Format 2 added `digests` and
`meta`. A format-1 checkpoint still loads, with its sizes and headers checked but
no digest: refusing it would strand every checkpoint written so far, and its files
are no less trustworthy than they were when it was written. A format-2 manifest
without `digests` is refused as corrupted.
"""
MANIFEST = "manifest.json"
EXTRA = "extra.pt"
# What every version's manifest must have, and what format 2 adds
MANIFEST_KEYS = ("save_id", "world_size", "fingerprint", "chunks", "param_groups",
                 "files")
MANIFEST_KEYS_2 = ("digests", "meta")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "uint8": torch.uint8}
# safetensors' dtype names, as `get_slice(...).get_dtype()` reports them
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.uint8: "U8"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the cause."""

    # the message names the file and what is wrong with it: the launcher leaves
    # out the traceback (see the supervisor's Failure)
    user_error = True


def tensors_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_state_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def states_entry(layout: StateLayout) -> dict:
    """The manifest's `states`: what a reader needs to read the states back;
    `blocks` names the states kept per block (8-bit moments' scales) and $B$."""
    blocks = {t.name: t.block for t in layout.tensors if t.block is not None}
    return {"name": layout.name, "dtypes": layout.dtypes,
            **({"blocks": blocks} if blocks else {})}


def saved_states(manifest: dict) -> dict:
    """The manifest's `states`, or the fp32 layout's for a manifest from before
    there was a choice."""
    states = manifest.get("states") or states_entry(FP32_STATES)
    unknown = [d for d in states["dtypes"].values() if d not in DTYPES]
    if unknown:
        raise CheckpointError(f"corrupted manifest: optimizer state dtype "
                              f"{unknown[0]!r} is none of {', '.join(DTYPES)}")
    return states


def fingerprint(shapes: dict[str, tuple[int, ...]]) -> str:
    """A hash of the sorted `(name, shape)` pairs: independent of the layout."""
    items = sorted((name, list(shape)) for name, shape in shapes.items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def first_difference(saved: dict[str, tuple[int, ...]],
                     model: dict[str, tuple[int, ...]]) -> str:
    """#### The first parameter that differs, as a sentence"""
    for name, shape in model.items():
        if name not in saved:
            return f"the model's parameter {name!r} is not in the checkpoint"
        if saved[name] != shape:
            return (f"parameter {name!r} has shape {saved[name]} in the checkpoint, "
                    f"{shape} in the model")
    extra = next(name for name in saved if name not in model)
    return f"the checkpoint's parameter {extra!r} is not in the model"
