r"""
---
title: Checks before any rank starts
summary: Everything about a fine-tune that can be checked on the launcher's host is
  checked there, in one line each, before a process is spawned or a GPU touched.
---

# Checks before any rank starts

A mistake found by a rank costs the start-up of every rank (minutes on a large
model) and reaches the user as a traceback of another process; found after
$N$ steps, it costs the steps too. So before [the launcher](cli.html)
spawns anything, `preflight` checks, on this host and with no process group,
the outputs, the exports, the host's memory, the data, the Hugging Face snapshot,
the checkpoint to resume and the room for the checkpoints the run keeps (each
beside its lines in `preflight`).

Each failure is a `PreflightError` whose message names the file or the setting;
the command line prints it as one line and exits with status 2.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from labml_zero.finetune.checkpoints import (check_global_batch,
                                             continued_checkpoints,
                                             saved_model_settings, saved_steps)
from labml_zero.finetune.corpus import DataError
from labml_zero.finetune.data import JobData, job_data, training_key
from labml_zero.files import size_text
from labml_zero.family import ADAPTER_EXPORT, HF_EXPORT
from labml_zero.launch import ranks_text
from labml_zero.zero3.checkpoint import (CheckpointError, CheckpointReader,
                                         check_resumable, sequential_shapes,
                                         sequential_trainables)
from labml_zero.zero3.checkpoint.pruning import checkpoint_dirs
from labml_zero.planner.placement import device_optimizer_bytes
from labml_zero.zero3.state_layout import FP32_STATES, StateLayout, state_layout

__all__ = ["PreflightError", "Preflight", "preflight", "check_writable_dir",
           "checkpoint_bytes", "saves_at_peak", "check_checkpoint_room",
           "check_resume", "check_exports", "check_host_memory", "RANK_BASE_BYTES"]

# What one rank of the tiny model holds in host memory at its peak, rounded
# up: the interpreter with torch and labml, the tokenizer and the data, gloo's
# buffers (tested: tests/test_finetune_failures.py::test_a_rank_fits_its_estimate).
RANK_BASE_BYTES = 2**30


class PreflightError(ValueError):
    """A setting or a file that would make the job fail; the message is one line."""


class Preflight(NamedTuple):
    """
    ## What the checks found

    * `model`: the model's shape, its family's config;
    * `resumed_step`: the step the checkpoint to resume was saved after, or
      `None` when starting afresh;
    * `data`: the tokenizer, the datasets and the run's steps.
    """

    model: Any
    resumed_step: int | None
    data: JobData | None = None


def existing_ancestor(path: Path) -> Path:
    """`path`, or the nearest directory above it that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(path: str | os.PathLike, what: str, *,
                       writes: str | None = None) -> Path:
    """
    ### A directory this process can write, or could make

    Writes and removes one temporary file in it, or in the nearest directory
    above it that exists (where the job will make it): permission bits do not
    tell about read-only mounts or quotas. Nothing is made here, so a run
    refused by a later check leaves no directory behind. `writes` is the
    folder below `path` that the run writes into (`checkpoints`, labml's
    experiment): a file of that name would otherwise be found only by the
    rank that first makes it, after the start or the first steps.
    """
    directory = Path(path)
    there = existing_ancestor(directory / writes if writes else directory)
    if not there.is_dir():
        raise PreflightError(f"{what} {directory}: {there} is a file, not a "
                             f"directory")
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as e:
        raise PreflightError(f"{what} {directory} is not writable "
                             f"({e.strerror or e})") from e
    return directory


def checkpoint_bytes(layers: list[nn.Module], dtype: torch.dtype,
                     states: StateLayout = FP32_STATES) -> int:
    r"""
    ### Bytes of one checkpoint, over all ranks

    $p\Psi + K\Psi_t$: every parameter shard in the chunk dtype ($p$ bytes),
    and for trainable ones the optimizer's states ($K$ bytes an element, those of
    the run's [state layout](../zero3/state_layout.html), less the master when
    the fp32 shard is its own: placement's `device_optimizer_bytes`).
    `layers` are marked by the fine-tuner; a matrix tied into two layers is
    saved once, by the layer that owns it.
    """
    p = dtype.itemsize
    k = device_optimizer_bytes(p, states)
    total = trainable = 0
    for param in unique_parameters(layers):
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    # rounded up: with 8-bit moments the optimizer's $K$ holds a fraction of
    # a byte per element, each block's scale shared by its elements
    return math.ceil(p * total + k * trainable)


def unique_parameters(layers: list[nn.Module]) -> list[nn.Parameter]:
    """The layers' parameters, a tied one once."""
    return list({id(q): q for layer in layers for q in layer.parameters()}.values())


def saves_at_peak(config, *, first_step: int, total_steps: int,
                  existing: int) -> int:
    r"""
    ### New checkpoints on the disk at once, at the fullest moment of the run

    The run saves every `checkpoint_every` steps and at its last step: $n$ saves
    after `first_step`. With `keep_checkpoints` $k \geq 1$, an old checkpoint is
    removed only once the new one is complete, so during a save $k + 1$ are on
    the disk; the $e$ complete ones already under `out` of the lineage the run
    continues (`existing`, the ones pruning may remove; see [resuming](checkpoints.html))
    are counted in its used space. So the run needs room for $\min(k + 1, e + n) - e$ new ones, at
    least the one it writes first (pruning starts only after it); with $k = 0$,
    all $n$.
    """
    n = len(saved_steps(config, first_step, total_steps))
    if n <= 0:
        return 0
    k = config.keep_checkpoints
    if k == 0:
        return n
    return max(1, min(k + 1, existing + n) - existing)


def check_checkpoint_room(config, layers: list[nn.Module], dtype: torch.dtype, *,
                          first_step: int, total_steps: int) -> None:
    """
    ### `--out` has room for the checkpoints the run keeps, plus the one it writes

    A filesystem can still fill up between this check and the save; the save
    itself then fails, and leaves the previous checkpoint in place.

    `saves_at_peak` checkpoints of `checkpoint_bytes` each, from the model's
    shapes on the meta device (no memory); the checkpoints already under `out`
    are counted at that size too.
    """
    if config.checkpoint_every is None:
        return
    out = config.out_dir
    # A save replaces a directory of its name: one this run would write that
    # is already there (another run's, or this run's own later ones when it
    # branches off an earlier checkpoint) is refused, never overwritten.
    steps = set(saved_steps(config, first_step, total_steps))
    taken = [path for step, path in checkpoint_dirs(out / "checkpoints")
             if step in steps]
    if taken:
        raise PreflightError(
            f"--out {out} already holds {taken[0].name}, which this run would "
            f"write over: it is another run's (or this run's past the step "
            f"resumed); give another --out, or --resume its newest checkpoint")
    # the ones pruning may remove: the lineage's this run continues
    existing = len(continued_checkpoints(config) or [])
    saves = saves_at_peak(config, first_step=first_step, total_steps=total_steps,
                          existing=existing)
    one = checkpoint_bytes(layers, dtype, state_layout(config.optimizer_states))
    free = shutil.disk_usage(existing_ancestor(out)).free
    if free < saves * one:
        kept = (f"--keep-checkpoints {config.keep_checkpoints}"
                if config.keep_checkpoints else "--keep-checkpoints 0 (all kept)")
        there = f", {existing} already there" if existing else ""
        raise PreflightError(
            f"--out {out} has {size_text(free)} free, the run needs "
            f"{size_text(saves * one)}: {saves} new checkpoint"
            f"{'s' if saves != 1 else ''} of {size_text(one)} on the disk at once "
            f"with {kept}{there}")


def check_exports(config, layers: list[nn.Module], dtype: torch.dtype) -> None:
    """
    ### Where the exports go, before training, not after it

    An export replaces its directory whole, so one pointed at the wrong place
    would delete what is there (see the rules on [the export's
    page](../neox/lora_export.html)); each destination is also checked writable, with
    room for its size from `layers`' shapes.
    """
    # `--export-merged` is `--export-hf`'s older name: the message says the one given
    hf_flag = "--export-merged" if config.export_merged else "--export-hf"
    flags = {"export_adapter": ("--export-adapter", ADAPTER_EXPORT),
             "export_hf": (hf_flag, HF_EXPORT)}
    family = config.family
    # Where the run itself writes, below the directories it is given. Empty now,
    # such a directory holds the run's checkpoints or logs by the end, and the
    # export, which may replace only an empty directory or an earlier export,
    # would be refused then, after the training.
    written = {"--out": config.out_dir / "checkpoints",
               "--log-dir": Path(config.log_dir) / family.experiment}
    if config.export_adapter is not None and config.checkpoint is None:
        raise PreflightError("--export-adapter needs --checkpoint: an adapter "
                             "trained on random weights has no base model to load "
                             "it onto (use --export-hf)")
    for name, (flag, kind) in flags.items():
        path = getattr(config, name)
        if path is None:
            continue
        for other, inside in written.items():
            target = Path(path).expanduser().resolve()
            if contains(inside.expanduser().resolve(), target):
                raise PreflightError(f"{flag} {path} is inside {inside}, where the run "
                                     f"writes its own files ({other}); give a "
                                     f"directory outside it")
        protected = {"--out": config.out_dir, "--log-dir": config.log_dir,
                     "--checkpoint": config.checkpoint, "--resume": config.resume}
        protected |= {f: getattr(config, n) for n, (f, _) in flags.items()
                      if n != name}
        try:
            family.check_export_destination(
                path, kind, flag=flag, protected=protected,
                need_bytes=family.export_bytes(layers, kind,
                                               config.export_dtype(dtype)))
        except ValueError as e:  # the export page's `ExportDestinationError`
            raise PreflightError(str(e)) from e


def contains(outer: Path, inner: Path) -> bool:
    """`inner` is `outer` or below it (both resolved)."""
    return inner == outer or outer in inner.parents


def available_host_bytes() -> int | None:
    """`MemAvailable` from `/proc/meminfo` (Linux), else free pages; `None` if
    neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(config, layers: list[nn.Module], *, world_size: int,
                      ranks_here: int, device: torch.device) -> None:
    r"""
    ### The ranks of this host fit in its memory

    A rank is estimated at `RANK_BASE_BYTES` plus the model states it keeps
    in host memory: on CPU its whole share, $(p\Psi + (4 + K)\Psi_t) / N$
    (`checkpoint_bytes` and the fp32 gradient shards); on GPUs the offloaded
    fraction of the optimizer states ($K_h$ bytes an element, the layout's
    `host_bytes_per_element`). Too many ranks for the host would be
    killed one by one by the kernel; refused here instead.
    """
    available = available_host_bytes()
    if available is None:
        return
    layout = state_layout(config.optimizer_states)
    states = checkpoint_bytes(layers, config.torch_dtype(device), layout)
    trainable = sum(q.numel() for q in unique_parameters(layers)
                    if q.requires_grad)
    if device.type == "cpu":
        held = states + 4 * trainable
    else:
        # the state's bytes in a host home (with a copy of the weight where
        # the layout keeps no master)
        offload = config.offload_optimizer
        param_bytes = config.torch_dtype(device).itemsize
        held = (offload if isinstance(offload, float) else 0.0) * \
            layout.host_bytes_per_element(param_bytes) * trainable
    rank = RANK_BASE_BYTES + held / world_size
    need = ranks_here * rank
    if need > available:
        raise PreflightError(
            f"--world-size {world_size}: this host would run "
            f"{ranks_text(ranks_here)}, about {size_text(need)} in all "
            f"({size_text(rank)} each), and has {size_text(available)} "
            f"available; use fewer ranks")


def check_same_trainables(path: Path, reader: CheckpointReader,
                          layers: list[nn.Module], config, saved: str | None):
    """
    ### The checkpoint trained the parameters this run trains

    Each trained parameter resumes its optimizer state, and a chunk holds one
    step of it: a parameter frozen in the checkpoint has none to resume (and
    would share a chunk with ones that have), so another fine-tuner is refused
    here, not when a rank reads the shards. The way to train more of a model
    is a new run from its export.
    """
    trained = sequential_trainables(layers)
    for name in sequential_shapes(layers):
        there = bool(reader.chunk_of(name).get("trainable"))
        if there != (name in trained):
            was, keep = (f"--finetune {saved}", "leave the flag out") if saved \
                else ("another fine-tuner", "give its --finetune")
            raise PreflightError(
                f"--resume {path} was trained with {was}, this run gives "
                f"--finetune {config.finetune}: {name!r} is "
                f"{'trained' if there else 'frozen'} there and "
                f"{'trained' if name in trained else 'frozen'} here ({keep} to "
                f"resume it, or export it with python -m labml_zero.export and "
                f"start a new run from the export with --checkpoint)")


def other_snapshot_hint(path: Path, config) -> str:
    """
    #### The snapshot a checkpoint trained from, where this run names another

    A run from a Hugging Face `--checkpoint` builds that model; resumed without
    it (or with another), the model built is another one, refused as such:
    the manifest's export record names the snapshot to give again.
    """
    try:
        export = CheckpointReader(path).meta.get("export") or {}
        snapshot = export.get("snapshot")
    except (CheckpointError, OSError, AttributeError):
        return ""
    ours = str(Path(config.checkpoint).resolve()) if config.checkpoint else None
    if not isinstance(snapshot, str) or snapshot == ours:
        return ""
    return f" (it trained from --checkpoint {snapshot}: give it again)"


def check_resume(path: Path, layers: list[nn.Module], config, world_size: int,
                 data: JobData) -> int:
    """
    ### A checkpoint this job can continue from; returns its step

    `check_resumable` reads the manifest, checks every file's size and the
    model's parameter names and shapes (`layers` on the meta device); then the
    small `extra` state must hold the step and a data order of the same seed,
    training split and global batch (another would train on other samples
    than the interrupted run). The split is compared by the identity the
    checkpoint recorded (`training_key`), and by its count of samples in one
    saved before it did. No shard is read.
    """
    try:
        check_resumable(path, world_size=world_size,
                        shapes=sequential_shapes(layers),
                        expect={"seed": config.seed})
        reader = CheckpointReader(path)
        extra = reader.extra() or {}
    except (CheckpointError, OSError) as e:
        # the package's messages name the checkpoint already; a run's `--out`
        # (or its `checkpoints`) given for one of its checkpoints gets the newest
        found = checkpoint_dirs(path) or checkpoint_dirs(path / "checkpoints")
        hint = (f" (its newest checkpoint is {found[-1][1]})" if found
                else other_snapshot_hint(path, config))
        raise PreflightError(f"--resume: {e}{hint}") from e
    if not isinstance(extra, dict) or "step" not in extra or "sampler" not in extra:
        raise PreflightError(f"--resume {path} is not a checkpoint of this job "
                             f"(its extra state has no step and sampler position)")
    saved = saved_model_settings(reader.meta)
    alpha = saved.get("lora_alpha")
    if alpha is not None and config.finetune == "lora" and alpha != config.lora_alpha:
        raise PreflightError(f"--resume {path} trained its adapters with "
                             f"--lora-alpha {alpha:g}, this run gives "
                             f"{config.lora_alpha:g}: the adapters would scale "
                             f"otherwise (leave the flag out to keep {alpha:g})")
    check_same_trainables(path, reader, layers, config, saved.get("finetune"))
    # The layers a `--filter-layers` run kept are named by position, so another
    # choice of the same shapes would pass the names check: their Hugging Face
    # prefixes, recorded for the export, tell them apart.
    export = reader.meta.get("export") if isinstance(reader.meta, dict) else None
    kept = export.get("prefixes") if isinstance(export, dict) else None
    ours = [config.family.hf_prefix(layer) for layer in layers]
    if isinstance(kept, list) and kept != ours:
        i = next((i for i, (a, b) in enumerate(zip(kept, ours)) if a != b),
                 min(len(kept), len(ours)))
        theirs, mine = (repr(names[i]) if i < len(names) else "none"
                        for names in (kept, ours))
        raise PreflightError(f"--resume {path} trained other layers: its layer {i} "
                             f"is {theirs}, this run's {mine} (another "
                             f"--filter-layers?)")
    sampler = extra["sampler"]
    if sampler.get("seed") != config.seed:
        raise PreflightError(f"--resume {path} was saved with seed "
                             f"{sampler.get('seed')}, this run has --seed "
                             f"{config.seed}: the data order would differ")
    refusal = check_global_batch(path, sampler, config, world_size)
    if refusal is not None:
        raise PreflightError(refusal)
    # the split's identity, recorded since checkpoints saved it; an older
    # checkpoint has only its count of samples, compared below
    recorded = reader.meta.get("training_data") if isinstance(reader.meta, dict) \
        else None
    if recorded is not None and recorded != training_key(config, data.caches):
        given = (f"--data {config.data}" if config.data is not None
                 else "the bundled text (no --data)")
        raise PreflightError(f"--resume {path} trained on another training "
                             f"split than {given} gives (the files' content, "
                             f"--text-field and --valid-data or --valid-fraction "
                             f"decide it): the data order would continue over "
                             f"other samples; give the data it trained on, or "
                             f"start a new run from its export with --checkpoint")
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
    ## Every check, each beside its lines

    `config` is a `FinetuneConfig`; `device` is where the ranks will run (it
    decides the default dtype).
    """
    # **The Hugging Face snapshot** (`checkpoint`): `config.json` (through
    # `model_config`, the [family](../family.html)'s `snapshot_config`) is a JSON
    # object that describes a model of a family, with every field it needs
    # (a Llama's `num_key_value_heads` too: transformers would default it to
    # `num_attention_heads`, a guess this job refuses to make) and heads that
    # divide; `filter_layers` and `seq_len` fit it; then the family's
    # `check_snapshot`: every tensor the model needs is in the safetensors
    # headers with the shape the config implies (headers only: no weights are
    # read). The model built on meta must have each parameter in one layer.
    model = config.model_config()
    family = config.family
    group = config.shard_group_size
    if group is not None and world_size % group:
        raise PreflightError(f"--shard-group-size {group} does not divide the "
                             f"world size {world_size}")
    if config.checkpoint is not None:
        try:
            family.check_snapshot(config.checkpoint)
        except CheckpointError as e:
            raise PreflightError(f"--checkpoint: {e}") from e
    layers = family.build(model, filter_layers=config.filter_layers, device="meta")
    # the chunk layout a resume compares against: LoRA's options included
    config.tuner()(layers)

    # **Outputs**: `out` and `log_dir` are directories (or can be made) that this
    # user can write, and so are the folders the run makes in them: `out`'s
    # `checkpoints` when it saves, and labml's experiment under `log_dir`. Their
    # room for checkpoints is checked once the run's steps are known, below.
    saved_into = "checkpoints" if config.checkpoint_every is not None else None
    check_writable_dir(config.out_dir, "--out", writes=saved_into)
    check_writable_dir(config.log_dir, "--log-dir", writes=family.experiment)

    # **Exports** (`export_hf`, LoRA's `export_adapter`): each is a new or
    # empty directory or a previous export of its kind, never a file nor a
    # directory the run reads or writes otherwise, writable, with room for the
    # export ([the rules](../neox/lora_export.html)); an adapter needs a `checkpoint` to
    # name as its base.
    check_exports(config, layers, config.torch_dtype(device))
    # **Host memory**: the ranks this host starts fit in its available memory,
    # each about `RANK_BASE_BYTES` (the interpreter, torch, the data) plus its
    # share of the model states held in host memory.
    check_host_memory(config, layers, world_size=world_size, device=device,
                      ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))

    # **The data** ([the fine-tune's data](data.html)): the tokenizer fits
    # the model, the corpus is read (and tokenised once, into its cached token
    # file) and holds at least one step.
    try:
        data = job_data(config, world_size=world_size, n_vocab=model.n_vocab)
    except (DataError, OSError) as e:
        raise PreflightError(str(e)) from e

    # **The checkpoint to resume**: the [checkpoint
    # package's](../zero3/checkpoint/preflight.html) `check_resumable` (a
    # complete checkpoint of this model: the same parameter names and shapes),
    # then written by this job with the same seed, training split and global
    # batch $B A N_d$ (`check_resume`; the world size may differ, see
    # [resuming](checkpoints.html)).
    step = None
    if config.resume is not None:
        step = check_resume(Path(config.resume), layers, config, world_size, data)

    # **Room for the checkpoints**, when the job writes any: each is about
    # $p\Psi + K\Psi_t$ bytes (`checkpoint_bytes`), and during a save the kept
    # ones and the new one are on the disk together (`saves_at_peak`). A
    # filesystem can still fill up between this check and a save; the save
    # itself then fails, and leaves the previous checkpoint in place.
    check_checkpoint_room(config, layers, config.torch_dtype(device),
                          first_step=step or 0, total_steps=data.total_steps)
    return Preflight(model, step, data)
