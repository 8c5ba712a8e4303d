r"""
---
title: Tracking the fine-tune with labml
summary: One labml run over all ranks (one uuid, a directory per rank), the app
  writer only when an app answered, and the numbers each step records.
---

# Tracking the fine-tune with labml

Each rank creates the same labml run (one uuid, agreed by a broadcast) with its own
rank, so labml keeps a directory per rank (`<log_dir>/zero3_neox/<uuid>.<rank>/`)
and the labml app merges them. The tracked numbers are already means over all
ranks (one all-reduce of three scalars per step, see [the job](finetune.html)), so
every rank's log agrees; only rank 0 prints. The app writer is on only when
`app_url` answered a probe; otherwise nothing touches the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import torch.distributed as dist

from labml_zero.app_client import app_url_if_running, labml_app_settings
from labml_zero.launch import DistContext
from labml_zero.neox.finetune_config import FinetuneConfig

__all__ = ["EXPERIMENT_NAME", "start_labml", "labml_configs", "VALID_INDICATORS"]

# What a step records: `loss.train`, `acc.train`, the mean cross-entropy and the
# next-token accuracy over the step's $B \cdot A \cdot N_d$ sequences; and
# `loss.valid`, `acc.valid`, the same on the validation batches, only at the steps
# where they are measured (every `valid_every`). labml's screen line would repeat
# the last value of an indicator on every later line, so these two are kept off
# it and printed on their own line when measured.
EXPERIMENT_NAME = "zero3_neox"
VALID_INDICATORS = ("loss.valid", "acc.valid")


def git_root(path: Path) -> Path | None:
    for directory in (path, *path.parents):
        if (directory / ".git").exists():
            return directory
    return None


def start_labml(config: FinetuneConfig, ctx: DistContext, *, python_file: str
                ) -> str:
    """
    ## One labml run over all ranks; returns its uuid

    Rank 0 picks the uuid and probes the app (see [the app
    client](../app_client.html)); a broadcast tells the others, so every rank
    agrees without each probing (and under torchrun, where no parent process
    could pick for them). `python_file` is the job's source, which labml records.
    """
    from labml import experiment, lab, logger, tracker

    decision = [None, None]
    if ctx.rank == 0:
        from uuid import uuid1

        answered = (app_url_if_running(config.app_url)
                    if config.app_url is not None else None)
        decision = [uuid1().hex, answered]
    dist.broadcast_object_list(decision, src=0)
    run_uuid, app_url = decision

    log_dir = Path(config.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    # labml's project path is where it reads the git commit it records with the
    # run: the repository we run in, if any. Runs go to `log_dir` either way.
    settings = {"path": str(git_root(Path.cwd()) or log_dir),
                "experiments_path": str(log_dir)}
    writers = {"file"} | ({"screen"} if ctx.rank == 0 else set())
    if app_url is not None:
        settings.update(labml_app_settings(app_url))
        writers.add("app")
    elif config.app_url is not None and ctx.rank == 0:
        logger.log(f"no labml app answered at {config.app_url} within 2 s; "
                   f"tracking offline to {log_dir}")
    # labml looks for a .labml.yaml above the project path and above the job's
    # file, and prints a warning box for each that is missing; every setting is
    # given here, so that warning is swallowed, with anything else labml prints
    # while the run is set up (such as a notice that the directory is not a git
    # repository).
    with contextlib.redirect_stdout(io.StringIO()):
        lab.configure(settings)
        experiment.create(name=EXPERIMENT_NAME, uuid=run_uuid, writers=writers,
                          python_file=python_file, distributed_rank=ctx.rank,
                          distributed_world_size=ctx.world_size)
    for name in VALID_INDICATORS:
        tracker.set_scalar(name, is_print=False)
    return run_uuid


def labml_configs(config: FinetuneConfig, ctx: DistContext, **facts) -> dict:
    """
    ## What labml records as the run's configuration

    The config's fields (but where the logs go and the app's address, which say
    nothing about the run), the dtype resolved for this device, the world size
    and backend, and `facts`: what the build found (parameter counts, chunks).
    """
    return {
        **{k: v for k, v in dataclasses.asdict(config).items()
           if k not in ("log_dir", "app_url")},
        "filter_layers": (None if config.filter_layers is None
                          else list(config.filter_layers)),
        "dtype": str(config.torch_dtype(ctx.device)).removeprefix("torch."),
        "engine": "zero3_chunks",
        "optimizer": "AdamFP16",
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        **facts,
    }
