r"""
---
title: Sharded checkpoints
summary: Each rank saves its own shards in parallel; resume is bit-exact, and a
  checkpoint loads at any world size.
---

# Sharded checkpoints

A ZeRO-3 rank holds $\frac{1}{N_d}$ of every chunk: its 16-bit parameter shard
and, for trainable chunks, the fp32 master and the two Adam moments. A checkpoint
is those shards, one file per rank, written in parallel and never gathered.
With $\Psi_t$ trainable and $\Psi_f$ frozen elements, $p$ bytes per parameter
and $K = 12$ bytes of optimizer state, each rank writes

$$\frac{(p + K)\,\Psi_t + p\,\Psi_f}{N_d}$$

bytes (for fp32, $K = 8$: the master is the parameter) and the ranks exchange
nothing but a few flags. The [format and the resharding
arithmetic](checkpoint_reader.html) have their own page; the
[export](checkpoint_export.html) of a whole model too.

## What makes a resume bit-exact

The next step after a load must compute exactly what the next step after the
save would have computed. That needs every input of a step:

* the 16-bit parameters (the forward pass reads them), the fp32 masters (the
  update writes them), both moments, and each shard's step count (Adam's bias
  correction);
* the optimizer's hyperparameters, which a schedule may have changed;
* the RNG states a step draws from: torch's CPU generator and this rank's CUDA
  one, Python's `random` and NumPy's global generator (dropout, sampling);
* whatever else the loop keeps: a loss scaler's state and the data position go
  into `extra` (global) or `rank_extra` (per rank).

Saving draws from no RNG (its temporary name comes from `secrets`), so the
states it saves are those the next step would have used.

## Note: atomic save

A crash halfway through a save must never leave at `path` something that loads:
it would resume from half new, half old (or missing) shards. So:

1. rank 0 draws a random id and all ranks learn it from an all-reduce; rank 0
   creates `.<name>.tmp-<id>` next to `path` (same filesystem, so the final
   rename is atomic);
2. every rank writes and `fsync`s its files there;
3. the ranks agree (an all-reduce of failure flags) that every write succeeded;
   if one failed, the directory is deleted and every rank raises;
4. rank 0 writes the manifest *last* (a directory without one is not a
   checkpoint), `fsync`s it and the directory, then renames the old checkpoint
   aside to `.<name>.old-<id>`, the new one to `path`, and deletes the old one.

Between the two renames there is briefly *no* checkpoint at `path`, never a
partial one; a crash just there leaves the old one complete at `.old-<id>`, and
`load_checkpoint` names it. A crash that kills the process leaves a
`.<name>.tmp-<id>` directory, which nothing loads and which may be deleted.

## Note: agreement between ranks

A rank that fails alone must neither leave the others waiting in a collective
nor let them go on with a half-loaded model. So each phase of a save or load
ends with an all-reduce of one failure flag per rank; if any is set, every rank
raises (the failing one its own error, the others "failed on rank $k$"). A load
reads everything into host memory *before* that agreement and changes the model
only after it, so a refused checkpoint changes nothing.

## Memory

* **save**: nothing on the device; on the host, the rank's shards (copied from
  the device), and about as much again while safetensors builds the file.
* **load**: on the host, the new shards, masters and moments, read slice by
  slice; on the device the new masters and moments replace the old ones.

## Limitations

* All ranks must see one filesystem: rank 0 sizes and renames every rank's file.
* RNG states and `rank_extra` are restored only at the saved world size: at
  another one there is no rank they belong to.
* Module buffers are not saved (the engine does not shard them); a model whose
  buffers are state (batch-norm statistics) must put them into `extra`.
* The optimizer must be built the same way (same param groups, in order); its
  hyperparameters (learning rate, betas, ...) are restored from the manifest.
* Each phase's agreement is an all-reduce, counted by the communicator's
  `CommCounter` like the training collectives.
"""

from __future__ import annotations

import io
import json
import os
import random
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from .checkpoint_reader import (EXTRA, FORMAT, MANIFEST, MOMENTS, CheckpointError,
                                CheckpointReader, dtype_name, fingerprint,
                                rank_state_file, tensors_file)
from .chunk import Chunk, ChunkState
from .communication import Communicator

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "load_checkpoint",
    "save_checkpoint",
]


# ## Describing the model


def model_shapes(chunks: Sequence[Chunk]) -> dict[str, tuple[int, ...]]:
    """Every parameter's qualified name and shape, in chunk order."""
    shapes: dict[str, tuple[int, ...]] = {}
    for chunk in chunks:
        for name, param in zip(chunk.names, chunk.params):
            if name in shapes:
                raise CheckpointError(f"parameter name {name!r} appears twice in "
                                      "the model")
            shapes[name] = tuple(param.shape)
    return shapes


def optimizer_state(optimizer, chunk: Chunk) -> dict | None:
    """AdamFP16's state of a chunk's shard, or `None` before its first step."""
    if optimizer is None or not chunk.trainable:
        return None
    # `.get`, not `[]`: `optimizer.state` is a defaultdict and must not grow
    state = optimizer.state.get(chunk.shard)
    return state or None


def master_of(optimizer, chunk: Chunk) -> torch.Tensor | None:
    """
    #### The fp32 master of a shard, when it is not the shard itself

    The optimizer's, or before the first step the exact fp32 weights the engine
    kept for a 16-bit chunk (`master_init`).
    """
    if not chunk.trainable or chunk.dtype == torch.float32:
        return None
    state = optimizer_state(optimizer, chunk)
    if state is not None:
        return state["master"]
    return getattr(chunk.shard, "master_init", None)


def group_hyperparameters(optimizer) -> list[dict] | None:
    """The param groups without their tensors, as JSON values."""
    if optimizer is None:
        return None
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        kept = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, tuple):
                value = list(value)
            try:
                json.dumps(value)
            except TypeError:
                raise CheckpointError(
                    f"optimizer group {index} hyperparameter {key!r} is a "
                    f"{type(value).__name__}, which a JSON manifest cannot hold"
                ) from None
            kept[key] = value
        groups.append(kept)
    return groups


# ## Agreement between ranks


def agree(comm: Communicator, error: BaseException | None, what: str) -> None:
    """See Note: agreement between ranks."""
    flags = torch.zeros(comm.world_size, dtype=torch.int32, device=comm.device)
    flags[comm.rank] = int(error is not None)
    comm.all_reduce(flags)
    # host sync: every rank must know the outcome before going on
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0]}; see its error")


def agree_save_id(comm: Communicator) -> str:
    """A random id drawn by rank 0 and summed into every rank (the others add 0)."""
    # `secrets`, not `random`: the save must not move the RNG state it saves
    token = torch.tensor([secrets.randbits(48) if comm.rank == 0 else 0],
                         dtype=torch.int64, device=comm.device)
    comm.all_reduce(token)
    # host sync: .item()
    return f"{token.item():012x}"


# ## Writing files


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(tensors: dict[str, torch.Tensor], file: Path, *,
                  metadata: dict[str, str]) -> None:
    """One safetensors file, flushed; the tests replace it to simulate a crash."""
    save_file(tensors, str(file), metadata=metadata)
    fsync_path(file)


def write_checked_pickle(value: Any, file: Path, *, what: str) -> None:
    """
    #### Write `value` with `torch.save`, after checking that it will load

    Loading uses `weights_only=True` (tensors, numbers, strings, and lists,
    tuples and dicts of them); a value it would refuse is refused now, while the
    training state that produced it still exists.
    """
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"{what} must hold only tensors, numbers, strings and lists, tuples or "
            f"dicts of them: {str(error).splitlines()[0]}"
        ) from None
    file.write_bytes(buffer.getvalue())
    fsync_path(file)


def rng_state(device: torch.device) -> dict:
    """Every RNG a training step may draw from, as `weights_only`-loadable values."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), position, has_gauss, gauss),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position,
                         has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def rank_tensors(chunks: Sequence[Chunk], optimizer) -> dict[str, torch.Tensor]:
    """
    #### This rank's shards, on the host

    Device-to-host copies (host sync on CUDA); CPU shards are not copied.
    """
    tensors = {}
    # `i` is the position in `model.chunks`: `spec.index` restarts in each
    # `Zero3Layer`'s own layout
    for i, chunk in enumerate(chunks):
        # [S] chunk dtype
        tensors[f"{i}.param"] = chunk.shard.detach().cpu()
        master = master_of(optimizer, chunk)
        if master is not None:
            # [S] fp32
            tensors[f"{i}.master"] = master.detach().cpu()
        state = optimizer_state(optimizer, chunk)
        if state is not None:
            for kind in MOMENTS:
                # [S] fp32
                tensors[f"{i}.{kind}"] = state[kind].detach().cpu()
    return tensors


def manifest_of(chunks: Sequence[Chunk], optimizer, world_size: int,
                save_id: str) -> dict:
    """### The layout, as rank 0 sees it (every rank has the same)"""
    shapes = model_shapes(chunks)
    described = []
    for chunk in chunks:
        state = optimizer_state(optimizer, chunk)
        described.append({
            "numel": chunk.numel,
            "dtype": dtype_name(chunk.dtype),
            "trainable": chunk.trainable,
            "step": None if state is None else int(state["step"]),
            "has_master": master_of(optimizer, chunk) is not None,
            "params": [
                {"name": name, "shape": list(param.shape), "offset": slot.offset}
                for name, param, slot in zip(chunk.names, chunk.params,
                                             chunk.spec.slots)
            ],
        })
    return {
        "format": FORMAT,
        "save_id": save_id,
        "world_size": world_size,
        "fingerprint": fingerprint(shapes),
        "chunks": described,
        "param_groups": group_hyperparameters(optimizer),
    }


def swap_into_place(tmp: Path, path: Path, save_id: str) -> None:
    """#### The only moment `path` changes; see Note: atomic save"""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{save_id}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    fsync_path(path.parent)
    if old is not None:
        shutil.rmtree(old)


def check_replaceable(path: Path) -> None:
    """Refuse to replace a directory that is not a checkpoint (a home directory...)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a checkpoint directory")
    if any(path.iterdir()) and not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path} exists and is not a checkpoint (no {MANIFEST}); "
                              "refusing to replace it")


# ## Saving


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, *,
                    extra: dict | None = None, rank_extra: Any = None) -> Path:
    """
    ## Save a sharded checkpoint

    Called by every rank, between training steps.

    * `model` is a `Zero3Sequential` or `ShardedModel`.
    * `optimizer` is the `AdamFP16` over its shards, or `None` for the weights only.
    * `extra` is global state, passed by every rank and written by rank 0 (a loss
      scaler's `state_dict()`, the data position); `rank_extra` is this rank's own.

    Returns `path` once the checkpoint is complete there on every rank.
    """
    path = Path(path)
    comm: Communicator = model.runtime.comm
    chunks = model.chunks
    rank = comm.rank
    save_id = agree_save_id(comm)
    tmp = path.parent / f".{path.name}.tmp-{save_id}"

    def prepare() -> None:
        if rank == 0:
            check_replaceable(path)
            tmp.mkdir(parents=True)

    def write_rank_files() -> None:
        write_tensors(rank_tensors(chunks, optimizer), tmp / tensors_file(rank),
                      metadata={"save_id": save_id, "rank": str(rank)})
        write_checked_pickle({"rng": rng_state(comm.device), "extra": rank_extra},
                             tmp / rank_state_file(rank), what="rank_extra")
        if rank == 0 and extra is not None:
            write_checked_pickle(extra, tmp / EXTRA, what="extra")

    def finish() -> None:
        if rank != 0:
            return
        manifest = manifest_of(chunks, optimizer, comm.world_size, save_id)
        names = [f(r) for r in range(comm.world_size)
                 for f in (tensors_file, rank_state_file)]
        if extra is not None:
            names.append(EXTRA)
        manifest["files"] = {name: (tmp / name).stat().st_size for name in names}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        swap_into_place(tmp, path, save_id)

    try:
        # barrier: the directory exists before anyone writes into it
        run_agreed(comm, prepare, "save")
        run_agreed(comm, write_rank_files, "save")
        # barrier: no rank returns before the checkpoint is at `path`
        run_agreed(comm, finish, "save")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def run_agreed(comm: Communicator, fn: Callable[[], None], what: str) -> None:
    error = None
    try:
        fn()
    except Exception as caught:
        error = caught
    agree(comm, error, what)


# ## Loading


@dataclass
class LoadedCheckpoint:
    """
    ## What `load_checkpoint` returns

    * `extra`: the global `extra` that was saved, or `None`.
    * `rank_extra`: this rank's, or `None` when the world size changed.
    * `world_size`: the world size at save time.
    * `resharded`: whether the layout (world size or chunks) changed.
    """

    extra: dict | None
    rank_extra: Any
    world_size: int
    resharded: bool


@dataclass
class ShardState:
    """One chunk's new shard, read into host memory before anything is changed."""

    param: torch.Tensor
    """[S] chunk dtype"""
    master: torch.Tensor | None
    """[S] fp32, when the chunk is trainable and not fp32"""
    moments: dict[str, torch.Tensor] | None
    """`exp_avg`, `exp_avg_sq`: [S] fp32, when the checkpoint has a state"""
    step: int | None


def shard_overlaps(chunk: Chunk) -> Iterator[tuple[str, int, int, int]]:
    """
    #### The part of each parameter in this rank's shard

    Yields `(name, a, b, at)`: parameter elements $[a, b)$ go to shard position
    `at`.
    """
    lo, hi = chunk.shard_offset, chunk.shard_offset + chunk.shard_numel
    for name, slot in zip(chunk.names, chunk.spec.slots):
        start, end = max(slot.offset, lo), min(slot.end, hi)
        if start < end:
            yield name, start - slot.offset, end - slot.offset, start - lo


def read_shard(reader: CheckpointReader, chunk: Chunk, with_state: bool) -> ShardState:
    """### Fill one chunk's new shard from the old ranks' files"""
    overlaps = list(shard_overlaps(chunk))
    # [S] chunk dtype; zeros, so padding stays zero
    param = torch.zeros(chunk.shard_numel, dtype=chunk.dtype)
    for name, a, b, at in overlaps:
        # the saved 16-bit copy when the dtype matches (exact), else the master
        kind = "param" if reader.dtype(name) == chunk.dtype else "master"
        param[at : at + b - a] = reader.read(name, kind, a, b)

    step = None
    if with_state and chunk.trainable:
        steps = {reader.step(name) for name in chunk.names}
        if len(steps) > 1:
            # a layout change merged chunks that were saved at different steps
            # (or a parameter that was frozen): AdamFP16 has one step per shard
            raise CheckpointError(
                f"the chunk holding {chunk.names[0]!r} mixes parameters saved at "
                f"optimizer steps {sorted(steps, key=str)}; load without the optimizer"
            )
        step = steps.pop()
    has_state = step is not None

    def gather(kind: str) -> torch.Tensor:
        # [S] fp32
        out = torch.zeros(chunk.shard_numel, dtype=torch.float32)
        for name, a, b, at in overlaps:
            out[at : at + b - a] = reader.read(name, kind, a, b)
        return out

    master = None
    if chunk.trainable and chunk.dtype != torch.float32:
        master = gather("master")
    moments = {kind: gather(kind) for kind in MOMENTS} if has_state else None
    return ShardState(param, master, moments, step)


def install_shard(chunk: Chunk, state: ShardState, optimizer,
                  optimized: set[int]) -> None:
    """
    ### Put a read shard into the model and the optimizer

    An fp32 chunk's master is the shard itself, as AdamFP16 keeps it. A chunk
    without a saved state gets its master as `master_init`, which AdamFP16 takes
    at its first step, and loses any state it had. `optimized` holds the ids of
    the tensors the optimizer updates.
    """
    # where the optimizer keeps this shard's state: host memory when offloaded
    device = (optimizer.state_device(chunk.shard)
              if hasattr(optimizer, "state_device") else chunk.comm.device)
    # a resident chunk's gathered copy would no longer match the loaded shard
    chunk.release(force=True)
    with torch.no_grad():
        chunk.shard.detach().copy_(state.param)
    chunk.zero_grad()
    if not chunk.trainable:
        return
    if hasattr(chunk.shard, "master_init"):
        del chunk.shard.master_init
    master = (chunk.shard.data if chunk.dtype == torch.float32
              else state.master.to(device))
    in_optimizer = id(chunk.shard) in optimized
    if state.moments is not None and in_optimizer:
        optimizer.state[chunk.shard] = {
            "step": state.step,
            "master": master,
            **{kind: t.to(device) for kind, t in state.moments.items()},
        }
        return
    if in_optimizer:
        optimizer.state.pop(chunk.shard, None)
    if chunk.dtype != torch.float32:
        chunk.shard.master_init = master


def restore_groups(optimizer, groups: list[dict]) -> None:
    for group, saved in zip(optimizer.param_groups, groups):
        for key, value in saved.items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def same_layout(reader: CheckpointReader, chunks: Sequence[Chunk],
                world_size: int) -> bool:
    if reader.world_size != world_size or len(reader.chunks) != len(chunks):
        return False
    return all(
        saved["numel"] == chunk.numel
        and [p["name"] for p in saved["params"]] == chunk.names
        and [p["offset"] for p in saved["params"]] == [s.offset for s in
                                                       chunk.spec.slots]
        for saved, chunk in zip(reader.chunks, chunks)
    )


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, *,
                    restore_rng: bool = True) -> LoadedCheckpoint:
    """
    ## Load a sharded checkpoint, at any world size

    Called by every rank, between steps, on a model built like the saved one (the
    same parameter names and shapes; any world size and chunk size).

    1. every rank reads the manifest, checks the model's fingerprint and every
       file, and reads its new shards into host memory;
    2. the ranks agree that all of them succeeded; until then nothing in the
       model or the optimizer has changed;
    3. the shards, masters and moments are copied in, the optimizer's
       hyperparameters restored, and, at the saved world size, the RNG states.
    """
    comm: Communicator = model.runtime.comm
    chunks = model.chunks
    read: list[ShardState] = []
    reader: CheckpointReader | None = None
    small: dict[str, Any] = {}

    def read_all() -> None:
        nonlocal reader
        if any(c.state is not ChunkState.SHARDED for c in chunks):
            raise CheckpointError("load_checkpoint must be called between steps, "
                                  "with every chunk sharded")
        reader = CheckpointReader(path)
        reader.check_model(model_shapes(chunks))
        groups = reader.manifest["param_groups"]
        if optimizer is not None and groups is not None and len(groups) != len(
            optimizer.param_groups
        ):
            raise CheckpointError(f"checkpoint {reader.path} has {len(groups)} "
                                  f"optimizer param groups, the optimizer "
                                  f"{len(optimizer.param_groups)}")
        read.extend(read_shard(reader, chunk, optimizer is not None)
                    for chunk in chunks)
        small["extra"] = reader.extra()
        if reader.world_size == comm.world_size:
            small["rank"] = reader.rank_state(comm.rank)

    run_agreed(comm, read_all, "load")
    optimized = set() if optimizer is None else {
        id(p) for group in optimizer.param_groups for p in group["params"]
    }
    for chunk, state in zip(chunks, read):
        install_shard(chunk, state, optimizer, optimized)
    groups = reader.manifest["param_groups"]
    if optimizer is not None and groups is not None:
        restore_groups(optimizer, groups)
    rank_state = small.get("rank")
    if rank_state is not None and restore_rng:
        set_rng_state(rank_state["rng"], comm.device)
    return LoadedCheckpoint(
        extra=small["extra"],
        rank_extra=None if rank_state is None else rank_state["extra"],
        world_size=reader.world_size,
        resharded=not same_layout(reader, chunks, comm.world_size),
    )
