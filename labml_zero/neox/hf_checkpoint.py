r"""
---
title: Hugging Face GPT-NeoX checkpoints
summary: Stream GPT-NeoX / Pythia safetensors into our layers one layer at a time,
  with every shape checked, and export sharded safetensors atomically.
---

# Hugging Face GPT-NeoX checkpoints

GPT-NeoX-20B in fp16 is
{{py: 2 * neox_model.count_parameters(neox_model.build_layers(
    neox_model.gpt_neox_20b(), device='meta')) / 1e9 | .0f}}
GB; a ZeRO-3 rank should never hold all of it. So
loading is **per layer**: `HFCheckpoint.layer_state_dict(layer)` opens only the
safetensors files that hold that layer's tensors and reads only those tensors
(`safe_open` maps the file; `get_tensor` copies one tensor out), so the peak is one
layer. The engine loads a layer, shards it into its chunks and drops it before
the next. Not the engine's [sharded checkpoints](../zero3/checkpoint/index.html),
which resume a run.

Going back, `save_hf_checkpoint` writes the same layout from a stream of
`(name, tensor)`, holding one output shard; [beside the
weights](side_files.html) are the files that make it a whole model again.

## Limitations

* `.bin` (pickle) checkpoints are not read; safetensors only.
* Tied input/output embeddings are not supported (no released GPT-NeoX ties them).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from labml_zero.files import (fsync_path, give_default_mode, replace_directory,
                              temporary_sibling)
from labml_zero.neox.model import (Embedding, FinalNorm, NeoXConfig, Readout,
                                   TransformerLayer, build_layers, from_hf_config,
                                   gpt_neox_20b, hf_prefix, to_hf_config)
from labml_zero.zero3.checkpoint import CheckpointError

__all__ = ["HFCheckpoint", "NeoX20BCheckpoint", "check_hf_snapshot",
           "config_from_hf", "save_hf_checkpoint", "hf_named_tensors",
           "load_layers"]

# ## The Hugging Face layout
#
# A checkpoint directory holds `config.json` and either one `model.safetensors`,
# or shards `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`,
# whose `weight_map` says which file holds each tensor. Names are those of
# `GPTNeoXForCausalLM`; since our layers use the same submodule names, the name
# of each of our tensors is `hf_prefix(layer) + name` (see [the model](model.html)).
# Old checkpoints also store buffers (`attention.bias`, `attention.masked_bias`,
# `attention.rotary_emb.inv_freq`); we ask only for the names our layers have, so
# these are never read.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# `config.json` keys that must be integers, and those that must be numbers
REQUIRED_INTS = ("vocab_size", "hidden_size", "num_attention_heads",
                 "num_hidden_layers")
OPTIONAL_INTS = ("intermediate_size", "max_position_embeddings")
OPTIONAL_NUMBERS = ("rotary_pct", "rotary_emb_base", "layer_norm_eps",
                    "initializer_range")


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


def config_from_hf(path: str | os.PathLike) -> NeoXConfig:
    """
    ### A checked `NeoXConfig` from a snapshot's `config.json`

    `path` is the snapshot directory or the file itself. Every key
    `from_hf_config` reads is checked for its type first, so a bad file gives
    one `CheckpointError` naming it, never a `KeyError` or a `TypeError`.
    """
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint config not found: {file}")
    hf = read_json(file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got a "
                              f"{type(hf).__name__}")

    def integer(value: Any) -> bool:
        # `True` is an `int` to Python, never a size to us
        return isinstance(value, int) and not isinstance(value, bool)

    for key in REQUIRED_INTS:
        if key not in hf:
            raise CheckpointError(f"{file}: no {key!r}")
    for key in REQUIRED_INTS + OPTIONAL_INTS:
        if key in hf and hf[key] is not None and not integer(hf[key]):
            raise CheckpointError(f"{file}: {key!r} must be an integer, got "
                                  f"{describe(hf[key])}")
    for key in OPTIONAL_NUMBERS:
        value = hf.get(key)
        if value is not None and not (integer(value) or isinstance(value, float)):
            raise CheckpointError(f"{file}: {key!r} must be a number, got "
                                  f"{describe(value)}")
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise CheckpointError(f"{file}: {key!r} must be an object, got "
                                  f"{describe(hf[key])}")
    try:
        return from_hf_config(hf)
    except (ValueError, TypeError) as error:
        # `from_hf_config` and `NeoXConfig` name the key; we name the file
        reason = str(error).removeprefix("config.json: ")
        raise CheckpointError(f"{file}: {reason}") from None


# ## Reading safetensors headers

# safetensors' names of the floating-point dtypes a model can be loaded from
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


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


def check_tensor(f, file: Path, hf_name: str, shape: tuple[int, ...]) -> None:
    """
    One tensor's header entry against the shape the model expects.

    Every tensor's shape is checked *before* it is read (the safetensors header
    has it), so a checkpoint for a different model fails on the first wrong
    tensor with its name and both shapes, not after reading the whole checkpoint
    or inside `load_state_dict`.
    """
    try:
        sliced = f.get_slice(hf_name)
    except Exception:
        raise CheckpointError(f"{file}: no tensor {hf_name!r}, which the index "
                              "places there") from None
    found = tuple(sliced.get_shape())
    if found != shape:
        raise CheckpointError(f"tensor '{hf_name}' in {file} has shape {found}, "
                              f"the model expects {shape}")
    if sliced.get_dtype() not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor '{hf_name}' in {file} is "
                              f"{sliced.get_dtype()}, not floating point")


class HFCheckpoint:
    """
    ## A Hugging Face checkpoint directory, read lazily

    Construction reads only `config.json` and the index (or the header of the
    single file); tensors are read by `layer_state_dict`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {self.path}")
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"checkpoint config not found: {config_path}")
        self.config: NeoXConfig = config_from_hf(config_path)
        # tensor name -> file name (relative to self.path)
        self.weight_map: dict[str, str] = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
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
        single = self.path / SINGLE_FILE
        if single.is_file():
            with open_safetensors(single) as f:
                return {name: SINGLE_FILE for name in f.keys()}
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}")

    def layer_state_dict(self, layer: nn.Module, *,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """
        ### Read one layer's tensors

        Returns `{our_name: tensor}` (CPU; cast to `dtype` if given) for every
        entry of `layer.state_dict()`, ready for `layer.load_state_dict`. The
        layer may be on the meta device: only its names and shapes are used.
        """
        prefix = hf_prefix(layer)
        # our name -> expected shape
        wanted = {name: tuple(t.shape) for name, t in layer.state_dict().items()}
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in wanted:
            hf_name = prefix + name
            if hf_name not in self.weight_map:
                raise CheckpointError(f"checkpoint {self.path} has no tensor "
                                      f"'{hf_name}'")
            by_file[self.weight_map[hf_name]].append(name)

        out: dict[str, torch.Tensor] = {}
        for file_name, names in by_file.items():
            file_path = self.path / file_name
            if not file_path.is_file():
                raise FileNotFoundError(f"checkpoint shard not found: {file_path}")
            with open_safetensors(file_path) as f:
                for name in names:
                    hf_name = prefix + name
                    # The header has the shape: check before reading any data.
                    check_tensor(f, file_path, hf_name, wanted[name])
                    t = f.get_tensor(hf_name)
                    out[name] = t if dtype is None else t.to(dtype)
        return out


class NeoX20BCheckpoint:
    r"""
    ## The original two-partition GPT-NeoX-20B files

    EleutherAI first released GPT-NeoX-20B as DeepSpeed pipeline files
    `layer_XX-model_0P-model_states.pt`: `XX` is the pipeline position (`00` the
    embedding, `i + 2` transformer layer $i$, `n + 3` the final norm, `n + 4` the
    readout) and `P` one of the two tensor-parallel partitions. This class, with
    `HFCheckpoint`'s interface, merges the two per layer, the same way as labml-nn
    and EleutherAI's HF conversion:

    * column-parallel weights and biases (QKV, `dense_h_to_4h`, embeddings,
      readout) are split along the output dim: concatenate on dim 0. Partition 0
      holds heads $0 \ldots n_h/2 - 1$ in the same head-major layout, so the
      concatenation is HF's QKV layout;
    * row-parallel weights (`attention.dense`, `dense_4h_to_h`) are split along
      the input dim: concatenate on dim 1;
    * row-parallel biases are **summed**: with the parallel residual, GPT-NeoX
      adds each partition's bias before the all-reduce that sums the partitions,
      so the effective bias is the sum of the two stored ones;
    * layer norms are replicated; the two copies drift apart by rounding during
      training, so they are averaged.

    Each file is read with `torch.load(mmap=True)`; its shapes are checked after
    the merge, not before the read (`.pt` files have no separate header).
    """

    # our name -> (name in the .pt file, how the two partitions merge)
    LAYER_NAMES = {
        "input_layernorm.weight": ("input_layernorm.weight", "mean"),
        "input_layernorm.bias": ("input_layernorm.bias", "mean"),
        "post_attention_layernorm.weight": ("post_attention_layernorm.weight",
                                            "mean"),
        "post_attention_layernorm.bias": ("post_attention_layernorm.bias", "mean"),
        "attention.query_key_value.weight": ("attention.query_key_value.weight",
                                             "cat0"),
        "attention.query_key_value.bias": ("attention.query_key_value.bias",
                                           "cat0"),
        "attention.dense.weight": ("attention.dense.weight", "cat1"),
        "attention.dense.bias": ("attention.dense.bias", "sum"),
        "mlp.dense_h_to_4h.weight": ("mlp.dense_h_to_4h.weight", "cat0"),
        "mlp.dense_h_to_4h.bias": ("mlp.dense_h_to_4h.bias", "cat0"),
        "mlp.dense_4h_to_h.weight": ("mlp.dense_4h_to_h.weight", "cat1"),
        "mlp.dense_4h_to_h.bias": ("mlp.dense_4h_to_h.bias", "sum"),
    }
    OTHER_NAMES = {
        "embed_in.weight": ("word_embeddings.weight", "cat0"),
        "final_layer_norm.weight": ("norm.weight", "mean"),
        "final_layer_norm.bias": ("norm.bias", "mean"),
        "embed_out.weight": ("final_linear.weight", "cat0"),
    }

    def __init__(self, path: str | os.PathLike, *,
                 config: NeoXConfig | None = None, n_partitions: int = 2):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {self.path}")
        self.config = config or gpt_neox_20b()
        self.n_partitions = n_partitions

    def _position(self, layer: nn.Module) -> int:
        """Pipeline position `XX` of a layer in the file names."""
        n = self.config.n_layers
        if isinstance(layer, Embedding):
            return 0
        if isinstance(layer, TransformerLayer):
            return layer.layer_idx + 2
        if isinstance(layer, FinalNorm):
            return n + 3
        if isinstance(layer, Readout):
            return n + 4
        raise ValueError(f"{type(layer).__name__} is not a GPT-NeoX layer")

    def layer_state_dict(self, layer: nn.Module, *,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """### Read both partitions of one layer and merge them"""
        position = self._position(layer)
        parts = []
        for p in range(self.n_partitions):
            file_path = (self.path
                         / f"layer_{position:02d}-model_{p:02d}-model_states.pt")
            if not file_path.is_file():
                raise FileNotFoundError(f"checkpoint shard not found: {file_path}")
            # mmap: only the tensors touched below are paged in.
            parts.append(torch.load(file_path, map_location="cpu", mmap=True,
                                    weights_only=True))
        names = (self.LAYER_NAMES if isinstance(layer, TransformerLayer)
                 else self.OTHER_NAMES)
        out = {}
        for name, expected in layer.state_dict().items():
            file_name, how = names[name]
            if file_name not in parts[0]:
                raise ValueError(f"checkpoint {self.path} layer {position:02d} has "
                                 f"no tensor '{file_name}'")
            ts = [part[file_name] for part in parts]
            match how:
                case "cat0":
                    t = torch.cat(ts, dim=0)
                case "cat1":
                    t = torch.cat(ts, dim=1)
                case "sum":
                    t = torch.stack(ts).sum(dim=0)
                case _:  # "mean"
                    t = torch.stack(ts).mean(dim=0)
            if tuple(t.shape) != tuple(expected.shape):
                raise ValueError(f"tensor '{file_name}' of layer {position:02d} "
                                 f"merges to shape {tuple(t.shape)}, the model "
                                 f"expects {tuple(expected.shape)}")
            out[name] = t if dtype is None else t.to(dtype)
        return out


def check_hf_snapshot(path: str | os.PathLike) -> NeoXConfig:
    """
    ### Check a whole snapshot without reading any tensor data

    #### Note: checking a snapshot before any rank starts

    A snapshot is an input someone hands the job, and a bad one should cost one
    line, not a traceback after the ranks started. This reads `config.json` and
    every safetensors *header* (no tensor data) and compares each tensor the model
    needs with the shape `config.json` implies, so the launcher can call it first.
    `HFCheckpoint` runs the same `config.json` and index checks when it is built.

    Returns the snapshot's `NeoXConfig`; raises a one-line `CheckpointError`
    naming the file otherwise, for

    * a `config.json` that is not a JSON object, lacks a size, or has a size
      that is not an integer (`"hidden_size": "64"`), or that the model cannot
      be (an odd rotary width, say: `NeoXConfig`'s own checks);
    * an index without a `weight_map`, or one that maps a tensor to a missing
      file;
    * a file that is not safetensors (a garbled header, an HTML error page);
    * a tensor that is missing, not floating point, or of another shape.

    Needs no process group and no device: the model is built on the meta
    device for its shapes only.
    """
    try:
        checkpoint = HFCheckpoint(path)
    except FileNotFoundError as error:
        raise CheckpointError(str(error)) from None
    # hf_name -> shape, for every tensor of every layer of the full model
    wanted = {hf_prefix(layer) + name: tuple(t.shape)
              for layer in build_layers(checkpoint.config, device="meta")
              for name, t in layer.state_dict().items()}
    by_file: dict[str, list[str]] = defaultdict(list)
    for hf_name in wanted:
        if hf_name not in checkpoint.weight_map:
            raise CheckpointError(f"checkpoint {checkpoint.path} has no tensor "
                                  f"'{hf_name}', which its config.json implies")
        by_file[checkpoint.weight_map[hf_name]].append(hf_name)
    for file_name, names in by_file.items():
        file = checkpoint.path / file_name
        if not file.is_file():
            raise CheckpointError(f"checkpoint shard not found: {file}")
        with open_safetensors(file) as f:
            for hf_name in names:
                check_tensor(f, file, hf_name, wanted[hf_name])
    return checkpoint.config


def load_layers(checkpoint: HFCheckpoint | NeoX20BCheckpoint,
                layers: Iterable[nn.Module]):
    """
    ### Load every layer, one at a time

    For an unsharded model (tests, `generate`). The engine instead calls
    `layer_state_dict` per layer while it fills its chunks.
    """
    for layer in layers:
        layer.load_state_dict(checkpoint.layer_state_dict(layer))


def hf_named_tensors(layers: Iterable[nn.Module]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` for every tensor of the layers, in layer order."""
    for layer in layers:
        prefix = hf_prefix(layer)
        for name, t in layer.state_dict().items():
            yield prefix + name, t


# ## Export


def _write_shard(tensors: dict[str, torch.Tensor], path: Path):
    # metadata {"format": "pt"} is what transformers checks for on load.
    save_file(tensors, str(path), metadata={"format": "pt"})
    give_default_mode(path)  # safetensors makes it owner-only (see atomic files)
    fsync_path(path)


def save_hf_checkpoint(out_dir: str | os.PathLike, config: NeoXConfig,
                       named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       max_shard_bytes: int = 2 * 1024**3,
                       dtype: torch.dtype | None = None,
                       overwrite: bool = False,
                       extra_files: dict[str, str] | None = None) -> Path:
    """
    ### Write a sharded Hugging Face checkpoint atomically

    The same layout, from an iterable of `(hf_name, tensor)`:
    `hf_named_tensors(layers)`, or a generator that gathers a ZeRO model one layer at
    a time. At most one shard is held in memory.

    * `named_tensors` yields `(hf_name, tensor)`; it is consumed once, and a
      shard is written as soon as the next tensor would push it past
      `max_shard_bytes` (a tensor larger than that gets a shard of its own).
    * `dtype` casts every tensor (e.g. `torch.float16` for release), else each
      keeps its own dtype.
    * One shard is written as `model.safetensors` with no index, as HF does.
    * `extra_files` (`{name: text}`) go in beside them, inside the same rename
      (the LoRA export's marker).

    Returns the checkpoint directory. See Note: atomic checkpoint directory.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"checkpoint directory exists: {out_dir} "
                              f"(pass overwrite=True)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # #### Note: atomic checkpoint directory
    #
    # A crash halfway through writing must not leave a directory that loads: a
    # reader would get half new and half missing (or old) tensors. So the snapshot
    # is written as on [atomic files](../files.html): into a fresh temporary
    # directory next to the target, every file `fsync`ed, then the directory
    # itself, and only then renamed to the target name. If the target exists (and
    # `overwrite` is set), it is first renamed aside and removed after the new one
    # is in place; in between there is briefly *no* checkpoint at that path, never
    # a partial one.
    tmp = temporary_sibling(out_dir)
    tmp.mkdir()
    try:
        written = _write_shards(tmp, named_tensors,
                                max_shard_bytes=max_shard_bytes, dtype=dtype)
        # Shards were written as part-K before their count was known; give them
        # HF's final names now.
        n = len(written.files)
        final = {part: SINGLE_FILE if n == 1 else
                 f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                 for k, part in enumerate(written.files)}
        for part, name in final.items():
            os.rename(tmp / part, tmp / name)
        if n > 1:
            index = {"metadata": {"total_size": written.total_bytes,
                                  "total_parameters": written.total_numel},
                     "weight_map": {k: final[v]
                                    for k, v in written.weight_map.items()}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
            fsync_path(tmp / INDEX_FILE)
        hf_config = to_hf_config(config, dtype=written.dtype)
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
        fsync_path(tmp / CONFIG_FILE)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
            fsync_path(tmp / name)
        fsync_path(tmp)
        # The only moment the target changes; see Note: atomic checkpoint directory.
        replace_directory(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class WrittenShards(NamedTuple):
    """What `_write_shards` wrote into the temporary directory."""

    files: list[str]
    """Shard file names, in order (temporary `part-K` names)."""
    weight_map: dict[str, str]
    """`hf_name -> file name`."""
    total_bytes: int
    total_numel: int
    dtype: torch.dtype
    """The dtype of the first tensor, recorded as `torch_dtype` in `config.json`."""


def _write_shards(tmp: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                  max_shard_bytes: int, dtype: torch.dtype | None) -> WrittenShards:
    """
    #### Stream tensors into shard files
    """
    files: list[str] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = total_numel = 0
    first_dtype = None

    def flush():
        nonlocal shard, shard_bytes
        name = f"part-{len(files):05d}.safetensors"
        _write_shard(shard, tmp / name)
        weight_map.update({k: name for k in shard})
        files.append(name)
        shard, shard_bytes = {}, 0

    for hf_name, t in named_tensors:
        if hf_name in weight_map or hf_name in shard:
            raise ValueError(f"tensor '{hf_name}' given twice")
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        # A view into a bigger buffer (a chunk) would make safetensors refuse it as
        # "shared memory", and would write the whole buffer: copy it out.
        if t.untyped_storage().nbytes() != nbytes:
            t = t.clone()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[hf_name] = t
        shard_bytes += nbytes
        total_bytes += nbytes
        total_numel += t.numel()
        first_dtype = first_dtype or t.dtype
    if not shard and not files:
        raise ValueError("save_hf_checkpoint: no tensors given")
    if shard:
        flush()
    return WrittenShards(files, weight_map, total_bytes, total_numel, first_dtype)
