r"""
---
title: The fine-tune's plan
summary: `--plan` prints the fastest setting that fits the named GPUs, with its
  memory and time term by term, and starts nothing; `--auto` runs the job
  with that setting.
---

# The fine-tune's plan

`python -m labml_zero.finetune --model pythia-1.4b --gpu h200 --plan`
asks [the planner](../planner/index.html) for the fastest setting of this job
that fits, prints it with the predicted peak memory of a rank, the host
memory, the step time term by term, the tokens per second and the MFU, and
exits 0 before any process starts: seconds, on any machine, no GPU needed.
`--auto` runs the job with the chosen setting instead of printing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, NamedTuple

import torch

from labml_zero import launch
from labml_zero.finetune.config import FinetuneConfig
from labml_zero.planner.devices import GIB, GPUS, Cluster, gpu_by_name, this_machine
from labml_zero.planner.search import NoFit, Pinned, Plan, describe, plan
from labml_zero.planner.setting import Job, gpu_kernels

__all__ = ["add_plan_flags", "FLAG_DESTS", "Request", "pop_request", "settle",
           "auto_line", "cluster_of"]

# The flags of the cluster and the global batch, which only a plan reads.
PLAN_FLAGS = ("gpu", "gpus", "nodes", "host_gib", "global_batch")
# Every flag this page adds to the command line, as argparse names them.
FLAG_DESTS = ("plan", "auto", *PLAN_FLAGS)
# FinetuneConfig fields that a setting sets → the planner's pin of each.
SETTING_FIELDS = {"batch_size": "batch", "grad_accum": "micro_batches",
                  "activation_checkpointing": "checkpointing",
                  "offload_optimizer": "offload_fraction",
                  "prefetch_depth": "prefetch_depth", "compile": "compile"}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


positive.__name__ = "positive integer"


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """
    ## The plan's flags; none is a field of the job

    * `--gpu`: the GPU planned for; without it, this machine's (from CUDA);
    * `--gpus`, `--nodes`: $n$ GPUs on each of $h$ nodes;
    * `--host-gib`: a node's host memory, this machine's for its own GPUs;
    * `--global-batch`: sequences a step over all ranks.

    Any family: [the memory budget](../planner/memory_budget.html) asks the
    model's family for its layers and activations. `--auto` without GPUs
    plans for `--gpu` and runs on CPU processes.

    The setting's own flags, when given, win: the search keeps their value
    and chooses the rest.
    """
    group = parser.add_argument_group("planner")
    group.add_argument("--plan", action="store_true", default=argparse.SUPPRESS,
                       help="print the fastest setting that fits, its memory "
                            "and its step time; start nothing (default: off)")
    group.add_argument("--auto", action="store_true", default=argparse.SUPPRESS,
                       help="run with the planned setting; the setting's flags "
                            "given win (default: off)")
    group.add_argument("--gpu", choices=tuple(GPUS), default=argparse.SUPPRESS,
                       help="the GPU to plan for (default: this machine's)")
    for flag, what in (
            ("--gpus", "GPUs a node (default: --world-size, this machine's, or 1)"),
            ("--nodes", "nodes (default: 1)"),
            ("--host-gib", "GiB of host memory a node (default: this machine's "
                           "for its own GPUs, unchecked for --gpu)"),
            ("--global-batch", "sequences a step over all ranks (default: "
                               "--batch-size x --grad-accum x ranks)")):
        group.add_argument(flag, type=positive, metavar="N",
                           default=argparse.SUPPRESS, help=what)


class Request(NamedTuple):
    """
    ## What the planner was asked

    `mode`: `None` (no plan), `plan` or `auto`; `cluster`: the flags of the
    cluster as given.
    """

    mode: str | None
    cluster: dict[str, Any]


def pop_request(given: dict[str, Any]) -> Request:
    """Takes the planner's flags out of the parsed flags."""
    plan_, auto = given.pop("plan", False), given.pop("auto", False)
    cluster = {name: given.pop(name) for name in PLAN_FLAGS if name in given}
    if plan_ and auto:
        raise ValueError("give --plan or --auto, not both")
    mode = "plan" if plan_ else "auto" if auto else None
    if mode is None and cluster:
        name = next(iter(cluster)).replace("_", "-")
        raise ValueError(f"--{name} needs --plan or --auto")
    return Request(mode, cluster)


def run_world(world_size: int | None) -> int:
    """The ranks this command starts, as `main` decides them."""
    if launch.under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if world_size is not None:
        return world_size
    return torch.cuda.device_count() if launch.default_backend() == "nccl" else 2


def cluster_of(request: Request, world_size: int | None) -> Cluster:
    """
    ### The cluster: named, or this machine's GPUs

    For `--auto` the plan's ranks are the run's, so `--gpus` × `--nodes`
    must agree with them.
    """
    flags = request.cluster
    nodes = flags.get("nodes", 1)
    if request.mode == "auto":
        world = run_world(world_size)
        gpus = flags.get("gpus", max(world // nodes, 1))
        if gpus * nodes != world:
            raise ValueError(f"--auto runs {world} ranks here; --gpus {gpus} x "
                             f"--nodes {nodes} plans {gpus * nodes}")
    else:
        gpus = flags.get("gpus", world_size // nodes if world_size else None)
        if world_size is not None and gpus * nodes != world_size:
            # a `--gpus` the user did not give is the world size shared out
            raise ValueError(
                f"--world-size {world_size} disagrees with --gpus {gpus} x "
                f"--nodes {nodes}: give one of them" if "gpus" in flags else
                f"--world-size {world_size} is not a whole number of GPUs a "
                f"node over --nodes {nodes}")
    host = flags["host_gib"] * GIB if "host_gib" in flags else None
    if "gpu" in flags:
        return Cluster(gpu_by_name(flags["gpu"]), gpus_per_node=gpus or 1,
                       nodes=nodes, host_bytes=host)
    here = this_machine(gpus=gpus)
    if here is None:
        raise ValueError(f"--{request.mode} needs a GPU to plan for: this machine "
                         f"has none the planner knows; name one with --gpu "
                         f"{'|'.join(GPUS)}")
    return dataclasses.replace(here, nodes=nodes,
                               host_bytes=host if host else here.host_bytes)


def job_of(config: FinetuneConfig, *, global_batch: int) -> Job:
    """The planner's job from the fine-tune's config, for its model's family
    (a preset's, or a checkpoint's `config.json`'s): bf16 or fp16."""
    if config.dtype == "fp32":
        raise ValueError("the planner plans bf16 or fp16 chunks, not --dtype fp32")
    family = config.family
    model = config.model_config()  # also gives lora_targets the family's
    if config.filter_layers is not None:
        model = dataclasses.replace(model, n_layers=len(config.filter_layers))
    fp16 = config.dtype == "fp16"
    return Job(model=model, family=family, seq=config.seq_len,
               global_batch=global_batch, finetune=config.finetune,
               lora_rank=config.lora_rank, lora_targets=tuple(config.lora_targets),
               states=config.optimizer_states,
               param_dtype="fp16" if fp16 else "bf16",
               kernels=gpu_kernels(family, config.kernels),
               update_during_backward=config.clip_grad is None and not fp16,
               shard_group_size=config.shard_group_size, steps=config.steps)


def pinned_of(config: FinetuneConfig, given: dict[str, Any]) -> Pinned:
    """The setting's flags the user gave, which the search keeps."""
    if given.get("offload_optimizer") == "auto":
        raise ValueError("--offload-optimizer auto and --auto/--plan both choose "
                         "the offload: give one")
    pins = {pin: getattr(config, name) for name, pin in SETTING_FIELDS.items()
            if name in given}
    if config.cuda_graph:
        # a recorded step: one micro-batch, nothing recomputed or offloaded
        pins.update(micro_batches=1, checkpointing=False, offload_fraction=0.0)
    if "offload_fraction" in pins:
        pins["offload_fraction"] = float(pins["offload_fraction"])
    return Pinned(**pins)


def unplannable(config: FinetuneConfig, cluster: Cluster) -> str | None:
    """
    ### Why the planner cannot plan this run on `cluster`, or `None`

    What the engine would refuse once it starts on that cluster, and what the
    planner does not model, is refused before the search: a plan is never
    printed that `--auto` could not run.
    """
    kernels = [name.strip() for name in config.kernels.split(",")]
    if "fp8" in kernels and cluster.gpu.peak_flops_fp8 is None:
        return (f"--kernels fp8: the {cluster.gpu.name} has no fp8 matrix "
                f"products (compute capability 8.9 or newer)")
    # the recording's rules that do not depend on the device (dtype, clipping,
    # accumulation, recomputation, offload given as flags)
    graph = config.cuda_graph_refusal(torch.device("cuda"))
    if graph is not None:
        return f"--cuda-graph {graph}"
    group = config.shard_group_size or cluster.world_size
    if config.peer_memory and cluster.nodes > 1 and group > cluster.gpus_per_node:
        return (f"--peer-memory needs each shard group on one host: "
                f"{cluster.nodes} nodes of {cluster.gpus_per_node} GPUs, shard "
                f"groups of {group} (give --shard-group-size "
                f"{cluster.gpus_per_node} or fewer)")
    if config.offload_params:
        return ("--offload-params: the planner does not model parameters in host "
                "memory; leave it out, or plan without it and add it by hand")
    return None


def settle(config: FinetuneConfig, request: Request, given: dict[str, Any], *,
           world_size: int | None) -> FinetuneConfig | str:
    """
    ## The plan: its text for `--plan`, the config to run for `--auto`

    `NoFit` and every refusal is a `ValueError` of one line.
    """
    cluster = cluster_of(request, world_size)
    refusal = unplannable(config, cluster)
    if refusal is not None:
        raise ValueError(refusal)
    global_batch = request.cluster.get(
        "global_batch", config.batch_size * config.grad_accum * cluster.world_size)
    job = job_of(config, global_batch=global_batch)
    try:
        result = plan(job, cluster, pinned_of(config, given))
    except NoFit as e:
        why = (" (--cuda-graph records one micro-batch, nothing recomputed or "
               "offloaded)" if config.cuda_graph else "")
        raise ValueError(f"{e}{why}") from None
    name = config.checkpoint or config.model
    if request.mode == "plan":
        return describe(result, model_name=name)
    s = result.best.setting
    kept = [f"--{name.replace('_', '-')}" for name in SETTING_FIELDS if name in given]
    print(auto_line(result, kept), flush=True)
    return dataclasses.replace(
        config, batch_size=s.batch, grad_accum=s.micro_batches,
        activation_checkpointing=s.checkpointing,
        offload_optimizer=s.offload_fraction, prefetch_depth=s.prefetch_depth,
        compile=s.compile)


def auto_line(result: Plan, kept: list[str]) -> str:
    """The line `--auto` prints before it starts: the setting as flags, its
    predicted step, and the setting's flags kept as given (the benchmark's
    `--auto` prints it too, with its own flags)."""
    return (f"--auto: {result.best.setting.flags()} (predicted "
            f"{result.best.time.total:.3f} s a step on {result.cluster.describe()}"
            + (f"; kept as given: {', '.join(kept)})" if kept else ")"))
