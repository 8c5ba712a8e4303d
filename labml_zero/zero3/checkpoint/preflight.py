r"""
---
title: Checking a checkpoint before the job starts
summary: What a launcher can learn from a checkpoint's manifest alone, so a
  resume that cannot work fails in one line before any process starts.
---

# Checking a checkpoint before the job starts

A resume that is refused only after the ranks started has cost the time to
start them, build the model and, on a GPU job, place it: minutes, for an error
that the manifest could have told. `check_resumable` is that check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from torch import nn

from .format import CheckpointError
from .reader import CheckpointReader

__all__ = ["CheckpointInfo", "check_resumable", "sequential_parameters",
           "sequential_shapes", "sequential_trainables"]


@dataclass(frozen=True)
class CheckpointInfo:
    """
    ## What `check_resumable` found

    Everything here comes from the manifest: what is left for the job to decide,
    the saved world size (another one is fine, [the load](load.html) reshards),
    the optimizer step and the `meta` values.
    """

    path: Path
    world_size: int
    """$N_d$ at save time."""
    resharded: bool
    """Whether the job's world size differs from `world_size`, so the load will
    reshard and not restore the RNG states (see [the load](load.html))."""
    optimizer_step: int | None
    """The largest optimizer step of any chunk; `None` for weights only."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The JSON values the job saved with `save_checkpoint(meta=...)`."""
    verified: bool = False
    """Whether every file's digest was checked (`verify=True` on a checkpoint
    that has digests)."""


def sequential_parameters(layers: Iterable[nn.Module]
                          ) -> Iterator[tuple[str, nn.Parameter]]:
    """
    ### The parameters of `Zero3Sequential(zero3_layers(layers))`, named

    Named `"<layer index>.<name in layer>"`, as `zero3_layers` names them; the
    layers may be on the meta device. A parameter of two layers (a tied
    embedding) is named once, in the first, which owns it (see Note: a
    parameter of two layers, in [sharding a model](../sharded_model.html)).
    """
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield f"{i}.{name}", p


def sequential_shapes(layers: Iterable[nn.Module]) -> dict[str, tuple[int, ...]]:
    """The shape of each of `sequential_parameters`, by name."""
    return {name: tuple(p.shape) for name, p in sequential_parameters(layers)}


def sequential_trainables(layers: Iterable[nn.Module]) -> set[str]:
    """The names of `sequential_parameters` that train (`requires_grad`)."""
    return {name for name, p in sequential_parameters(layers) if p.requires_grad}


def check_resumable(path: str | os.PathLike, *, world_size: int,
                    shapes: Mapping[str, tuple[int, ...]] | None = None,
                    expect: Mapping[str, Any] | None = None,
                    verify: bool = False) -> CheckpointInfo:
    """
    ## Check that a job can resume from `path`

    * `world_size` is the job's $N_d$.
    * `shapes` maps every parameter name of the job's model to its shape (see
      `sequential_shapes`); `None` skips the model check.
    * `expect` maps `meta` keys to the job's values; a saved value that differs
      is refused, a key the checkpoint's `meta` does not have is not compared.
    * `verify` checks every file's digest (reads the whole checkpoint once);
      without it a changed byte in a file is found only when a rank reads it.

    It reads the manifest and the files' sizes (and, with `verify`, every
    file's [digest](digest.html)); it needs no process group, no device and no
    model, only the parameter shapes, which a model built on the meta device
    gives for free. Raises `CheckpointError` with one line naming the path;
    returns a `CheckpointInfo`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # Refused: a path that is not a checkpoint directory (a file, a directory
    # without `manifest.json`, a save that did not finish), and a missing or
    # resized file (the reader checks every size).
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    reader = CheckpointReader(path)
    # A checkpoint of another model: the first parameter whose name or shape
    # differs, both shapes.
    if shapes is not None:
        reader.check_model(dict(shapes))
    # A value the job recorded in the manifest's `meta` (`save_checkpoint(meta=
    # ...)`) that differs from the job's own, e.g. its batch size or seed, when
    # the data order depends on them. A key the `meta` does not have (a
    # checkpoint saved before the job recorded it, or a format-1 one) is not
    # compared.
    for key, value in (expect or {}).items():
        if key in reader.meta and reader.meta[key] != value:
            raise CheckpointError(f"checkpoint {path} was saved with {key}="
                                  f"{reader.meta[key]!r}, this job has {value!r}")
    if verify:
        reader.verify_files()
    steps = [chunk["step"] for chunk in reader.chunks if chunk["step"] is not None]
    return CheckpointInfo(
        path=path,
        world_size=reader.world_size,
        resharded=reader.world_size != world_size,
        optimizer_step=max(steps) if steps else None,
        meta=dict(reader.meta),
        verified=verify and bool(reader.digests),
    )
