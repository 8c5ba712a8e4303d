r"""
---
title: Reading safetensors snapshots
summary: A Hugging Face snapshot read one layer at a time, config.json and
  every tensor's header checked before any data is read; shared by every
  family.
---

# Reading safetensors snapshots

A ZeRO-3 rank should never hold a whole model's weights, so loading is **per
layer**: a rank's peak is one layer, $\max_l |l|$ bytes, whatever the model's
size. Every tensor's shape is in its file's header, so each is checked before
a byte of it is read. A family's checkpoint page
([GPT-NeoX's](../neox/hf_checkpoint.html),
[Llama's](../llama/hf_checkpoint.html)) adds its config keys and its names.

## Limitations

* `.bin` (pickle) checkpoints are not read; safetensors only.
"""

from __future__ import annotations


import json
import os
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, NamedTuple, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from labml_zero.hf.snapshot_layout import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from labml_zero.zero3.checkpoint import CheckpointError
from labml_zero.zero3.checkpoint.format import MANIFEST

__all__ = ["SnapshotFileMissing", "ConfigKeys", "read_hf_config", "read_json",
           "describe", "open_safetensors", "check_tensor", "snapshot_directory",
           "SafetensorsSnapshot", "load_layers", "FLOAT_DTYPES"]

# A family's config class, and the key a caller files each tensor under
# (our name in a layer, or the checkpoint's own)
Config = TypeVar("Config")
Key = TypeVar("Key", bound=Hashable)

# safetensors' names of the floating-point dtypes a model can be loaded from
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class SnapshotFileMissing(CheckpointError, FileNotFoundError):
    """
    A snapshot's directory, `config.json`, weights or shard that is not there.

    Both a `CheckpointError` (one line, no traceback at the launcher) and a
    `FileNotFoundError`, which callers that open a directory expect.
    """


# ## Reading `config.json`


def read_json(file: Path) -> Any:
    """A JSON file's value, or one line naming the file."""
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: not valid JSON ({error})") from None


def describe(value: Any) -> str:
    """`the string '64'`, `a list`: what a wrong value is, for an error."""
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"{type(value).__name__} {value!r}"


class ConfigKeys(NamedTuple):
    """The `config.json` keys a family's config reads, by the type each must be."""

    required_ints: tuple[str, ...]
    """Sizes that must be present, integers."""
    optional_ints: tuple[str, ...]
    """Sizes that may be absent or null, else integers."""
    optional_numbers: tuple[str, ...]
    """Integers or floats where present (a base, an epsilon)."""


def integer(value: Any) -> bool:
    # `True` is an `int` to Python, never a size to us
    return isinstance(value, int) and not isinstance(value, bool)


def read_hf_config(path: str | os.PathLike, keys: ConfigKeys,
                   from_hf_config: Callable[[dict], Config]) -> Config:
    """
    ### A checked config from a snapshot's `config.json`

    A snapshot is an input someone hands the job, and a bad one should cost
    one line, not a traceback after the ranks started. `path` is the snapshot
    directory or the file itself; `from_hf_config` is the family's reader of the
    parsed object. Every key of `keys` is checked for presence and type first,
    and the family's own checks (heads that do not divide, an odd rotary width)
    are reported with the file's name: one `CheckpointError` line, never a
    `KeyError` or a `TypeError`.
    """
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_FILE
    if not file.is_file():
        if (file.parent / MANIFEST).is_file():
            # a sharded checkpoint of the engine, not a Hugging Face snapshot
            raise SnapshotFileMissing(
                f"{file.parent} is a sharded checkpoint, not a Hugging Face "
                f"snapshot: continue it with --resume, or export it with "
                f"python -m labml_zero.export")
        raise SnapshotFileMissing(f"checkpoint config not found: {file}")
    hf = read_json(file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got a "
                              f"{type(hf).__name__}")
    for key in keys.required_ints:
        if key not in hf:
            raise CheckpointError(f"{file}: no {key!r}")
    for key in keys.required_ints + keys.optional_ints:
        if hf.get(key) is not None and not integer(hf[key]):
            raise CheckpointError(f"{file}: {key!r} must be an integer, got "
                                  f"{describe(hf[key])}")
    for key in keys.optional_numbers:
        value = hf.get(key)
        if value is not None and not (integer(value) or isinstance(value, float)):
            raise CheckpointError(f"{file}: {key!r} must be a number, got "
                                  f"{describe(value)}")
    # transformers 5 names the rotary settings `rope_parameters`, 4
    # `rope_scaling`: an object in either
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise CheckpointError(f"{file}: {key!r} must be an object, got "
                                  f"{describe(hf[key])}")
    try:
        return from_hf_config(hf)
    except (ValueError, TypeError) as error:
        # the family's reader names the key; we name the file
        reason = str(error).removeprefix("config.json: ")
        raise CheckpointError(f"{file}: {reason}") from None


# ## Reading safetensors headers


@contextmanager
def open_safetensors(file: Path):
    """`safe_open` (maps the file, parses the header), refusing a non-safetensors."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
        f = handle.__enter__()
    except Exception as error:
        raise CheckpointError(f"{file}: not a safetensors file "
                              f"({str(error).splitlines()[0]})") from None
    try:
        yield f
    finally:
        handle.__exit__(None, None, None)


def check_tensor(f, file: Path, name: str, shape: tuple[int, ...], *,
                 shape_from: str | None = None) -> None:
    """
    #### One tensor's header entry against the shape the model expects

    Checked *before* the tensor is read, so a checkpoint for a different model
    fails on the first wrong tensor with its name and both shapes, not after
    reading the whole checkpoint or inside `load_state_dict`. `shape_from`
    names the `config.json` fields the shape comes from, where the family
    knows them, so the message says which field to look at.
    """
    try:
        sliced = f.get_slice(name)
    except Exception:
        raise CheckpointError(f"{file}: no tensor {name!r}, which the index "
                              "places there") from None
    found = tuple(sliced.get_shape())
    if found != shape:
        source = f" (from config.json's {shape_from})" if shape_from else ""
        raise CheckpointError(f"tensor {name!r} in {file} has shape {found}, "
                              f"the model expects {shape}{source}")
    if sliced.get_dtype() not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r} in {file} is "
                              f"{sliced.get_dtype()}, not floating point")


# ## The snapshot


def snapshot_directory(path: str | os.PathLike) -> Path:
    """The snapshot's directory, or `SnapshotFileMissing` naming it."""
    path = Path(path)
    if not path.is_dir():
        raise SnapshotFileMissing(f"checkpoint directory not found: {path}")
    return path


def read_weight_map(path: Path) -> dict[str, str]:
    """
    #### Which file holds each tensor

    The index's `weight_map`, or every name of the single file's header.
    """
    index = path / INDEX_FILE
    if index.is_file():
        value = read_json(index)
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
        if bad:
            raise CheckpointError(f"{index}: 'weight_map' maps {bad[0]!r} to "
                                  f"{describe(weight_map[bad[0]])}, not a file")
        return dict(weight_map)
    single = path / SINGLE_FILE
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise SnapshotFileMissing(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


class Wanted(NamedTuple):
    """A tensor a caller asks for: its name in the checkpoint and its shape."""

    name: str
    shape: tuple[int, ...]


class SafetensorsSnapshot:
    """
    ## A snapshot directory, read lazily

    Construction reads only the index (or the header of the single file);
    tensors are read by `read_tensors`, one layer's at a time. A family's
    checkpoint class adds its config and its names on top (one level of
    inheritance: `HFCheckpoint`, `LlamaCheckpoint`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = snapshot_directory(path)
        # tensor name -> file name (relative to self.path)
        self.weight_map: dict[str, str] = read_weight_map(self.path)

    def files_of(self, names: dict[Key, str]) -> dict[Path, list[Key]]:
        """
        ### The caller's keys grouped by the file that holds their tensor

        `names` maps each key to its checkpoint name; a name the index lacks,
        or a file that is not there, is refused before anything is opened.
        """
        by_file: dict[Path, list[Key]] = defaultdict(list)
        for key, name in names.items():
            if name not in self.weight_map:
                raise CheckpointError(f"checkpoint {self.path} has no tensor "
                                      f"{name!r}, which its config.json implies")
            file = self.path / self.weight_map[name]
            if not file.is_file():
                raise SnapshotFileMissing(f"checkpoint shard not found: {file}")
            by_file[file].append(key)
        return by_file

    def read_tensors(self, wanted: dict[Key, Wanted], *,
                     dtype: torch.dtype | None = None,
                     shape_from: Callable[[str], str | None] = lambda name: None
                     ) -> dict[Key, torch.Tensor]:
        """
        ### Read the tensors of one layer

        `{key: tensor}` on the CPU (cast to `dtype` if given), each shape
        checked in its header before its data is read; `shape_from(name)`
        names the `config.json` fields a shape comes from, for the message.
        """
        out: dict[Key, torch.Tensor] = {}
        for file, keys in self.files_of({k: w.name for k, w in wanted.items()}
                                        ).items():
            with open_safetensors(file) as f:
                for key in keys:
                    name, shape = wanted[key]
                    check_tensor(f, file, name, shape, shape_from=shape_from(name))
                    t = f.get_tensor(name)
                    out[key] = t if dtype is None else t.to(dtype)
        return out

    def check_tensors(self, wanted: dict[str, tuple[int, ...]], *,
                      shape_from: Callable[[str], str | None] = lambda name: None
                      ) -> None:
        """
        ### Check every tensor a model needs, reading headers only

        `wanted` maps each checkpoint name to its shape (every layer of the
        model built on the meta device): what the launcher calls before any
        rank starts.
        """
        for file, names in self.files_of({n: n for n in wanted}).items():
            with open_safetensors(file) as f:
                for name in names:
                    check_tensor(f, file, name, wanted[name],
                                 shape_from=shape_from(name))

    def equal_tensors(self, a: str, b: str, *, rows: int = 4096) -> bool:
        """
        ### Whether two stored tensors hold the same values

        Compared `rows` rows at a time, so the host holds two blocks, not two
        matrices of the vocabulary's size. Both must be in the snapshot.
        """
        files = self.files_of({a: a, b: b})
        with ExitStack() as stack:
            opened = {name: stack.enter_context(open_safetensors(file))
                      for file, names in files.items() for name in names}
            first, second = opened[a].get_slice(a), opened[b].get_slice(b)
            if first.get_shape() != second.get_shape():
                return False
            n = first.get_shape()[0] if first.get_shape() else 1
            for start in range(0, n, rows):
                if not torch.equal(first[start:start + rows],
                                   second[start:start + rows]):
                    return False
        return True


def load_layers(checkpoint, layers: Iterable[nn.Module]) -> None:
    """
    ### Load every layer, one at a time

    `checkpoint` is anything with `layer_state_dict(layer)`. For an unsharded
    model (tests, sampling); the engine instead calls `layer_state_dict` per
    layer while it fills its chunks.
    """
    for layer in layers:
        layer.load_state_dict(checkpoint.layer_state_dict(layer))
