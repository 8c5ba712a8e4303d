r"""
---
title: The fine-tune's checkpoints and resuming
summary: What a checkpoint of the fine-tune holds beside the shards, flags that
  override its saved settings on a resume, and resuming at another world size
  that keeps the global batch.
---

# The fine-tune's checkpoints and resuming

Beside the [sharded checkpoint](../zero3/checkpoint/index.html)'s shards and
optimizer state, the job saves the small global state that a resume needs to
continue the same run: its step, its [data order](dataset.html)'s position, the
loss scale and its settings. A run may resume at another world size $N_d'$ as
long as it keeps the global batch:

$$B' A' N_d' = G = B A N_d$$
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from labml_zero.finetune.data import training_key
from labml_zero.finetune.token_file import TokenCache
from labml_zero.launch import ranks_text
from labml_zero.zero3.checkpoint import (CheckpointReader, load_checkpoint,
                                         prune_checkpoints, save_checkpoint)
from labml_zero.zero3.checkpoint.export import in_first_group
from labml_zero.zero3.checkpoint.pruning import checkpoint_dirs

__all__ = ["SETTINGS", "saved_settings", "override_settings", "resume_settings",
           "check_global_batch", "checkpoint_path", "export_meta", "save",
           "resume", "saved_model_settings", "saved_steps", "run_lineage",
           "continued_checkpoints"]

# The run's settings a checkpoint keeps and a flag on `--resume` overrides:
# hyperparameters, precision, and how often it validates and saves. The
# model's own settings (shape, fine-tuner, LoRA) are not among them: a
# checkpoint holds their chunks, and the fine-tuner with LoRA's options (alpha
# is no chunk's shape) comes from the manifest's `meta` (`resume_settings`).
SETTINGS = ("lr", "weight_decay", "clip_grad", "lr_schedule", "warmup_steps",
            "min_lr", "steps", "epochs", "optimizer_states", "dtype",
            "checkpoint_every", "keep_checkpoints", "valid_every", "valid_batches")
LENGTH = ("steps", "epochs")


def saved_settings(config) -> dict:
    """`SETTINGS` of a `FinetuneConfig`, as saved in a checkpoint."""
    return {name: getattr(config, name) for name in SETTINGS}


def shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def override_settings(config, given: set[str], saved: dict):
    """
    ### The saved settings, but those whose flag is `given`

    Returns the config to run and the line that says what the flags changed
    (`None` when nothing did), reported before any rank starts (`--resume: lr
    0.003 → 1.0`). So a resumed run continues the same learning-rate curve by
    default (the [schedule](lr_schedule.html) is a pure function of the step
    and these settings), and a user can still lower the rate of a run going
    badly. `--steps` and `--epochs` are one setting, the run's length: giving
    either replaces both. The result is checked again by the config's
    `__post_init__` (a saved warm-up may not fit a shorter `--steps`).
    """
    length_given = bool(given & set(LENGTH))
    kept, changes = {}, []
    for name in SETTINGS:
        if name not in saved:
            continue
        flagged = name in given or (name in LENGTH and length_given)
        if not flagged:
            kept[name] = saved[name]
        elif saved[name] != getattr(config, name):
            changes.append(f"{name} {shown(saved[name])} → "
                           f"{shown(getattr(config, name))}")
    line = f"--resume: flags override saved settings: {', '.join(changes)}" \
        if changes else None
    return dataclasses.replace(config, **kept), line


def resume_settings(config, given: set[str]):
    """
    ### `override_settings` with the settings saved in `config.resume`

    A checkpoint that cannot be read is left to the pre-flight checks, which
    say why in one line.
    """
    try:
        reader = CheckpointReader(config.resume)
        extra = reader.extra() or {}
    except Exception:  # any unreadable checkpoint: preflight reports it
        return config, None
    # The fine-tuner and LoRA's options are part of the model the checkpoint
    # trained: kept unless their flag is given (a different one is refused by
    # `check_resume`). LoRA's scale $\alpha / r$ is no chunk's shape, so only
    # the manifest's `meta` knows it.
    kept = {name: value for name, value in saved_model_settings(reader.meta).items()
            if name not in given}
    if kept.get("finetune", config.finetune) != "lora":
        kept = {name: value for name, value in kept.items()
                if not name.startswith("lora_")}
    if kept:
        config = dataclasses.replace(config, **kept)
    saved = extra.get("settings") if isinstance(extra, dict) else None
    if not isinstance(saved, dict):
        return config, None
    return override_settings(config, given, saved)


def saved_model_settings(meta: dict) -> dict:
    r"""
    ### The fine-tuner and LoRA options a checkpoint was trained with

    From its manifest's `meta` (`save`, `export_meta`): `finetune` (saved
    since the job recorded it; a checkpoint with adapters is a LoRA one) and,
    for adapters, `lora_rank`, `lora_alpha` and `lora_targets`. Empty for a
    checkpoint that recorded none of them.
    """
    if not isinstance(meta, dict):
        return {}
    lora = (meta.get("export") or {}).get("lora")
    settings = {}
    if isinstance(meta.get("finetune"), str):
        settings["finetune"] = meta["finetune"]
    if isinstance(lora, dict):
        settings.setdefault("finetune", "lora")
        for key in ("rank", "alpha", "targets"):
            if key in lora:
                value = lora[key]
                settings[f"lora_{key}"] = tuple(value) if key == "targets" else value
    return settings


def check_global_batch(path: Path, sampler: dict, config, world_size: int
                       ) -> str | None:
    """
    ### Why this run cannot continue the checkpoint's data order, or `None`

    A step's samples depend on $G$ alone (see the data order's class), so a run
    at another world size with the same $G$ trains on the same samples in each
    step, the same mean loss and gradient up to the order of the sums, the
    shards resharded on load. A run with another $G$ would train on others: it
    is refused before any rank starts, in one line that says the layout to use
    (keeping `--batch-size` where it can), or that $G$ does not split over the
    ranks.
    """
    b, a = config.batch_size, config.grad_accum
    g, saved = b * a * world_size, sampler.get("global_batch")
    if saved == g:
        return None
    if not isinstance(saved, int):
        return (f"--resume {path} has no global batch in its data order (saved by "
                f"an older version): it cannot be continued")
    if saved % world_size:
        advice = (f"{saved} sequences cannot be split over "
                  f"{ranks_text(world_size)}")
    elif (saved // world_size) % b == 0:
        advice = (f"at {ranks_text(world_size)} use --grad-accum "
                  f"{saved // world_size // b}")
    else:
        advice = (f"at {ranks_text(world_size)} use --batch-size "
                  f"{saved // world_size} --grad-accum 1")
    return (f"--resume {path} was saved with a global batch of {saved} sequences, "
            f"this run's is --batch-size {b} × --grad-accum {a} × "
            f"{ranks_text(world_size)} = {g}: the data order would differ "
            f"({advice})")


def checkpoint_path(config, step: int) -> Path:
    return config.out_dir / "checkpoints" / f"step-{step:06d}"


def export_meta(config, model) -> dict:
    """
    ### What an offline export needs, as JSON values

    Saved in the manifest's `meta` as `export`, so that `python -m
    labml_zero.export` writes the checkpoint as a Hugging Face one with no other
    input: `hf_config` is the model's `config.json` (which names its family);
    `prefixes[i]` is the Hugging Face prefix of the sharded model's layer $i$
    (its parameters are saved as `"i.<name>"`); `lora` is `None` unless the
    adapters are to be merged; `tokenizer` is the file the job encoded with;
    `dtype` the export's (`FinetuneConfig.export_dtype`).
    """
    training = config.torch_dtype(model.runtime.comm.device)
    family = config.family
    lora = None
    if config.finetune == "lora":
        lora = {"rank": config.lora_rank, "alpha": config.lora_alpha,
                "targets": list(config.lora_targets)}
    return {"hf_config": family.write_config(config.model_config()),
            "prefixes": [family.hf_prefix(layer.module) for layer in model.layers],
            "lora": lora,
            "tokenizer": str(family.tokenizer_file(config.checkpoint).resolve()),
            "snapshot": (str(Path(config.checkpoint).resolve())
                         if config.checkpoint else None),
            "dtype": str(config.export_dtype(training)).removeprefix("torch.")}


def saved_steps(config, first_step: int, total_steps: int) -> list[int]:
    """The steps after which a run from `first_step` to `total_steps` saves:
    every `checkpoint_every`-th and the last."""
    every = config.checkpoint_every
    if every is None:
        return []
    return [step for step in range(first_step + 1, total_steps + 1)
            if step % every == 0 or step == total_steps]


def lineage_of(path: Path) -> str | None:
    """The `lineage` a checkpoint's manifest records; `None` for one saved
    before the job recorded it, or one that does not read."""
    try:
        return CheckpointReader(path).meta.get("lineage")
    except Exception:  # not a checkpoint: no lineage to continue
        return None


def continued_checkpoints(config) -> list[Path] | None:
    """
    ### The checkpoints under `--out` of the run this one continues

    A *lineage* is a chain of runs, each resuming the newest checkpoint of the
    one before (a preempted job, started again), recorded in every manifest's
    `meta`. A run continues its checkpoint's lineage when nothing under `--out`
    of that lineage is newer; a run that branches off (resumes an earlier
    checkpoint, say with a lower rate) and a fresh run start their own:
    `None`.
    """
    if config.resume is None:
        return None
    lineage = lineage_of(Path(config.resume))
    step = CheckpointReader(config.resume).extra()["step"]
    same = [(saved, path) for saved, path in
            checkpoint_dirs(config.out_dir / "checkpoints")
            if lineage_of(path) == lineage]
    if any(saved > step for saved, _ in same):
        return None
    return [path for _, path in same]


def run_lineage(config, run_uuid: str) -> str | None:
    """
    ### The lineage this run's checkpoints record

    Its checkpoint's, when it continues one (`continued_checkpoints`), else its
    own, named by its labml run's `run_uuid`. Pruning removes only checkpoints
    of the run's lineage: neither another run's nor, after a branch, the
    branch point's later ones. Every rank reads the same manifests before any
    save, so all agree.
    """
    if continued_checkpoints(config) is None:
        return run_uuid
    return lineage_of(Path(config.resume))


def save(config, step: int, training, sampler, lineage: str | None, *,
         caches: tuple[TokenCache, ...] = ()) -> Path:
    """
    ### A sharded checkpoint after `step`, then the older ones pruned

    `training` is the job's `Training`. `extra` is global state (rank 0 writes
    it): `step`, the last step trained; `sampler`, the data order's position
    (epoch, step) with its seed, the number of training samples and $G$, the
    same on every rank; `scaler`, the fp16 loss scale, agreed by an all-reduce;
    `settings`, the run's `SETTINGS`. `lineage` is `run_lineage`'s: pruning
    removes only checkpoints of the same one. The manifest's `meta` records
    the training split's identity ([`training_key`](data.html), from `caches`'
    stamps, else from the files read once more), which a resume compares.
    """
    extra = {"step": step, "sampler": sampler.state_dict(),
             "settings": saved_settings(config)}
    if training.scaler is not None:
        extra["scaler"] = training.scaler.state_dict()
    # `meta` is in the manifest, where `check_resumable` compares it
    meta = {"step": step, "global_batch": sampler.global_batch, "seed": config.seed,
            "finetune": config.finetune, "lineage": lineage,
            "export": export_meta(config, training.model)}
    # rank 0 of the first shard group alone writes the manifest (under hybrid
    # sharding each group has a rank 0): the others skip the digest, and one
    # rank in the world prunes
    writer = (training.model.runtime.comm.rank == 0
              and in_first_group(training.model))
    if writer:
        meta["training_data"] = training_key(config, caches)
    path = save_checkpoint(checkpoint_path(config, step), training.model,
                           training.optimizer, extra=extra, meta=meta)
    # save_checkpoint returns once the checkpoint is complete on every rank
    if writer and config.keep_checkpoints:
        prune_checkpoints(path.parent, config.keep_checkpoints, just_saved=path,
                          same_meta="lineage")
    return path


def resume(config, training, sampler) -> int:
    """
    ### Continue from `config.resume`; returns the step it was saved after

    The shards are resharded if the world size changed. The optimizer's saved
    hyperparameters are replaced by the config's (already the saved ones unless
    a flag overrode them); the rate is set at each step by the schedule.
    """
    extra = load_checkpoint(config.resume, training.model,
                            training.optimizer).extra or {}
    if "step" not in extra or "sampler" not in extra:
        raise ValueError(f"{config.resume} is not a checkpoint of this job (its "
                         f"extra state has no step and sampler position)")
    # Refuses another global batch, seed or training split: the order would differ.
    sampler.load_state_dict(extra["sampler"])
    if training.scaler is not None and "scaler" in extra:
        training.scaler.load_state_dict(extra["scaler"])
    for group in training.optimizer.param_groups:
        group["weight_decay"] = config.weight_decay
    return int(extra["step"])
