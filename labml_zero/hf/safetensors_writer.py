r"""
---
title: Writing safetensors snapshots
summary: Any family's model as a Hugging Face snapshot, streamed one tensor at a
  time into shards of bounded size, with an index above one shard, and renamed
  into place whole.
---

# Writing safetensors snapshots

The reverse of [reading a snapshot](safetensors_reader.html), for every family:
tensors stream in as `(hf_name, tensor)` and the writer holds one output
shard, so with at most $B_\text{shard}$ bytes a shard the host's peak is

$$M \approx \max_p |p| + B_\text{shard}.$$

The family brings its `config.json` and the files [beside the
weights](../neox/side_files.html).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import torch
from safetensors.torch import save_file

from labml_zero.files import (fsync_path, give_default_mode, replace_directory,
                              temporary_sibling)
from labml_zero.hf.snapshot_layout import CONFIG_FILE, INDEX_FILE, shard_file_name

__all__ = ["refuse_existing", "save_safetensors_snapshot", "write_shards",
           "WrittenShards"]


def refuse_existing(out_dir: str | os.PathLike, *, overwrite: bool) -> Path:
    """The directory as a `Path`, unless it exists and `overwrite` is not given."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"checkpoint directory exists: {out_dir} "
                              f"(pass overwrite=True)")
    return out_dir


def save_safetensors_snapshot(out_dir: str | os.PathLike,
                              named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                              hf_config: Callable[[torch.dtype], dict],
                              max_shard_bytes: int = 2 * 1024**3,
                              dtype: torch.dtype | None = None,
                              overwrite: bool = False,
                              extra_files: dict[str, str] | None = None) -> Path:
    """
    ## Write a sharded Hugging Face snapshot atomically

    The stream is the unsharded layers, or a generator that gathers a ZeRO
    model one layer at a time; past one shard an index names each tensor's
    file, as `save_pretrained` does, and the directory appears whole or not
    at all (see Note: atomic checkpoint directory).

    * `named_tensors` yields `(hf_name, tensor)`; it is consumed once, and a
      shard is written as soon as the next tensor would push it past
      `max_shard_bytes` (a tensor larger than that gets a shard of its own).
    * `hf_config(dtype)` is the family's `config.json` object for the dtype
      the tensors were written in (the first tensor's).
    * `dtype` casts every tensor (e.g. `torch.float16` for release), else each
      keeps its own dtype.
    * One shard is written as `model.safetensors` with no index, as HF does.
    * `extra_files` (`{name: text}`) go in beside them, inside the same rename
      (the tokenizer, the export's marker).

    Returns the directory.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out_dir = refuse_existing(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # ### Note: atomic checkpoint directory
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
        written = write_shards(tmp, named_tensors,
                               max_shard_bytes=max_shard_bytes, dtype=dtype)
        # Shards were written as part-K before their count was known; give them
        # HF's final names now.
        n = len(written.files)
        final = {part: shard_file_name(k, n) for k, part in enumerate(written.files)}
        for part, name in final.items():
            os.rename(tmp / part, tmp / name)
        files = {CONFIG_FILE: json.dumps(hf_config(written.dtype), indent=2)}
        if n > 1:
            files[INDEX_FILE] = json.dumps({
                "metadata": {"total_size": written.total_bytes,
                             "total_parameters": written.total_numel},
                "weight_map": {k: final[v] for k, v in written.weight_map.items()}},
                indent=2)
        for name, text in {**files, **(extra_files or {})}.items():
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
    """What `write_shards` wrote into the temporary directory."""

    files: list[str]
    """Shard file names, in order (temporary `part-K` names)."""
    weight_map: dict[str, str]
    """`hf_name -> file name`."""
    total_bytes: int
    total_numel: int
    dtype: torch.dtype
    """The dtype of the first tensor, recorded as `torch_dtype` in `config.json`."""


def write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, durable and readable by others."""
    # metadata {"format": "pt"} is what transformers checks for on load.
    save_file(tensors, str(path), metadata={"format": "pt"})
    give_default_mode(path)  # safetensors makes it owner-only (see atomic files)
    fsync_path(path)


def write_shards(tmp: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                 max_shard_bytes: int, dtype: torch.dtype | None) -> WrittenShards:
    """
    ### Stream tensors into shard files

    At most one shard's tensors are held; a name given twice is refused.
    """
    files: list[str] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = total_numel = 0
    first_dtype = None

    def flush():
        nonlocal shard, shard_bytes
        name = f"part-{len(files):05d}.safetensors"
        write_shard(shard, tmp / name)
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
