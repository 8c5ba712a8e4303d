r"""
---
title: Fine-tune exports
summary: Any fine-tune out of the sharded model as a Hugging Face GPT-NeoX
  checkpoint (LoRA's adapters merged in), or LoRA's adapter alone for PEFT,
  gathered one chunk at a time.
---

# Fine-tune exports

Every fine-tune goes back to Hugging Face: `--export-hf` writes the model as a
checkpoint that `AutoModelForCausalLM` and `AutoTokenizer` load alone. For
`all`, `ffn` and `biases` that is every parameter as trained. A
[LoRA](lora.html) fine-tune leaves two things worth keeping, and this page
writes either. The first folds each adapter into its weight,

$$W' = W + \frac{\alpha}{r} B A,$$

a matrix of $W$'s shape, so the result is an ordinary model again: **the merged
model**, every adapted weight replaced by $W'$ (`--export-hf`, or its older
name `--export-merged`). The second is **the adapter alone**, in PEFT's format
(`--export-adapter`).

The checkpoint is written in one dtype, the base snapshot's (a bf16 base
stays bf16 even when a CPU run trained it in fp32), else the training dtype;
beside it go `config.json`, the tokenizer the job encoded with and
`generation_config.json` ([beside the weights](side_files.html)).

## Where an export may go

An export replaces its directory whole, once the new one is complete (see
[atomic files](../files.html)). So that this never deletes anything else, each
export writes a marker, `labml_zero_export.json` naming its kind, and a
directory may be replaced only if it is empty or holds a previous export of the
*same kind*: its marker and no file that kind does not write. Never a file, a
symbolic link, nor `--out`, `--log-dir`, `--checkpoint`, `--resume` or a
directory above any of them (`check_export_destination`). The sizes to find
room for come from the model's shapes (`export_bytes`): the adapter is
$4\Psi_\text{lora}$ bytes (fp32 masters), the checkpoint $p\Psi$ in the export's
dtype of $p$ bytes, adapters left out (they are folded in).

## Limitations

* In a bf16 or fp16 checkpoint an update smaller than half a unit in the
  last place of $W$ is lost (see `merged`); the fp32 masters stay in the
  sharded checkpoint.
* The adapter file has no `README.md` model card, which PEFT writes and does
  not need.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import torch
from safetensors.torch import save_file

from labml_zero.files import (fsync_path, give_default_mode, replace_directory,
                              size_text, temporary_sibling)
from labml_zero.neox.hf_checkpoint import (CONFIG_FILE, INDEX_FILE, SINGLE_FILE,
                                           save_hf_checkpoint)
from labml_zero.neox.lora import ADAPTER_NAMES, FineTuneLoRA
from labml_zero.neox.model import NeoXConfig, TransformerLayer, hf_prefix
from labml_zero.neox.side_files import SIDE_FILES
from labml_zero.zero3.checkpoint import export_full_state_dict, prefix_rename

__all__ = ["merged", "save_merged_checkpoint", "peft_adapter_config",
           "peft_name", "save_peft_adapter", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS",
           "EXPORT_MARKER", "ExportDestinationError", "check_export_destination",
           "export_bytes"]

# The two files of an adapter directory, by the names PEFT loads.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's prefix for the wrapped model's modules (`PeftModel.base_model.model`).
PEFT_PREFIX = "base_model.model."

# ## Where an export may go

# The file each export writes beside its own, `{"kind": ...}`: what tells a
# previous export, which may be replaced, from a directory of anything else.
EXPORT_MARKER = "labml_zero_export.json"
ADAPTER, MERGED = "lora_adapter", "merged_checkpoint"
# The names each kind writes; anything else in a directory is someone's data.
EXPORT_FILES = {
    ADAPTER: re.compile(rf"{re.escape(ADAPTER_CONFIG)}|{re.escape(ADAPTER_WEIGHTS)}"),
    MERGED: re.compile(rf"{re.escape(CONFIG_FILE)}|{re.escape(SINGLE_FILE)}"
                       rf"|{re.escape(INDEX_FILE)}"
                       r"|model-\d{5}-of-\d{5}\.safetensors|"
                       + "|".join(map(re.escape, SIDE_FILES))),
}


class ExportDestinationError(ValueError):
    """An export directory that must not be replaced; the message is one line."""


def marker_text(kind: str) -> str:
    return json.dumps({"kind": kind, "writer": "labml_zero"}) + "\n"


def previous_export_kind(directory: Path) -> str | None:
    """The kind its marker names, or `None` without a readable marker."""
    try:
        kind = json.loads((directory / EXPORT_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in EXPORT_FILES else None


def contains(outer: Path, inner: Path) -> bool:
    """`inner` is `outer` or below it (both resolved)."""
    return inner == outer or outer in inner.parents


def check_export_destination(path: str | os.PathLike, kind: str, *, flag: str,
                             protected: dict[str, str | os.PathLike | None],
                             need_bytes: int = 0) -> Path:
    """
    ### A directory this export may write, or replace

    * `kind`: `"lora_adapter"` or `"merged_checkpoint"`;
    * `flag`: how the user named it (`--export-adapter`), for the message;
    * `protected`: `{flag: path}` of the directories the run reads or writes
      otherwise; the export may be below them, never them or above them;
    * `need_bytes`: room the export needs on its filesystem.

    Returns the path; raises `ExportDestinationError` (see "Where an export may
    go"). Nothing is created or changed.
    """
    given = Path(path).expanduser()
    target = given.resolve()
    for other, where in protected.items():
        if where is not None and contains(target, Path(where).expanduser().resolve()):
            same = target == Path(where).expanduser().resolve()
            raise ExportDestinationError(
                f"{flag} {given} {'is' if same else 'contains'} {other} {where}: "
                f"an export replaces its whole directory; give another one")
    if given.is_symlink():
        raise ExportDestinationError(f"{flag} {given} is a symbolic link; give the "
                                     f"directory itself")
    if given.exists() and not given.is_dir():
        raise ExportDestinationError(f"{flag} {given} is a file, not a directory")
    if given.is_dir():
        names = sorted(p.name for p in given.iterdir())
        foreign = [n for n in names
                   if n != EXPORT_MARKER and not EXPORT_FILES[kind].fullmatch(n)]
        if names and (previous_export_kind(given) != kind or foreign):
            what = (f"{foreign[0]!r} and {len(foreign) - 1} more" if len(foreign) > 1
                    else repr(foreign[0]) if foreign else f"no {EXPORT_MARKER}")
            raise ExportDestinationError(
                f"{flag} {given} holds files that are not an earlier export of "
                f"this kind ({what}); give a new or empty directory")
    # the nearest directory that exists is where the temporary sibling goes
    existing = target if target.is_dir() else target.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ExportDestinationError(f"{flag} {given}: {existing} is a file, not a "
                                     f"directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ExportDestinationError(f"{flag} {given} is not writable "
                                     f"({e.strerror or e})") from e
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise ExportDestinationError(f"{flag} {given} has {size_text(free)} free, "
                                     f"the export needs {size_text(need_bytes)}")
    return given


def export_bytes(layers, kind: str, dtype: torch.dtype) -> int:
    r"""
    ### Bytes an export writes, from the marked layers' shapes

    `layers` may carry LoRA's adapters (on the meta device is enough); `dtype`
    is the checkpoint's. The adapter: $4\Psi_\text{lora}$; the checkpoint: $p\Psi$
    without the adapters, which are folded in.
    """
    total = 0
    for layer in layers:
        for name, param in layer.named_parameters():
            is_adapter = name.rpartition(".")[2] in ADAPTER_NAMES
            if kind == ADAPTER:
                total += 4 * param.numel() if is_adapter else 0
            elif not is_adapter:
                total += dtype.itemsize * param.numel()
    return total


def hf_names(model):
    """`Zero3Sequential` names (`"3.attention.dense.weight"`) to Hugging Face ones."""
    return prefix_rename([hf_prefix(layer.module) for layer in model.layers])


# ## The merged checkpoint


def merged(tensors: Iterable[tuple[str, torch.Tensor]], lora: FineTuneLoRA, *,
           dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    r"""
    ### Fold the adapters into their weights

    `tensors` yields `(hf_name, tensor)` of a model with adapters; the result
    has the base model's names only, each adapted `weight` replaced by
    $W + \frac{\alpha}{r} B A$.

    #### Merging in order

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
    itself is computed in higher precision); `side_files` (`{name: text}`,
    `hf_side_files`) go in beside the weights, inside the same rename.

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

    return export_full_state_dict(write, model, optimizer, rename=hf_names(model))


# ## The PEFT adapter
#
# `adapter_config.json` (rank, $\alpha$, target module names) and
# `adapter_model.safetensors` with only the $A$ and $B$ matrices ($\Psi_\text{lora}$
# numbers, not $\Psi$), which `PeftModel.from_pretrained(base_model, directory)`
# puts back on the base model. PEFT names each matrix after the module it adapts,
# under its wrapper's prefix: our `attention.query_key_value.lora_A` of layer $i$
# is `base_model.model.gpt_neox.layers.`$i$`.attention.query_key_value.lora_A.weight`.


def peft_name(hf_name: str) -> str:
    """`gpt_neox.layers.0.attention.dense.lora_A` → PEFT's
    `base_model.model.gpt_neox.layers.0.attention.dense.lora_A.weight`."""
    return PEFT_PREFIX + hf_name + ".weight"


def peft_adapter_config(lora: FineTuneLoRA, layer_indices: list[int],
                        n_layers: int, *,
                        base_model_name_or_path: str | None = None) -> dict:
    """
    ### `adapter_config.json`

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
        # PEFT matches these against the last part of each module's name; in
        # `GPTNeoXForCausalLM` only `attention.dense` ends in `dense` (the MLP's
        # are `dense_h_to_4h` and `dense_4h_to_h`), so each adapts one projection.
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


class TrainableOnly(NamedTuple):
    """
    #### The trainable chunks of a sharded model, for `export_full_state_dict`

    It gathers `model.chunks` through `model.runtime`; given this, it gathers
    only the chunks that hold adapters.
    """

    runtime: object
    chunks: list


def save_peft_adapter(out_dir: str | os.PathLike, model, lora: FineTuneLoRA,
                      optimizer=None, *, base_model_name_or_path: str | None = None,
                      overwrite: bool = False) -> Path | None:
    """
    ### Write the adapter in PEFT's format

    Called by every rank of the sharded `model`; rank 0 writes `out_dir`
    (atomically, see `write_adapter_dir`) and returns it, the
    others return `None`. The matrices are written in the dtype they are
    gathered in: fp32 from the optimizer's masters. Only the trainable chunks
    are gathered, since they hold every adapter and nothing else.
    """
    layers = [layer.module for layer in model.layers
              if isinstance(layer.module, TransformerLayer)]
    if not layers:
        raise ValueError("save_peft_adapter: the model has no transformer layers")
    config = peft_adapter_config(lora, [layer.layer_idx for layer in layers],
                                 layers[0].config.n_layers,
                                 base_model_name_or_path=base_model_name_or_path)
    out_dir = Path(out_dir)

    def write(tensors: Iterator[tuple[str, torch.Tensor]]) -> Path:
        adapter = {peft_name(name): tensor for name, tensor in tensors
                   if name.rpartition(".")[2] in ADAPTER_NAMES}
        if not adapter:
            raise ValueError("save_peft_adapter: the model has no LoRA adapters")
        write_adapter_dir(out_dir, config, adapter, overwrite=overwrite)
        return out_dir

    trainable = TrainableOnly(model.runtime,
                              [c for c in model.chunks if c.trainable])
    return export_full_state_dict(write, trainable, optimizer,
                                  rename=hf_names(model))


def write_adapter_dir(out_dir: Path, config: dict,
                      tensors: dict[str, torch.Tensor], *, overwrite: bool) -> None:
    """
    #### Both files into a fresh directory, then one rename

    The steps of [atomic files](../files.html): a reader never sees a directory
    with one file and not the other, nor an old adapter's config beside a new
    adapter's weights.
    """
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"adapter directory exists: {out_dir} "
                              f"(pass overwrite=True)")
    if overwrite:  # only a previous adapter export (see "Where an export may go")
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
