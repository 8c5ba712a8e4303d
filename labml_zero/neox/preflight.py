r"""
---
title: Checks before any rank starts
summary: Everything about a fine-tune that can be checked on the launcher's host is
  checked there, in one line each, before a process is spawned or a GPU touched.
---

# Checks before any rank starts

A mistake found by a rank costs the start-up of every rank (minutes on a large
model) and reaches the user as a traceback of another process; found after
$N$ steps, it costs the steps too. So before [the launcher](../finetune_neox.html)
spawns anything, `preflight` checks, on this host and with no process group:

1. **outputs**: `out` and `log_dir` are directories (or can be made) that this
   user can write, and `out` has room for one checkpoint when the job writes
   any: about $p\Psi + K\Psi_t$ bytes (`checkpoint_bytes`), from the model's
   shapes on the meta device (no memory);
2. **the Hugging Face snapshot** (`checkpoint`): the [checkpoint
   loader's](checkpoint.html) `check_hf_snapshot`: `config.json` is a JSON
   object that describes a GPT-NeoX, and every tensor the model needs is in the
   safetensors headers with the shape the config implies (headers only: no
   weights are read);
3. **the data** ([the fine-tune's data](job_data.html)): the tokenizer fits
   the model, the corpus is read (and tokenised once, into its cached token
   file) and holds at least one step;
4. **the checkpoint to resume**: the [checkpoint
   package's](../zero3/checkpoint/preflight.html) `check_resumable` (a
   complete checkpoint of this model: the same parameter names and shapes),
   then written by this job with the same seed, training split and global
   batch $B A N_d$ (the data order depends on them; the world size may
   differ, see [resuming](job_checkpoints.html)), and one that leaves steps to
   train.

Each failure is a `PreflightError` whose message names the file or the setting;
the command line prints it as one line and exits with status 2.

## Limitations

* A filesystem can fill up between this check and the save; the save itself
  then fails, and leaves the previous checkpoint in place.
* Resuming with another global batch is refused: it would train on other
  samples than the interrupted run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from labml_zero.neox import model as neox_model
from labml_zero.neox.checkpoint import check_hf_snapshot
from labml_zero.neox.corpus import DataError
from labml_zero.neox.job_checkpoints import check_global_batch
from labml_zero.neox.job_data import JobData, job_data
from labml_zero.zero3.checkpoint import (CheckpointError, CheckpointReader,
                                         check_resumable, sequential_shapes)
from labml_zero.zero3.memory_model import OPTIMIZER_BYTES

__all__ = ["PreflightError", "Preflight", "preflight", "check_writable_dir",
           "checkpoint_bytes", "check_resume"]


class PreflightError(ValueError):
    """A setting or a file that would make the job fail; the message is one line."""


class Preflight(NamedTuple):
    """
    ## What the checks found

    * `neox`: the model's shape;
    * `resumed_step`: the step the checkpoint to resume was saved after, or
      `None` when starting afresh;
    * `data`: the tokenizer, the datasets and the run's steps.
    """

    neox: neox_model.NeoXConfig
    resumed_step: int | None
    data: JobData | None = None


def check_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """
    ### A directory this process can write, made if missing

    Writes and removes one temporary file: permission bits do not tell about
    read-only mounts or quotas.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise PreflightError(f"{what} {directory} is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise PreflightError(f"{what} {directory} is not writable "
                             f"({e.strerror or e})") from e
    return directory


def checkpoint_bytes(layers: list[nn.Module], dtype: torch.dtype) -> int:
    r"""
    ### Bytes of one checkpoint, over all ranks

    $p\Psi + K\Psi_t$: every parameter shard in the chunk dtype ($p$ bytes),
    and for trainable ones the fp32 master and two moments ($K$ is the memory
    model's `OPTIMIZER_BYTES`, less the master when the fp32 shard is its own).
    `layers` are marked by the fine-tuner.
    """
    p = dtype.itemsize
    k = OPTIMIZER_BYTES - 4 if p == 4 else OPTIMIZER_BYTES
    total = trainable = 0
    for param in (q for layer in layers for q in layer.parameters()):
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return p * total + k * trainable


def check_resume(path: Path, layers: list[nn.Module], config, world_size: int,
                 data: JobData) -> int:
    """
    ### A checkpoint this job can continue from; returns its step

    `check_resumable` reads the manifest, checks every file's size and the
    model's parameter names and shapes (`layers` on the meta device); then the
    small `extra` state must hold the step and a data order of the same seed,
    training split and global batch. No shard is read.
    """
    try:
        check_resumable(path, world_size=world_size,
                        shapes=sequential_shapes(layers),
                        expect={"seed": config.seed})
        extra = CheckpointReader(path).extra() or {}
    except (CheckpointError, OSError) as e:
        # the package's messages name the checkpoint already
        raise PreflightError(f"--resume: {e}") from e
    if not isinstance(extra, dict) or "step" not in extra or "sampler" not in extra:
        raise PreflightError(f"--resume {path} is not a checkpoint of this job "
                             f"(its extra state has no step and sampler position)")
    sampler = extra["sampler"]
    if sampler.get("seed") != config.seed:
        raise PreflightError(f"--resume {path} was saved with seed "
                             f"{sampler.get('seed')}, this run has --seed "
                             f"{config.seed}: the data order would differ")
    refusal = check_global_batch(path, sampler, config, world_size)
    if refusal is not None:
        raise PreflightError(refusal)
    if sampler.get("n_samples") != len(data.train):
        raise PreflightError(f"--resume {path} was saved with a training split of "
                             f"{sampler.get('n_samples')} samples, this run's has "
                             f"{len(data.train)} (other data or --seq-len): the "
                             f"data order would differ")
    step = int(extra["step"])
    if data.total_steps <= step:
        length = (f"--steps {config.steps}" if config.steps is not None else
                  f"--epochs {config.epochs} ({data.total_steps} steps)")
        raise PreflightError(f"--resume {path} is already at step {step}: "
                             f"{length} leaves nothing to train")
    return step


def preflight(config, *, world_size: int, device: torch.device) -> Preflight:
    """
    ## Every check, in the order of the introduction

    `config` is a `FinetuneConfig`; `device` is where the ranks will run (it
    decides the default dtype).
    """
    # config.json (through `model_config`), then `filter_layers` and `seq_len`
    # against it, then the tensors against both
    neox = config.model_config()
    group = config.shard_group_size
    if group is not None and world_size % group:
        raise PreflightError(f"--shard-group-size {group} does not divide the "
                             f"world size {world_size}")
    if config.checkpoint is not None:
        try:
            check_hf_snapshot(config.checkpoint)
        except CheckpointError as e:
            raise PreflightError(str(e)) from e
    layers = neox_model.build_layers(neox, filter_layers=config.filter_layers,
                                     device="meta")
    # the chunk layout a resume compares against: LoRA's options included
    config.tuner()(layers)

    out = check_writable_dir(config.out, "--out")
    check_writable_dir(config.log_dir, "--log-dir")
    if config.checkpoint_every is not None:
        need = checkpoint_bytes(layers, config.torch_dtype(device))
        free = shutil.disk_usage(out).free
        if free < need:
            raise PreflightError(f"--out {out} has {free / 2**30:.1f} GiB free, one "
                                 f"checkpoint needs {need / 2**30:.1f} GiB")

    try:
        data = job_data(config, world_size=world_size, n_vocab=neox.n_vocab)
    except (DataError, OSError) as e:
        raise PreflightError(str(e)) from e
    step = None
    if config.resume is not None:
        step = check_resume(Path(config.resume), layers, config, world_size, data)
    return Preflight(neox, step, data)
