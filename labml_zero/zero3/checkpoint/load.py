r"""
---
title: Loading a sharded checkpoint
summary: Every rank reads its new shards from the saved ranks' files, at any world
  size and chunk size, and changes nothing until every rank has succeeded.
---

# Loading a sharded checkpoint

A load fills each chunk's new shard, on each new rank, with exactly the
elements it held when saved: the bf16/fp16 parameter, the fp32 master and both
moments, copied, never recomputed: the resume is bit-exact at the saved world
size (see [what a resume needs](state.html)); at another one the next steps
differ only by the order in which gradients are summed over ranks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..chunk import Chunk
from ..communication import Communicator
from ..state_layout import ShardOptimizer
from .agreement import run_agreed
from .format import DTYPES, CheckpointError
from .reader import CheckpointReader
from .state import model_shapes, restore_groups, set_rng_state

__all__ = ["LoadedCheckpoint", "load_checkpoint"]


@dataclass
class LoadedCheckpoint:
    """
    ## What `load_checkpoint` returns

    * `extra`: the global `extra` that was saved, or `None`.
    * `rank_extra`: this rank's, or `None` when the world size changed.
    * `world_size`: the world size at save time.
    * `resharded`: whether the layout (world size or chunks) changed.
    * `converted`: the line that said the optimizer's states were converted
      from another [state layout](../state_layout.html), or `None`.
    """

    extra: dict | None
    rank_extra: Any
    world_size: int
    resharded: bool
    converted: str | None = None


@dataclass
class ShardState:
    """One chunk's new shard, read into host memory before anything is changed."""

    param: torch.Tensor
    """[S] chunk dtype"""
    master: torch.Tensor | None
    """[S] fp32, when the chunk is trainable and not fp32"""
    moments: dict[str, torch.Tensor] | None
    """`exp_avg`, `exp_avg_sq`: [S] in the saved dtype, when the checkpoint has
    a state"""
    step: int | None


# ## Reading a new shard
#
# On the host, the new shards, masters and moments, read slice by slice; on the
# device the new masters and moments replace the old ones.


def shard_overlaps(chunk: Chunk) -> Iterator[tuple[str, int, int, int]]:
    """
    #### The part of each parameter in this rank's shard

    Yields `(name, a, b, at)`: parameter elements $[a, b)$ go to shard position
    `at`. At the saved world size and layout the elements are each rank's own
    file's; at another world size $N_d'$ (or another chunk size) each new shard
    overlaps parts of the old ones, and [the reader](reader.html) finds them
    with one piece of arithmetic.
    """
    lo, hi = chunk.shard_offset, chunk.shard_offset + chunk.shard_numel
    for name, slot in zip(chunk.names, chunk.spec.slots):
        start, end = max(slot.offset, lo), min(slot.end, hi)
        if start < end:
            yield name, start - slot.offset, end - slot.offset, start - lo


def read_shard(reader: CheckpointReader, chunk: Chunk, with_state: bool) -> ShardState:
    """
    ### Fill one chunk's new shard from the old ranks' files

    A chunk of the new layout must hold parameters saved at one optimizer step
    (AdamFP16 keeps one step per shard); otherwise load without the optimizer.
    """
    overlaps = list(shard_overlaps(chunk))
    # [S] chunk dtype; zeros, so padding stays zero
    param = torch.zeros(chunk.shard_numel, dtype=chunk.dtype)
    for name, a, b, at in overlaps:
        # the saved bf16/fp16 copy when the dtype matches (exact), else the master
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
        # [S] fp32 for the master (the saved one, else the parameter
        # widened, plus its compensation where one was saved: the reader's
        # Note: the master of a compensated weight), else the saved dtype: a
        # conversion is the optimizer's, once
        dtype = (torch.float32 if kind == "master"
                 else DTYPES[reader.states["dtypes"][kind]])
        out = torch.zeros(chunk.shard_numel, dtype=dtype)
        for name, a, b, at in overlaps:
            out[at : at + b - a] = reader.read(name, kind, a, b)
        return out

    master = None
    if chunk.trainable and chunk.dtype != torch.float32:
        master = gather("master")
    moments = ({kind: gather(kind) for kind in reader.moments} if has_state
               else None)
    return ShardState(param, master, moments, step)


# ## Installing it


def install_shard(chunk: Chunk, state: ShardState,
                  optimizer: ShardOptimizer | None, optimized: set[int]) -> None:
    """
    ### Put a read shard into the model and the optimizer

    An fp32 chunk's master is the shard itself, as AdamFP16 keeps it. A chunk
    without a saved state gets its master as `master_init`, which AdamFP16 takes
    at its first step, and loses any state it had. `optimized` holds the ids of
    the tensors the optimizer updates.
    """
    # where the optimizer keeps this shard's state: host memory when offloaded
    device = (chunk.comm.device if optimizer is None
              else optimizer.state_device(chunk.shard))
    # a resident chunk's gathered copy would no longer match the loaded shard
    chunk.release(force=True)
    with torch.no_grad():
        chunk.shard.detach().copy_(state.param)
    chunk.zero_grad()
    if not chunk.trainable:
        return
    chunk.local.set_master_init(None)
    master = (chunk.shard.data if chunk.dtype == torch.float32
              else state.master.to(device))
    in_optimizer = id(chunk.shard) in optimized
    if state.moments is not None and in_optimizer:
        # each moment as saved; the optimizer converts it to its layout (a
        # cast, or 8-bit codes decoded or encoded, see `load_shard_state`)
        optimizer.load_shard_state(chunk.shard, {
            "step": state.step,
            "master": master,
            **{kind: t.to(device) for kind, t in state.moments.items()},
        })
        return
    if in_optimizer:
        optimizer.load_shard_state(chunk.shard, None)
    if chunk.dtype != torch.float32:
        chunk.local.set_master_init(master)


def same_layout(reader: CheckpointReader, chunks: Sequence[Chunk],
                world_size: int) -> bool:
    """Whether every chunk has the saved size and parameters at the saved offsets."""
    if reader.world_size != world_size or len(reader.chunks) != len(chunks):
        return False
    return all(
        saved["numel"] == chunk.numel
        and [p["name"] for p in saved["params"]] == chunk.names
        and [p["offset"] for p in saved["params"]] == [s.offset for s in
                                                       chunk.spec.slots]
        for saved, chunk in zip(reader.chunks, chunks)
    )


# ## Loading


def states_conversion(reader: CheckpointReader,
                      optimizer: ShardOptimizer | None) -> str | None:
    """
    #### The line that says a load converts the optimizer's states, or `None`

    A checkpoint saved with one [state layout](../state_layout.html) resumes
    an optimizer built with another: each state is cast once, as it is
    installed (fp32 to bf16 rounds to nearest even; bf16 to fp32 is exact;
    8-bit moments are decoded, or encoded block by block; a compensation is
    made from the master, or added to it).
    The resume is then not bit-exact with a run that kept either layout.
    """
    saved = reader.states
    if optimizer is None or saved["dtypes"] == optimizer.layout.dtypes:
        return None
    if all(chunk["step"] is None for chunk in reader.chunks):
        return None
    # a master is always there to read: the saved one, else the parameter
    # (an 8-bit moment's scales are made when it is encoded, a compensation
    # from the master)
    missing = ({t.name for t in optimizer.layout.moments
                if t.block is None and not t.compensation}
               - set(saved["dtypes"]))
    if missing:
        raise CheckpointError(
            f"checkpoint {reader.path} has optimizer states "
            f"{', '.join(saved['dtypes'])}; the optimizer's {optimizer.layout.name!r}"
            f" layout also needs {', '.join(sorted(missing))}")
    return (f"checkpoint {reader.path}: optimizer states saved as "
            f"{saved['name']!r}, converted once to {optimizer.layout.name!r}")


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: ShardOptimizer | None = None, *,
                    restore_rng: bool = True) -> LoadedCheckpoint:
    """
    ## Load a sharded checkpoint, at any world size

    Called by every rank, between steps, on a model built like the saved one (the
    same parameter names and shapes; any world size and chunk size).

    The load is in three phases:

    1. every rank reads the manifest, checks the model's fingerprint and every file
       it needs (size, digest, header), and reads its new shards into host memory;
    2. the ranks agree ([agreement between ranks](agreement.html)) that all of them
       succeeded; until then nothing in the model or the optimizer has changed;
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
        if any(c.is_gathered for c in chunks):
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
        small["converted"] = states_conversion(reader, optimizer)
        read.extend(read_shard(reader, chunk, optimizer is not None)
                    for chunk in chunks)
        small["extra"] = reader.extra()
        if reader.world_size == comm.world_size:
            small["rank"] = reader.rank_state(comm.rank)

    # phases 1 and 2: nothing below runs unless every rank read everything
    run_agreed(comm, read_all, "load")
    optimized = set() if optimizer is None else {
        id(p) for group in optimizer.param_groups for p in group["params"]
    }
    for chunk, state in zip(chunks, read):
        install_shard(chunk, state, optimizer, optimized)
    groups = reader.manifest["param_groups"]
    if optimizer is not None and groups is not None:
        restore_groups(optimizer, groups)
    # RNG states and `rank_extra` are restored only at the saved world size: at
    # another one there is no rank they belong to.
    converted = small["converted"]
    if converted is not None and comm.rank == 0:
        # the one line a resume across layouts says, once per job
        print(converted, file=sys.stderr, flush=True)
    rank_state = small.get("rank")
    if rank_state is not None and restore_rng:
        set_rng_state(rank_state["rng"], comm.device)
    return LoadedCheckpoint(
        extra=small["extra"],
        rank_extra=None if rank_state is None else rank_state["extra"],
        world_size=reader.world_size,
        resharded=not same_layout(reader, chunks, comm.world_size),
        converted=converted,
    )
