r"""
---
title: Where an export may go
summary: The one check before any export replaces a directory: a marker names
  the export's kind, and nothing but an earlier export of that kind is ever
  replaced; the bytes to find room for, from the model's shapes.
---

# Where an export may go

An export replaces its directory whole, once the new one is complete (see
[atomic files](../files.html)). So that this never deletes anything else, a
directory may be replaced only if it is empty or holds a previous export of
the *same kind*, and there must be room for the export's bytes: the adapter's
$4\Psi_\text{lora}$ (fp32 masters), the checkpoint's $p\Psi$ in a dtype of $p$
bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from labml_zero.files import size_text
from labml_zero.hf.snapshot_layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS,
                                           CONFIG_FILE, EXPORT_MARKER, INDEX_FILE,
                                           SHARD_PATTERN, SIDE_FILES, SINGLE_FILE)
from labml_zero.layers.lora import is_adapter
from labml_zero.zero3.checkpoint.pruning import is_complete

__all__ = ["ADAPTER", "MERGED", "EXPORT_MARKER", "ExportDestinationError",
           "check_export_destination", "export_bytes", "marker_text"]

# The two kinds of export, as their markers name them. Each export writes
# `labml_zero_export.json` naming its kind; a directory that holds it and only
# files that kind writes is a previous export, which may be replaced.
ADAPTER, MERGED = "lora_adapter", "merged_checkpoint"
# The names each kind writes; anything else in a directory is someone's data.
EXPORT_FILES = {
    ADAPTER: re.compile(rf"{re.escape(ADAPTER_CONFIG)}|{re.escape(ADAPTER_WEIGHTS)}"),
    MERGED: re.compile(rf"{re.escape(CONFIG_FILE)}|{re.escape(SINGLE_FILE)}"
                       rf"|{re.escape(INDEX_FILE)}|{SHARD_PATTERN}|"
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
    ## A directory this export may write, or replace

    * `kind`: `"lora_adapter"` or `"merged_checkpoint"`;
    * `flag`: how the user named it (`--export-adapter`), for the message;
    * `protected`: `{flag: path}` of the directories the run reads or writes
      otherwise; the export may be below them, never them or above them;
    * `need_bytes`: room the export needs on its filesystem.

    Returns the path, or raises `ExportDestinationError` for a file, a
    symbolic link, a directory that holds anything but a previous export of
    this kind, one that is or holds a protected one (`--out`, `--log-dir`,
    `--checkpoint`, `--resume`), one inside a checkpoint, or too little room.
    Nothing is created or changed.
    """
    given = Path(path).expanduser()
    target = given.resolve()
    for other, where in protected.items():
        if where is not None and contains(target, Path(where).expanduser().resolve()):
            same = target == Path(where).expanduser().resolve()
            raise ExportDestinationError(
                f"{flag} {given} {'is' if same else 'contains'} {other} {where}: "
                f"an export replaces its whole directory; give another one")
    # inside a checkpoint, an export would go when the checkpoint is pruned
    # (a checkpoint with anything its save did not write is kept, but would
    # then never be pruned)
    inside = next((d for d in target.parents if d.is_dir() and is_complete(d)), None)
    if inside is not None:
        raise ExportDestinationError(f"{flag} {given} is inside the checkpoint "
                                     f"{inside}; give a directory outside it")
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
    ## Bytes an export writes, from the marked layers' shapes

    `layers` may carry LoRA's adapters (on the meta device is enough); `dtype`
    is the checkpoint's. The adapter: $4\Psi_\text{lora}$; the checkpoint: $p\Psi$
    without the adapters, which are folded in.
    """
    total, seen = 0, set()
    for layer in layers:
        for name, param in layer.named_parameters():
            if id(param) in seen:  # a tied matrix is written once
                continue
            seen.add(id(param))
            adapter = is_adapter(name)
            if kind == ADAPTER:
                total += 4 * param.numel() if adapter else 0
            elif not adapter:
                total += dtype.itemsize * param.numel()
    return total
