r"""
---
title: Reading a sharded checkpoint
summary: How any element of any parameter is found in the ranks' files, which is
  all that resharding needs, with every file checked before it is used.
---

# Reading a sharded checkpoint

A [sharded checkpoint](index.html) is one file per rank holding that rank's
shards, plus a manifest that describes the layout ([the format](format.html)).
This page is the one operation every reader needs: *find elements $[a, b)$ of
parameter $p$*. Loading at the saved world size, loading at another one, and
reading a whole tensor offline are all that operation with different ranges. It
is pure file arithmetic, with no process group, so it also serves inspection,
conversion and the checks a launcher makes before any process starts.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..state_layout import LAYOUTS
from .digest import file_digest
from .format import (DTYPES, EXTRA, FORMAT, FORMAT_1, MANIFEST, MANIFEST_KEYS,
                     MANIFEST_KEYS_2, SAFETENSORS_DTYPES, CheckpointError,
                     first_difference, fingerprint, rank_state_file, saved_states,
                     tensors_file)

__all__ = ["CheckpointReader", "SavedParam"]


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

    Every file is checked for existence and size here, so a rank that needs only
    its own file still refuses a checkpoint with another rank's file missing
    (which is the point: it would not resume anyway).
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
        # file name -> digest; empty for a format-1 checkpoint
        self.digests: dict[str, str] = self.manifest.get("digests", {})
        self._verified: set[str] = set()
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
        found = manifest.get("format") if isinstance(manifest, dict) else None
        if found not in (FORMAT, FORMAT_1):
            raise CheckpointError(f"{file} has format {found!r}, expected {FORMAT!r}")
        required = MANIFEST_KEYS + (MANIFEST_KEYS_2 if found == FORMAT else ())
        missing = [key for key in required if key not in manifest]
        if missing:
            raise CheckpointError(f"corrupted manifest {file}: no {missing[0]!r}")
        if found == FORMAT and set(manifest["digests"]) != set(manifest["files"]):
            raise CheckpointError(f"corrupted manifest {file}: its digests and its "
                                  "files name different files")
        return manifest

    ### Checks

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: p.shape for name, p in self.params.items()}

    @property
    def meta(self) -> dict:
        """The job's JSON values (`save_checkpoint(meta=...)`); `{}` in format 1."""
        return self.manifest.get("meta") or {}

    def check_model(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Refuse a model whose parameter names or shapes differ from the saved."""
        if fingerprint(shapes) != self.manifest["fingerprint"]:
            raise CheckpointError(f"checkpoint {self.path} is of a different model: "
                                  f"{first_difference(self.shapes, shapes)}")

    def verify(self, name: str) -> None:
        """
        ### Check one file against its digest, once

        #### Note: checks on reading

        1. When the reader is built: the manifest (its format and keys), and
           every listed file's existence and size. Cheap: no file is opened.
        2. When a file is first used: its [digest](digest.html), here, then its
           header. A digest that differs is explained when the file says more: a
           header that does not parse is "corrupted", a header with another save
           id "belongs to another save", and anything else is a "checksum
           mismatch".
        3. When a tensor is read: its name, shape and dtype against the manifest.

        A rank thus hashes only the files it reads; `verify_files` hashes them
        all, for a check before the job starts. Checking a digest reads the whole
        file once before its slices are read: at the saved world size, one extra
        sequential read of the rank's own file. Does nothing for a format-1
        checkpoint.

        A format-1 checkpoint has no digests (see `FORMAT_1` in [the
        format](format.html)): a changed byte in its tensor data is not caught.
        """
        if name in self._verified or name not in self.digests:
            return
        file = self.path / name
        if file_digest(file) != self.digests[name]:
            if name.endswith(".safetensors"):
                self._explain_header(file)
            raise CheckpointError(f"{file}: checksum mismatch, the file was changed "
                                  "after it was saved")
        self._verified.add(name)

    def verify_files(self) -> None:
        """Check every file's digest: one read of the whole checkpoint."""
        for name in self.manifest["files"]:
            self.verify(name)

    def _explain_header(self, file: Path):
        """Raise with what a shard file's header says is wrong with it, if anything."""
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                save_id = (handle.metadata() or {}).get("save_id")
        except Exception as error:
            raise CheckpointError(f"corrupted shard file {file}: "
                                  f"{str(error).splitlines()[0]}") from None
        if save_id != self.manifest["save_id"]:
            raise CheckpointError(f"shard file {file} belongs to another save "
                                  "than its manifest")

    def chunk_of(self, name: str) -> dict:
        return self.chunks[self.params[name].chunk]

    def step(self, name: str) -> int | None:
        """The optimizer step of a parameter's chunk; `None` without state."""
        return self.chunk_of(name)["step"]

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.chunk_of(name)["dtype"]]

    @property
    def states(self) -> dict:
        """The saved state layout: `{"name", "dtypes"}` (see the format's
        manifest)."""
        return saved_states(self.manifest)

    @property
    def moments(self) -> tuple[str, ...]:
        """The saved states other than the master, in the saved order."""
        return tuple(n for n in self.states["dtypes"] if n != "master")

    @property
    def compensation(self) -> str | None:
        r"""The saved state that is the weight's low-order part, $c$ in
        $w + c$ ([Kahan summation](../../optimizers/kahan_summation.html)),
        or `None`."""
        layout = LAYOUTS.get(self.states["name"])
        state = None if layout is None else layout.compensation
        return None if state is None else state.name

    def adds_compensation(self, name: str) -> bool:
        r"""Whether a parameter's master reads as $w + c$: its chunk saved no
        master, and a compensation beside its optimizer state."""
        chunk = self.chunk_of(name)
        return (not chunk["has_master"] and chunk["step"] is not None
                and self.compensation is not None)

    ### Reading elements

    def read(self, name: str, kind: str = "master", start: int = 0,
             end: int | None = None) -> torch.Tensor:
        r"""
        ### Elements `[start, end)` of a saved parameter, flat, on the host

        `kind` is `param` (in the saved dtype), `master` (fp32: the saved master,
        else the weight the optimizer continues from: the parameter, plus its
        compensation where one was saved, see Note: the master of a
        compensated weight) or a moment of the saved layout (`exp_avg`,
        `exp_avg_sq`, in its saved dtype; an 8-bit moment's scale, per
        element: `_per_block`); the saved ranks that hold them are
        the $k$ below.

        #### Note: the master of a compensated weight

        A `"bf16-kahan"` checkpoint keeps no master: its weight is the pair
        $x = w + c$ of the bf16 parameter $w$ and its compensation $c$. So
        its master reads as $w + c$ in fp32, and a load into a layout or a
        dtype that keeps a master (or an fp32 shard) resumes from $x$, not
        from $w$, which lost up to half a bf16 step of it
        (tested: tests/zero3/test_checkpoint.py::test_a_kahan_checkpoint_resumes_from_w_plus_c).
        The sum is exact in fp32 but where $|c| < u^2 |w|$ ($u$ bf16's unit
        roundoff), which it rounds by at most $2^{-24}$ of $x$ ([Kahan
        summation](../../optimizers/kahan_summation.html)).

        #### Finding elements: the resharding arithmetic

        A chunk of $C$ elements saved over $N_d$ ranks gave rank $k$ the elements
        $[kS, (k+1)S)$, $S = C / N_d$. A parameter at offset $o$ with $n$ elements is
        elements $[o, o + n)$ of its chunk, so its elements $[a, b)$ are chunk elements
        $[o + a, o + b)$, held by the saved ranks

        $$k = \left\lfloor \frac{o + a}{S} \right\rfloor, \ldots,
        \left\lfloor \frac{o + b - 1}{S} \right\rfloor,$$

        rank $k$ at local positions $[\max(o + a, kS) - kS,\ \min(o + b, (k+1)S) - kS)$.
        `read` copies exactly those slices (`safe_open(...).get_slice`) and concatenates
        them; every file is checked before it is used (see Note: checks on reading).

        This is all that resharding needs. A new model, at world size $N_d'$ and
        with its own chunk size, puts the same parameter at offset $o'$ of a chunk
        of $C'$ elements, and its rank $r'$ keeps $[r'S', (r'+1)S')$ of that
        chunk. So rank $r'$ asks for

        $$[a, b) = [\max(o', r'S') - o',\ \min(o' + n, (r'+1)S') - o')$$

        of each parameter that overlaps its shard, for the parameter, the master
        and both moments. Padding needs nothing: it is zero in all four (its
        gradient is zero, so Adam never moves it) and a new shard starts as zeros.
        """
        kinds = ("param", "master", *self.moments)
        if kind not in kinds:
            raise ValueError(f"kind must be one of {', '.join(kinds)}, "
                             f"got {kind!r}")
        if name not in self.params:
            raise CheckpointError(f"no parameter {name!r} in checkpoint {self.path}")
        saved = self.params[name]
        chunk = self.chunks[saved.chunk]
        end = saved.numel if end is None else end
        if not 0 <= start <= end <= saved.numel:
            raise ValueError(f"elements [{start}, {end}) are outside parameter "
                             f"{name!r} of {saved.numel} elements")
        stored = kind
        if kind == "master" and not chunk["has_master"]:
            if self.adds_compensation(name):
                # [end − start] fp32, $w + c$ (see Note: the master of a
                # compensated weight)
                return (self.read(name, "param", start, end).float()
                        + self.read(name, self.compensation, start, end).float())
            stored = "param"
        if kind in self.moments and chunk["step"] is None:
            raise CheckpointError(f"parameter {name!r} has no optimizer state in "
                                  f"{self.path}")
        dtype = DTYPES[chunk["dtype"] if stored == "param"
                       else self.states["dtypes"][stored]]
        shard_numel = chunk["numel"] // self.world_size
        lo, hi = saved.offset + start, saved.offset + end
        pieces = []
        # old ranks ⌊lo / S⌋ … ⌊(hi − 1) / S⌋ hold chunk elements [lo, hi)
        key = f"{saved.chunk}.{stored}"
        block = self.states.get("blocks", {}).get(stored)
        for rank in range(lo // shard_numel, (hi - 1) // shard_numel + 1):
            base = rank * shard_numel
            first, last = max(lo, base), min(hi, base + shard_numel)
            if block is None:
                pieces.append(self._slice(rank, key, shard_numel, dtype,
                                          first - base, last - base))
            else:
                pieces.append(self._per_block(rank, key, shard_numel, block,
                                              first - base, last - base))
        # [end − start] saved dtype (fp32 for masters, the layout's for moments)
        out = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)
        return out.float() if kind == "master" else out

    def _per_block(self, rank: int, key: str, shard_numel: int, block: int,
                   start: int, end: int) -> torch.Tensor:
        r"""
        #### A per-block state, one value per element

        An 8-bit moment's scales, $\lceil S / B \rceil$ per saved shard: the
        blocks holding local elements `[start, end)` are read, and each
        value repeated for its block's elements. Each element then reads with
        the scale it was coded with, whatever the new shard's blocks.
        """
        if start == end:
            return torch.empty(0)
        first, last = start // block, (end - 1) // block + 1
        # [last - first] fp32
        scales = self._slice(rank, key, -(-shard_numel // block), torch.float32,
                             first, last)
        # [end − start] fp32
        return scales.repeat_interleave(block)[start - first * block:
                                               end - first * block]

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
        if sliced.get_dtype() != SAFETENSORS_DTYPES[dtype]:
            raise CheckpointError(f"corrupted shard file {file}: tensor {key!r} is "
                                  f"{sliced.get_dtype()}, expected {dtype}")
        return sliced[start:end]

    def _file(self, rank: int):
        if rank not in self._open:
            name = tensors_file(rank)
            self.verify(name)
            file = self.path / name
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as error:
                raise CheckpointError(f"corrupted shard file {file}: "
                                      f"{str(error).splitlines()[0]}") from None
            if (handle.metadata() or {}).get("save_id") != self.manifest["save_id"]:
                raise CheckpointError(f"shard file {file} belongs to another save "
                                      "than its manifest")
            self._open[rank] = handle, set(handle.keys())
        return self._open[rank]

    ### Small Python state

    def extra(self) -> dict | None:
        if EXTRA not in self.manifest["files"]:
            return None
        return self._load_pickle(EXTRA)

    def rank_state(self, rank: int) -> dict:
        return self._load_pickle(rank_state_file(rank))

    def _load_pickle(self, name: str) -> Any:
        file = self.path / name
        if not file.is_file():
            raise CheckpointError(f"missing checkpoint file {file}")
        self.verify(name)
        try:
            return torch.load(file, weights_only=True)
        except Exception as error:
            raise CheckpointError(f"corrupted checkpoint file {file}: "
                                  f"{str(error).splitlines()[0]}") from None
