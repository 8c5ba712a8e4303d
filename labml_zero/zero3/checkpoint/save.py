r"""
---
title: Saving a sharded checkpoint
summary: Each rank writes its own shards in parallel, with digests, and the
  checkpoint appears at its path complete or not at all.
---

# Saving a sharded checkpoint

A ZeRO-3 rank holds $\frac{1}{N_d}$ of every chunk: its bf16/fp16 parameter shard
and, for trainable chunks, the fp32 master and the two Adam moments. A checkpoint
is those shards, one file per rank, written in parallel and never gathered.
With $\Psi_t$ trainable and $\Psi_f$ frozen elements, $p$ bytes per parameter
and $K$ bytes of optimizer state (the optimizer's
[state layout](../state_layout.html)'s, each state saved in its own dtype:
$K = 3 \cdot 4$ with fp32 states), each rank writes

$$\frac{(p + K)\,\Psi_t + p\,\Psi_f}{N_d}$$

bytes (for fp32, $K = 2 \cdot 4$: the master is the parameter).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from ...files import (fsync_path, give_default_mode, replace_directory,
                     temporary_sibling)
from ..chunk import Chunk
from ..communication import Communicator
from .agreement import agree_save_id, gather_digests, run_agreed
from .digest import file_digest
from .format import (EXTRA, FORMAT, MANIFEST, CheckpointError, dtype_name,
                     fingerprint, rank_state_file, states_entry, tensors_file)
from .state import (group_hyperparameters, master_of, model_shapes, optimizer_state,
                    rng_state)

__all__ = ["save_checkpoint"]


# ## Writing files
#
# Nothing on the device; on the host, the rank's shards (copied from the device),
# and about as much again while safetensors builds the file. Hashing streams the
# file in blocks, reading each file once more after it is written (from the page
# cache, usually), on every rank in parallel.


def write_tensors(tensors: dict[str, torch.Tensor], file: Path, *,
                  metadata: dict[str, str]) -> None:
    """One safetensors file, flushed; the tests replace it to simulate a crash.
    Hashing reads the file once more after it is written."""
    save_file(tensors, str(file), metadata=metadata)
    give_default_mode(file)  # safetensors makes it owner-only (see atomic files)
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


def check_meta(meta: dict | None) -> dict:
    """`meta` goes into the JSON manifest: refuse what JSON cannot hold, now."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"meta must hold only JSON values: {error}") from None
    return meta


# ## What each rank writes


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
            for moment in optimizer.layout.moments:
                # [S] the layout's dtype (fp32, bf16 or uint8 moments);
                # an 8-bit moment's scales [⌈S / B⌉] fp32
                tensors[f"{i}.{moment.name}"] = state[moment.name].detach().cpu()
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
        **({} if optimizer is None else {"states": states_entry(optimizer.layout)}),
    }


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
                    extra: dict | None = None, rank_extra: Any = None,
                    meta: dict | None = None) -> Path:
    """
    ## Save a sharded checkpoint

    Called by every rank, between training steps. The ranks exchange nothing
    but a few flags and their files' digests.

    * `model` is a `Zero3Sequential` or `ShardedModel`.
    * `optimizer` is the `AdamFP16` over its shards (any `ShardOptimizer`), or
      `None` for the weights only.
    * `extra` is global state, passed by every rank and written by rank 0 (a loss
      scaler's `state_dict()`, the data position); `rank_extra` is this rank's own.
    * `meta` is a dict of JSON values written into the manifest (the job's step,
      batch size, seed), for `check_resumable` to read without loading anything.

    Returns `path` once the checkpoint is complete there on every rank (see
    Note: atomic save); all ranks must see one filesystem: rank 0 sizes and
    renames every rank's file. What the files hold is [the format](format.html);
    why those pieces, [what a resume needs](state.html). Saving draws from no RNG
    (its temporary name comes from `secrets`), so the states it saves are those
    the next step would have used.

    With hybrid sharding every shard group holds the same shards, so only the
    first group writes: the checkpoint is the one a world of $N_s$ ranks would
    write (its per-rank state, RNG and `rank_extra`, that group's), and loads
    into any shape as such. The other groups wait for its outcome, which each
    rank learns from its replica of the first group.
    """
    replicas = model.transports.replicas
    if replicas is None:
        return _save_shards(path, model, optimizer, extra=extra,
                            rank_extra=rank_extra, meta=meta)
    error = None
    if replicas.rank == 0:
        try:
            _save_shards(path, model, optimizer, extra=extra,
                         rank_extra=rank_extra, meta=meta)
        except Exception as caught:
            error = caught
    # [1] int32: did the first group's save fail? summed across the replicas
    failed = torch.tensor([int(error is not None)], dtype=torch.int32,
                          device=model.runtime.comm.device)
    replicas.all_reduce_sum(failed)
    if error is not None:
        raise error
    if failed.item():
        raise CheckpointError(f"save of {path} failed in the first shard group")
    return Path(path)


def _save_shards(path, model: nn.Module, optimizer, *, extra, rank_extra,
                 meta) -> Path:
    """
    ### The save of one shard group

    #### Note: atomic save

    A crash halfway through a save must never leave at `path` something that loads:
    it would resume from half new, half old (or missing) shards. So, in the steps
    of [atomic files](../../files.html):

    1. rank 0 draws a random id and all ranks learn it from an all-reduce; rank 0
       creates `.<name>.tmp-<id>` next to `path` (same filesystem, so the final
       rename is atomic);
    2. every rank writes and `fsync`s its files there, then hashes them;
    3. the ranks agree (an all-reduce of failure flags, see [agreement between
       ranks](agreement.html)) that every write succeeded; if one failed, the
       directory is deleted and every rank raises;
    4. the digests reach rank 0 through one more all-reduce;
    5. rank 0 writes the manifest *last* (a directory without one is not a
       checkpoint), `fsync`s it and the directory, then renames the old checkpoint
       aside to `.<name>.old-<id>`, the new one to `path`, and deletes the old one.

    Between the two renames there is briefly *no* checkpoint at `path`, never a
    partial one; a crash just there leaves the old one complete at `.old-<id>`, and
    `load_checkpoint` names it. A crash that kills the process leaves a
    `.<name>.tmp-<id>` directory, which nothing loads and which may be deleted.
    """
    path = Path(path)
    comm: Communicator = model.runtime.comm
    chunks = model.chunks
    rank = comm.rank
    save_id = agree_save_id(comm)
    tmp = temporary_sibling(path, save_id)
    # this rank's file name -> digest; rank 0 also hashes `extra.pt`
    mine: dict[str, str] = {}

    def prepare() -> None:
        check_meta(meta)
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
        for name in (tensors_file(rank), rank_state_file(rank)):
            mine[name] = file_digest(tmp / name)
        if rank == 0 and extra is not None:
            mine[EXTRA] = file_digest(tmp / EXTRA)

    def finish(per_rank: list[list[str]]) -> None:
        if rank != 0:
            return
        manifest = manifest_of(chunks, optimizer, comm.world_size, save_id)
        digests = {f(r): per_rank[r][i] for r in range(comm.world_size)
                   for i, f in enumerate((tensors_file, rank_state_file))}
        if extra is not None:
            digests[EXTRA] = mine[EXTRA]
        manifest["files"] = {name: (tmp / name).stat().st_size for name in digests}
        manifest["digests"] = digests
        manifest["meta"] = check_meta(meta)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        # The only moment `path` changes
        replace_directory(tmp, path, save_id)

    try:
        # barrier: the directory exists before anyone writes into it
        run_agreed(comm, prepare, "save")
        run_agreed(comm, write_rank_files, "save")
        # every rank wrote and hashed its files: the two per rank, in order
        per_rank = gather_digests(comm, [mine[tensors_file(rank)],
                                         mine[rank_state_file(rank)]])
        # barrier: no rank returns before the checkpoint is at `path`
        run_agreed(comm, lambda: finish(per_rank), "save")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
