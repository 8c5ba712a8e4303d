r"""
---
title: Exporting a sharded model
summary: Every parameter, whole, gathered one chunk at a time and streamed to a
  file or an exporter, without any rank holding the model on its device; or
  read from a saved checkpoint one tensor at a time, with no process at all.
---

# Exporting a sharded model

A [sharded checkpoint](index.html) is for resuming; other tools want one
tensor per parameter under the original model's names (a Hugging Face
directory, say). Gathering the whole model would cost the device memory that
ZeRO-3 exists to avoid, so the export goes **one chunk at a time**, and the
consumer sees a stream of `(name, tensor)`.

With [hybrid sharding](../hybrid.html) every shard group holds the same
shards, so, as for a [save](save.html), the first group alone gathers and one
rank of the world writes (see Note: one writer in the world).

A checkpoint already saved needs no ranks: `saved_tensors` streams the same
pairs out of the ranks' files.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ...files import atomic_file
from ..communication import Communicator
from ..hybrid import ReplicaGroup
from ..transport import HybridReduce
from .agreement import agree
from .format import DTYPES, SAFETENSORS_DTYPES, CheckpointError, tensors_file
from .reader import CheckpointReader
from .save import write_tensors
from .state import weight_of

__all__ = ["consolidated_tensors", "export_full_state_dict", "prefix_rename",
           "saved_tensors", "writes_export"]


# ## Note: one writer in the world
#
# With hybrid sharding `comm.rank` is a rank's place in its shard group, so
# "rank 0" is one rank in *each* group: each would gather the same chunks and
# write the same directory, and their renames race. So only the first shard
# group (replica rank 0) exports; the other groups skip the gathers, which run
# inside each group, and learn the outcome from their replica in the first,
# as a [save](save.html) does (`agree_with_replicas`). The one writer is
# rank 0 of the first group, world rank 0.


def replica_group(model) -> ReplicaGroup | None:
    """
    #### The model's replica group, or `None` without hybrid sharding

    A model has its transports'; a view of some trainable chunks (the adapter
    export's `TrainableOnly`) has the one their reductions average over.
    """
    transports = getattr(model, "transports", None)
    if transports is not None:
        return transports.replicas
    return next((chunk.reduction.replicas for chunk in model.chunks
                 if isinstance(chunk.reduction, HybridReduce)), None)


def in_first_group(model) -> bool:
    """Whether this rank's shard group is the one that exports."""
    replicas = replica_group(model)
    return replicas is None or replicas.rank == 0


def writes_export(model) -> bool:
    """
    ### Whether this rank is the export's one writer

    Rank 0 of the first shard group (see Note: one writer in the world); what
    only the writer needs (a tokenizer to copy beside the weights) is read
    where this is true.
    """
    return model.runtime.comm.rank == 0 and in_first_group(model)


def consolidated_tensors(model: nn.Module, optimizer=None, *,
                         rename: Callable[[str], str] | None = None,
                         dtype: torch.dtype | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    r"""
    ## Every parameter, whole, one chunk at a time

    Every rank must run the iterator to its end (each chunk is an all-gather);
    only the writer (`writes_export`) gets the `(name, tensor)` pairs, on the
    host, in chunk order, and a slow consumer keeps the other ranks waiting in
    the next all-gather. With hybrid sharding the shard groups but the first
    gather nothing and get nothing (see Note: one writer in the world). Module
    buffers are not exported (the engine does not shard them).

    * `optimizer`: where the fp32 masters are; without it, bf16/fp16 chunks
      export their own values (or `master_init`, before the first step).
      A `"bf16-kahan"` optimizer keeps no master: its chunks export the
      weight its updates continue from, $w + c$ in fp32 (`weight_of`).
    * `rename` maps a qualified name to the exported one (see `prefix_rename`).
    * `dtype` casts every tensor, e.g. to bf16 for a release. Cast to bf16,
      $w + c$ rounds to $w$ itself but at a tie (where $|c|$ is exactly half
      a step of $w$ and $w$ is odd), where rounding to nearest even gives the
      other neighbour, as near to $w + c$: the rounding a master gets.

    Memory per rank: one gathered chunk on the device, $C$ elements in the
    master's or the parameter's dtype, for the duration of one all-gather,
    and $S$ more where the shard or its master is on the host. On
    the writer's host, one chunk plus whatever the consumer keeps: everything, $\Psi$
    elements, when the target is a single file.
    """
    comm: Communicator = model.runtime.comm
    if not in_first_group(model):
        return  # its replicas in the first group export the same shards
    writer = writes_export(model)
    for chunk in model.chunks:
        # 1. Every rank contributes its shard of the chunk: the fp32 master, or
        # $w + c$, where one exists (more exact than the bf16/fp16 copy: that
        # is what training would continue from), else the parameter shard.
        master = weight_of(optimizer, chunk)
        # [S] fp32 master or chunk dtype, on the device: an offloaded master
        # or shard is on the host, which NCCL's all-gather refuses to read
        source = (master if master is not None else chunk.shard).detach()
        source = source.to(comm.device)
        # 2. One all-gather builds the chunk's $C$ elements on every rank's
        # device: [C], one chunk on the device at a time.
        full = torch.empty(chunk.numel, dtype=source.dtype, device=comm.device)
        comm.all_gather(full, source)
        del source
        if not writer:
            continue
        # 3. The writer copies it to host memory and the device buffer is freed.
        # [C] host sync: device-to-host copy
        host = full.cpu()
        del full
        # 4. The writer yields each of the chunk's parameters, `(name, tensor)`, in
        # chunk order; a copy, not a view: safetensors refuses tensors that share
        # memory.
        for name, param, slot in zip(chunk.names, chunk.params, chunk.spec.slots):
            tensor = host[slot.offset : slot.end].view(param.shape).clone()
            if dtype is not None:
                tensor = tensor.to(dtype)
            yield (rename(name) if rename else name), tensor


def prefix_rename(prefixes: Sequence[str]) -> Callable[[str], str]:
    """
    ### Names of a `Zero3Sequential` to names of the original model

    A `Zero3Sequential` names parameters `"<layer index>.<name in layer>"`;
    this maps them to `prefixes[layer index] + name in layer`, e.g. with
    `prefixes = [hf_prefix(layer) for layer in layers]` for GPT-NeoX.
    """

    def rename(name: str) -> str:
        index, _, rest = name.partition(".")
        if not index.isdigit() or int(index) >= len(prefixes):
            raise ValueError(f"{name!r} does not start with a layer index below "
                             f"{len(prefixes)}")
        return prefixes[int(index)] + rest

    return rename


def export_full_state_dict(target: str | os.PathLike | Callable, model: nn.Module,
                           optimizer=None, *,
                           rename: Callable[[str], str] | None = None,
                           dtype: torch.dtype | None = None) -> Any:
    """
    ## Export the whole model

    Called by every rank; one writes, rank 0 of the first shard group (see
    Note: one writer in the world). `target` is either

    * a file path: the writer writes one safetensors file atomically
      (temporary file, `fsync`, rename); it holds the whole model in host
      memory to do so;
    * or a callable: the writer calls it with the `(name, tensor)` iterator and
      may stream it (`save_hf_checkpoint` holds one output shard at a time);
      its result is returned on the writer.

    Other ranks return `None` once the export is complete; if it failed
    anywhere, every rank raises. The consumer can write each tensor as it
    comes, as the [GPT-NeoX exporter](../../neox/hf_checkpoint.html) does,
    holding one output shard at a time:

    ```python
    rename = prefix_rename([hf_prefix(layer) for layer in layers])
    export_full_state_dict(
        lambda tensors: save_hf_checkpoint(out_dir, config, tensors),
        model, optimizer, rename=rename,
    )
    ```
    """
    comm: Communicator = model.runtime.comm
    tensors = consolidated_tensors(model, optimizer, rename=rename, dtype=dtype)
    result = None
    error = None
    try:
        if writes_export(model):
            if callable(target):
                result = target(tensors)
            else:
                write_one_file(Path(target), dict(tensors))
    except Exception as caught:
        error = caught
    # A consumer that stopped early (or failed) must not strand the other
    # ranks in the remaining all-gathers. A slow one keeps them waiting in the
    # next all-gather, bounded by the process group's timeout.
    for _ in tensors:
        pass
    agree_with_replicas(comm, replica_group(model), error, "export")
    return result


def agree_with_replicas(comm: Communicator, replicas: ReplicaGroup | None,
                        error: BaseException | None, what: str) -> None:
    """
    #### `agree` in the first shard group, then across the replicas

    The first group's ranks agree among themselves; each other rank learns the
    outcome from its replica there (one flag, summed across the replica
    group), so a failure raises on every rank of the world, as after a
    [save](save.html). The other groups did nothing, so fail nothing.
    """
    if replicas is None:
        agree(comm, error, what)
        return
    if replicas.rank == 0:
        try:
            agree(comm, error, what)
        except Exception as caught:
            error = caught
    # [1] int32: did the first group's export fail? summed across the replicas
    failed = torch.tensor([int(error is not None)], dtype=torch.int32,
                          device=comm.device)
    replicas.all_reduce_sum(failed)
    if error is not None:
        raise error
    # host sync: .item()
    if failed.item():
        raise CheckpointError(f"{what} failed in the first shard group; see its "
                              "error")


def write_one_file(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, written as on [atomic files](../../files.html)."""
    with atomic_file(file) as tmp:
        # metadata {"format": "pt"} is what transformers checks for on load
        write_tensors(tensors, tmp, metadata={"format": "pt"})


# ## Reading a saved checkpoint, one tensor at a time
#
# #### Note: why not map the files
#
# `CheckpointReader` reads through `safe_open`, which maps a whole rank file;
# every page a slice touches stays resident in the process while the file is
# open, so streaming a whole checkpoint through it would end with the
# checkpoint's size in the converter's resident memory. Here each slice is
# read (`readinto`, straight into the output tensor) at the offsets the
# safetensors header gives (8 bytes of
# little-endian header length, the JSON header, then the data; a tensor's
# `data_offsets` count from the data's start): memory is the tensor being
# assembled, nothing else, and the page cache is the kernel's to drop.


def safetensors_header(file) -> tuple[int, dict]:
    """The data's start and the JSON header of a safetensors file."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return 8 + length, header


def saved_tensors(reader: CheckpointReader, *,
                  rename: Callable[[str], str] | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    r"""
    ## Every saved parameter, whole, one at a time

    No ranks are needed, and an offline converter holds one tensor plus what
    its consumer keeps (see Note: why not map the files).

    Yields `(name, tensor)` in chunk order, each in the chunk's dtype or, where
    the checkpoint has one, from its fp32 master (the values training would
    continue from), as `consolidated_tensors` does for a live model; a
    `"bf16-kahan"` checkpoint's chunks, which keep no master, give $w + c$
    in fp32, the parameter plus its compensation (as [the
    reader](reader.html) reads their master), assembled from two bf16
    tensors of the parameter's size, $w$ and $c$. Every
    file's digest is checked first (one streamed read of each, `verify_files`).
    A parameter at offset $o$ of a chunk whose ranks hold $S$ elements each is
    read from ranks $\lfloor o/S \rfloor \ldots \lfloor (o+n-1)/S \rfloor$, as
    on [reading a sharded checkpoint](reader.html).
    """
    reader.verify_files()
    headers = [safetensors_header(reader.path / tensors_file(rank))
               for rank in range(reader.world_size)]
    for index, chunk in enumerate(reader.chunks):
        stored = "master" if chunk["has_master"] else "param"
        dtype = DTYPES[chunk["dtype"]] if stored == "param" else torch.float32
        shard = chunk["numel"] // reader.world_size
        for saved in chunk["params"]:
            lo = saved["offset"]
            hi = lo + math.prod(saved["shape"])
            name = saved["name"]
            # [n] saved dtype, filled one rank's slice at a time
            out = torch.empty(hi - lo, dtype=dtype)
            read_range(reader, headers, f"{index}.{stored}", shard, lo, out)
            if reader.adds_compensation(name):
                out = add_compensation(reader, headers, index, shard, lo, out)
            yield (rename(name) if rename else name), out.view(saved["shape"])


# Elements of $c$ widened at a time while it is added (`add_compensation`).
ADD_NUMEL = 2**20


def add_compensation(reader: CheckpointReader, headers: list[tuple[int, dict]],
                     index: int, shard: int, lo: int,
                     weight: torch.Tensor) -> torch.Tensor:
    r"""
    #### $w + c$ in fp32, from the weight $w$ as read and its saved $c$

    (the reader's Note: the master of a compensated weight). The sum is
    widened from $w$ first; $c$ is then read into $w$'s buffer, which the sum
    no longer needs, and added `ADD_NUMEL` elements at a time, since the add
    widens the operand it reads into a temporary of its size. So a bf16
    weight holds its own bytes and its fp32 sum's at most, not also a second
    bf16 tensor and an fp32 copy of the whole of it.
    """
    low_dtype = DTYPES[reader.states["dtypes"][reader.compensation]]
    wide = weight.float()  # [n] fp32; `weight` itself if it is fp32
    low = weight if low_dtype == weight.dtype else torch.empty(
        weight.numel(), dtype=low_dtype)
    read_range(reader, headers, f"{index}.{reader.compensation}", shard, lo, low)
    for start in range(0, low.numel(), ADD_NUMEL):
        wide[start:start + ADD_NUMEL].add_(low[start:start + ADD_NUMEL])
    return wide


def read_range(reader: CheckpointReader, headers: list[tuple[int, dict]],
               key: str, shard: int, lo: int, out: torch.Tensor) -> None:
    """
    #### Chunk elements `[lo, lo + len(out))` of tensor `key`, into `out`

    Read from the rank files that hold them, each slice straight into `out`
    (`readinto`); `shard` is the elements a rank holds of the chunk.
    """
    hi = lo + out.numel()
    for rank in range(lo // shard, (hi - 1) // shard + 1) if hi > lo else ():
        first, last = max(lo, rank * shard), min(hi, (rank + 1) * shard)
        start, header = headers[rank]
        file = reader.path / tensors_file(rank)
        entry = header.get(key)
        if entry is None or entry["dtype"] != SAFETENSORS_DTYPES[out.dtype] \
                or entry["shape"] != [shard]:
            raise CheckpointError(f"corrupted shard file {file}: tensor "
                                  f"{key!r} is not [{shard}] {out.dtype}")
        skip = (first - rank * shard) * out.dtype.itemsize
        # [last − first] bytes of `out`, which the read fills in place
        view = out[first - lo:last - lo].view(torch.uint8).numpy()
        with open(file, "rb") as f:
            f.seek(start + entry["data_offsets"][0] + skip)
            got = f.readinto(memoryview(view))
        if got != view.nbytes:
            raise CheckpointError(f"corrupted shard file {file}: tensor "
                                  f"{key!r} is cut short")
