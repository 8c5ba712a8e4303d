r"""
---
title: Sharded checkpoints
summary: Each rank saves its own shards; a manifest describes the layout, so a
  checkpoint resumes bit-exactly, loads at another world size, or exports whole.
---

# Sharded checkpoints

A ZeRO-3 rank holds $\frac{1}{N_d}$ of every chunk: its 16-bit parameter shard
and, for trainable chunks, the fp32 master and the two Adam moments. A checkpoint
is just those shards, one file per rank, written in parallel and never gathered:
saving costs each rank its own $\frac{(p + K)\Psi_t + p\Psi_f}{N_d}$ bytes of
disk and no communication beyond a few barriers.

## The format

A checkpoint is a directory:

```
manifest.json             rank 0: world size, chunks, parameters, optimizer groups
rank-00000.safetensors    rank r's shards: "<chunk>.param" [S] in the chunk dtype,
rank-00001.safetensors      "<chunk>.master", "<chunk>.exp_avg", "<chunk>.exp_avg_sq"
rank-00000.pt             rank r's RNG states and its `rank_extra`
extra.pt                  rank 0: the global `extra` (a loss scaler's state, say)
```

The tensors are in [safetensors](https://huggingface.co/docs/safetensors): a JSON
header then raw bytes, so a reader can map the file and copy out a slice of one
tensor without reading the rest, and loading runs no pickled code. The `.pt` files
hold small Python values (the RNG states, `extra`); they are loaded with
`weights_only=True`, which also runs no code, and `save_checkpoint` checks that
they will load before it writes them.

The manifest lists every chunk: its size $C$, dtype, whether it is trainable, its
optimizer step, and its parameters with qualified name, shape and offset. That is
the whole layout: with it, any element of any parameter can be found in the
files. It also carries a *fingerprint*, a hash of the sorted `(name, shape)`
pairs, so a checkpoint of another model is refused before anything is read.

`master` is written only when it is not the parameter itself: for a 16-bit chunk
that has an optimizer state, or whose exact fp32 initial weights the engine kept
(`master_init`, before the first step). For fp32 chunks the parameter *is* the
master. Frozen chunks have only `param`.

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
`load_checkpoint` names it. Each shard file carries the save id in its header,
so a stray file from another save is refused.

## Resharding

Loading at a different world size $N'$, or with another chunk size, is the same
arithmetic as loading at the same one. A chunk of $C$ elements split over $N$
ranks gives rank $k$ the elements $[kS, (k+1)S)$, $S = C / N$. A parameter at
offset $o$ with $n$ elements is elements $[o, o + n)$ of its chunk.

In the new model, rank $r'$ keeps elements $[r'S', (r'+1)S')$ of a chunk where
the same parameter sits at offset $o'$. It needs the parameter's elements

$$[a, b) = [\max(o', r'S') - o',\ \min(o' + n, (r'+1)S') - o'),$$

which in the saved chunk are elements $[o + a, o + b)$, held by the old ranks
$k = \lfloor (o + a) / S \rfloor, \ldots, \lfloor (o + b - 1) / S \rfloor$, rank
$k$ at local positions $[\max(o + a, kS) - kS,\ \min(o + b, (k+1)S) - kS)$. A
rank reads exactly those slices (`safe_open(...).get_slice`), parameter by
parameter, for the parameter, the master and both moments. Padding is zero in
every one of them (its gradient is zero, so Adam never moves it) and stays zero.

`CheckpointReader.read` does this for any element range, so the same code serves
loading at any world size and reading a whole tensor offline.

## Exporting the whole model

`consolidated_tensors` all-gathers one chunk at a time (the fp32 masters where
they exist, more exact than the 16-bit copy), copies it to rank 0's host memory
and frees it, then yields each of its parameters. The consumer can stream them
into files: `export_full_state_dict` writes one safetensors file, or hands the
stream to a callback such as the GPT-NeoX exporter:

```python
rename = prefix_rename([hf_prefix(layer) for layer in layers])
export_full_state_dict(
    lambda tensors: save_hf_checkpoint(out_dir, config, tensors),
    model, optimizer, rename=rename,
)
```

## Memory

| operation | device, per rank | host, per rank |
|---|---|---|
| save | nothing new | its shards, about twice (safetensors builds the bytes) |
| load | the new masters and moments replace the old | its new shards, plus one slice |
| export | one gathered chunk, $4C$ bytes | rank 0: one chunk; all of $\Psi$ for a file |

## Limitations

* All ranks must see one filesystem: rank 0 sizes and renames every rank's file.
* Tensor data has no checksum: truncation, a damaged header or a wrong size is
  caught, a flipped bit inside the data is not.
* RNG states and `rank_extra` are restored only at the saved world size: at
  another one there is no rank they belong to.
* Module buffers are not saved (the engine does not shard them); a model whose
  buffers are state (batch-norm statistics) must put them into `extra`.
* The optimizer must be built the same way (same param groups, in order); its
  hyperparameters (learning rate, betas, ...) are restored from the manifest.
* A slow export consumer keeps the other ranks waiting in the next all-gather,
  bounded by the process group's timeout.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .chunk import Chunk, ChunkState
from .communication import Communicator

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "LoadedCheckpoint",
    "consolidated_tensors",
    "export_full_state_dict",
    "load_checkpoint",
    "prefix_rename",
    "save_checkpoint",
]

FORMAT = "labml_zero.zero3.checkpoint/1"
MANIFEST = "manifest.json"
EXTRA = "extra.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}
# safetensors' dtype names, as `get_slice(...).get_dtype()` reports them
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16",
                       torch.float16: "F16"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the cause."""


def tensors_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_state_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
#
# A rank that fails alone must not leave the others waiting in a collective, nor
# let them go on with a half-loaded model: every phase ends with an all-reduce of
# one failure flag per rank, and if any is set, every rank raises.


def agree(comm: Communicator, error: BaseException | None, what: str) -> None:
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
    torch.save(value, buffer)
    try:
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


# ## Reading


@dataclass(frozen=True)
class SavedParam:
    """Where a saved parameter lives: its chunk, offset and shape."""

    name: str
    chunk: int
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class CheckpointReader:
    """
    ## A checkpoint directory, read lazily

    Construction reads the manifest and checks that every file is there with
    its recorded size; tensor files are opened (header only) when first read.
    Needs no process group: it also serves offline inspection and conversion.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.manifest = self._read_manifest()
        self.world_size: int = self.manifest["world_size"]
        self.chunks: list[dict] = self.manifest["chunks"]
        self.params: dict[str, SavedParam] = {
            p["name"]: SavedParam(p["name"], index, p["offset"], tuple(p["shape"]))
            for index, chunk in enumerate(self.chunks) for p in chunk["params"]
        }
        for name, size in self.manifest["files"].items():
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"missing shard file {file}")
            if file.stat().st_size != size:
                raise CheckpointError(
                    f"corrupted shard file {file}: {file.stat().st_size} bytes, "
                    f"the manifest says {size}"
                )
        # rank -> (open safetensors file, its tensor names)
        self._open: dict[int, tuple[Any, set[str]]] = {}

    def _read_manifest(self) -> dict:
        file = self.path / MANIFEST
        if not file.is_file():
            if not self.path.exists():
                left = sorted(self.path.parent.glob(f".{self.path.name}.old-*"))
                hint = (f"; an interrupted save left the previous one at {left[0]}"
                        if left else "")
                raise CheckpointError(f"no checkpoint at {self.path}{hint}")
            raise CheckpointError(f"no {MANIFEST} in {self.path}: not a checkpoint, "
                                  "or a save that did not finish")
        try:
            manifest = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"corrupted manifest {file}: {error}") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{file} has format {manifest.get('format')!r}, "
                                  f"expected {FORMAT!r}")
        return manifest

    ### Checks

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: p.shape for name, p in self.params.items()}

    def check_model(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Refuse a model whose parameter names or shapes differ from the saved."""
        if fingerprint(shapes) != self.manifest["fingerprint"]:
            raise CheckpointError(f"checkpoint {self.path} is of a different model: "
                                  f"{first_difference(self.shapes, shapes)}")

    def chunk_of(self, name: str) -> dict:
        return self.chunks[self.params[name].chunk]

    def step(self, name: str) -> int | None:
        """The optimizer step of a parameter's chunk; `None` without state."""
        return self.chunk_of(name)["step"]

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.chunk_of(name)["dtype"]]

    ### Reading elements

    def read(self, name: str, kind: str = "master", start: int = 0,
             end: int | None = None) -> torch.Tensor:
        """
        ### Elements `[start, end)` of a saved parameter, flat, on the host

        `kind` is `param` (in the saved dtype), `master` (fp32: the saved master,
        else the parameter), `exp_avg` or `exp_avg_sq`. See "Resharding" for the
        arithmetic.
        """
        if kind not in ("param", "master", *MOMENTS):
            raise ValueError(f"kind must be param, master, exp_avg or exp_avg_sq, "
                             f"got {kind!r}")
        saved = self.params[name]
        chunk = self.chunks[saved.chunk]
        end = saved.numel if end is None else end
        if not 0 <= start <= end <= saved.numel:
            raise ValueError(f"elements [{start}, {end}) are outside parameter "
                             f"{name!r} of {saved.numel} elements")
        stored = kind
        if kind == "master" and not chunk["has_master"]:
            stored = "param"
        if kind in MOMENTS and chunk["step"] is None:
            raise CheckpointError(f"parameter {name!r} has no optimizer state in "
                                  f"{self.path}")
        dtype = _DTYPES[chunk["dtype"]] if stored == "param" else torch.float32
        shard_numel = chunk["numel"] // self.world_size
        lo, hi = saved.offset + start, saved.offset + end
        pieces = []
        # old ranks ⌊lo / S⌋ … ⌊(hi − 1) / S⌋ hold chunk elements [lo, hi)
        for rank in range(lo // shard_numel, (hi - 1) // shard_numel + 1):
            base = rank * shard_numel
            key = f"{saved.chunk}.{stored}"
            pieces.append(self._slice(rank, key, shard_numel, dtype,
                                      max(lo, base) - base, min(hi, base + shard_numel)
                                      - base))
        # [end − start] saved dtype (fp32 for masters and moments)
        out = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)
        return out.float() if kind == "master" else out

    def _slice(self, rank: int, key: str, shard_numel: int, dtype: torch.dtype,
               start: int, end: int) -> torch.Tensor:
        handle, keys = self._file(rank)
        file = self.path / tensors_file(rank)
        if key not in keys:
            raise CheckpointError(f"corrupted shard file {file}: no tensor {key!r}")
        sliced = handle.get_slice(key)
        if sliced.get_shape() != [shard_numel]:
            raise CheckpointError(f"corrupted shard file {file}: tensor {key!r} has "
                                  f"shape {sliced.get_shape()}, expected "
                                  f"[{shard_numel}]")
        if sliced.get_dtype() != _SAFETENSORS_DTYPES[dtype]:
            raise CheckpointError(f"corrupted shard file {file}: tensor {key!r} is "
                                  f"{sliced.get_dtype()}, expected {dtype}")
        return sliced[start:end]

    def _file(self, rank: int):
        if rank not in self._open:
            file = self.path / tensors_file(rank)
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as error:
                raise CheckpointError(f"corrupted shard file {file}: "
                                      f"{str(error).splitlines()[0]}") from None
            if handle.metadata().get("save_id") != self.manifest["save_id"]:
                raise CheckpointError(f"shard file {file} belongs to another save "
                                      "than its manifest")
            self._open[rank] = handle, set(handle.keys())
        return self._open[rank]

    ### Small Python state

    def extra(self) -> dict | None:
        if EXTRA not in self.manifest["files"]:
            return None
        return self._load_pickle(self.path / EXTRA)

    def rank_state(self, rank: int) -> dict:
        return self._load_pickle(self.path / rank_state_file(rank))

    def _load_pickle(self, file: Path) -> Any:
        if not file.is_file():
            raise CheckpointError(f"missing checkpoint file {file}")
        try:
            return torch.load(file, weights_only=True)
        except Exception as error:
            raise CheckpointError(f"corrupted checkpoint file {file}: "
                                  f"{str(error).splitlines()[0]}") from None


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
                f"chunk {chunk.names[0]!r}... mixes parameters saved with optimizer "
                f"steps {sorted(steps, key=str)}; load without the optimizer"
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


def install_shard(chunk: Chunk, state: ShardState, optimizer) -> None:
    """
    ### Put a read shard into the model and the optimizer

    An fp32 chunk's master is the shard itself, as AdamFP16 keeps it. A chunk
    without a saved state gets its master as `master_init`, which AdamFP16 takes
    at its first step, and loses any state it had.
    """
    device = chunk.comm.device
    with torch.no_grad():
        chunk.shard.detach().copy_(state.param)
    chunk.zero_grad()
    if not chunk.trainable:
        return
    if hasattr(chunk.shard, "master_init"):
        del chunk.shard.master_init
    master = (chunk.shard.data if chunk.dtype == torch.float32
              else state.master.to(device))
    in_optimizer = optimizer is not None and any(
        p is chunk.shard for group in optimizer.param_groups for p in group["params"]
    )
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
    for chunk, state in zip(chunks, read):
        install_shard(chunk, state, optimizer)
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


# ## Exporting the whole model


def consolidated_tensors(model: nn.Module, optimizer=None, *,
                         rename: Callable[[str], str] | None = None,
                         dtype: torch.dtype | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """
    ## Every parameter, whole, one chunk at a time

    Every rank must run the iterator to its end (each chunk is an all-gather);
    only rank 0 gets the `(name, tensor)` pairs, on the host, in chunk order.

    * `optimizer`: where the fp32 masters are; without it, 16-bit chunks export
      their 16-bit values (or `master_init`, before the first step).
    * `rename` maps a qualified name to the exported one (see `prefix_rename`).
    * `dtype` casts every tensor, e.g. to bf16 for a release.
    """
    comm: Communicator = model.runtime.comm
    for chunk in model.chunks:
        master = master_of(optimizer, chunk)
        # [S] fp32 master or chunk dtype
        source = (master if master is not None else chunk.shard).detach()
        # [C] one chunk on the device at a time
        full = torch.empty(chunk.numel, dtype=source.dtype, device=comm.device)
        comm.all_gather(full, source)
        if comm.rank != 0:
            continue
        # [C] host sync: device-to-host copy
        host = full.cpu()
        del full
        for name, param, slot in zip(chunk.names, chunk.params, chunk.spec.slots):
            # a copy, not a view: safetensors refuses tensors that share memory
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

    Other ranks return `None` once the export is complete.
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
    # ranks in the remaining all-gathers.
    for _ in tensors:
        pass
    agree(comm, error, "export")
    return result


def write_one_file(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.parent / f".{file.name}.tmp-{secrets.token_hex(6)}"
    try:
        write_tensors(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, file)
        fsync_path(file.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
