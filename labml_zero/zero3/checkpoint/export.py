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
from .agreement import agree
from .format import DTYPES, SAFETENSORS_DTYPES, CheckpointError, tensors_file
from .reader import CheckpointReader
from .save import write_tensors
from .state import weight_of

__all__ = ["consolidated_tensors", "export_full_state_dict", "prefix_rename",
           "saved_tensors"]


def consolidated_tensors(model: nn.Module, optimizer=None, *,
                         rename: Callable[[str], str] | None = None,
                         dtype: torch.dtype | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    r"""
    ## Every parameter, whole, one chunk at a time

    Every rank must run the iterator to its end (each chunk is an all-gather);
    only rank 0 gets the `(name, tensor)` pairs, on the host, in chunk order,
    and a slow consumer keeps the other ranks waiting in the next all-gather.
    Module buffers are not exported (the engine does not shard them).

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
    master's or the parameter's dtype, for the duration of one all-gather. On
    rank 0's host, one chunk plus whatever the consumer keeps: everything, $\Psi$
    elements, when the target is a single file.
    """
    comm: Communicator = model.runtime.comm
    for chunk in model.chunks:
        # 1. Every rank contributes its shard of the chunk: the fp32 master, or
        # $w + c$, where one exists (more exact than the bf16/fp16 copy: that
        # is what training would continue from), else the parameter shard.
        master = weight_of(optimizer, chunk)
        # [S] fp32 master or chunk dtype
        source = (master if master is not None else chunk.shard).detach()
        # 2. One all-gather builds the chunk's $C$ elements on every rank's
        # device: [C], one chunk on the device at a time.
        full = torch.empty(chunk.numel, dtype=source.dtype, device=comm.device)
        comm.all_gather(full, source)
        if comm.rank != 0:
            continue
        # 3. Rank 0 copies it to host memory and the device buffer is freed.
        # [C] host sync: device-to-host copy
        host = full.cpu()
        del full
        # 4. Rank 0 yields each of the chunk's parameters, `(name, tensor)`, in
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

    Called by every rank. `target` is either

    * a file path: rank 0 writes one safetensors file atomically (temporary file,
      `fsync`, rename); it holds the whole model in host memory to do so;
    * or a callable: rank 0 calls it with the `(name, tensor)` iterator and may
      stream it (`save_hf_checkpoint` holds one output shard at a time); its
      result is returned on rank 0.

    Other ranks return `None` once the export is complete. The consumer can
    write each tensor as it comes, as the [GPT-NeoX
    exporter](../../neox/hf_checkpoint.html) does, holding one output shard at a
    time:

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
        if comm.rank == 0:
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
    agree(comm, error, "export")
    return result


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
