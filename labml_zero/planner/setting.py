r"""
---
title: A job and its settings
summary: What a plan keeps fixed (the model, what trains, the sequence, the
  global batch) and what it chooses (micro-batch and accumulation,
  recomputation, offload, prefetch, compilation), and the memory budget of
  one choice.
---

# A job and its settings

A fine-tune fixes the model, what trains, the sequence length $T$, the
optimizer's states and the global batch $G$, the sequences of one optimizer
step. The planner chooses the rest, a `Setting`: how the $G / N_d$ sequences of a
rank are cut into $A$ micro-batches of $B$,

$$G = B \cdot A \cdot N_d,$$

whether each layer's activations are recomputed, how much of the optimizer
state lives on the host, how many units are gathered ahead, and whether the
layers are compiled. `budget_of` asks [the memory budget](memory_budget.html)
what one setting holds on a rank. The job names its model's
[family](../family.html), an object the planner asks for the layers, the
activations and the FLOPs, so no page of the planner imports a model package.

## Limitations

* fp32 computation is not planned: the peaks and the fits are bf16's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from labml_zero.planner.memory_budget import Budget, BudgetInputs, budget

__all__ = ["Job", "Setting", "budget_of", "gpu_kernels"]


def gpu_kernels(family, names: str):
    """The fine-tune's `--kernels` on a GPU, as the family resolves them:
    `auto` is every fusion."""
    return family.resolve_kernels(names, "cuda")


@dataclass(frozen=True)
class Job:
    """
    ## What the plan keeps fixed
    """

    model: Any
    """The model's shape, a config of `family`."""
    seq: int
    """$T$, tokens per sequence."""
    global_batch: int
    """$G$, sequences per optimizer step over all ranks."""
    finetune: str = "all"
    """What trains: one of the family's fine-tuners."""
    lora_rank: int = 8
    lora_targets: tuple[str, ...] | None = None
    """`None`: every projection the family has."""
    states: str = "fp32"
    """The optimizer's state layout."""
    param_dtype: str = "bf16"
    """The chunks' dtype, `bf16` or `fp16`."""
    kernels: Any = None
    """The family's fused kernels; `None` is the job's `auto` on a GPU, every
    one of them."""
    update_during_backward: bool = True
    """The job updates each shard during the backward pass unless it clips or
    scales the loss (fp16)."""
    shard_group_size: int | None = None
    """Hybrid sharding's group, as the job is given it."""
    steps: int | None = None
    """The run's optimizer steps, if known (for the run's time)."""
    family: Any = field(kw_only=True, hash=False, repr=False)
    """The model's [family](../family.html), by keyword."""

    def __post_init__(self):
        if self.kernels is None:
            object.__setattr__(self, "kernels", gpu_kernels(self.family, "auto"))
        for name in ("seq", "global_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Setting:
    """
    ## What the plan chooses

    Each field is one flag of the fine-tune, which `--auto` sets.
    """

    batch: int
    """$B$, sequences per micro-batch and rank (`--batch-size`)."""
    micro_batches: int
    """$A$, micro-batches per step (`--grad-accum`)."""
    checkpointing: bool = False
    """Recompute each layer's activations (`--activation-checkpointing`)."""
    offload_fraction: float = 0.0
    """The least fraction of the trainable elements whose optimizer state is on
    the host, whole chunks from the output end (`--offload-optimizer`)."""
    prefetch_depth: int = 1
    """$D$, units gathered ahead (`--prefetch-depth`)."""
    compile: bool = False
    """Compiled layers (`--compile`)."""

    def flags(self) -> str:
        """The setting as the fine-tune's flags."""
        out = [f"--batch-size {self.batch}", f"--grad-accum {self.micro_batches}"]
        if self.checkpointing:
            out.append("--activation-checkpointing")
        if self.offload_fraction:
            out.append(f"--offload-optimizer {self.offload_fraction:.4g}")
        out.append(f"--prefetch-depth {self.prefetch_depth}")
        if self.compile:
            out.append("--compile")
        return " ".join(out)


def budget_inputs(job: Job, setting: Setting, *, world_size: int,
                  device_bytes: int, auto_offload: bool = False) -> BudgetInputs:
    """The memory budget's inputs for `setting`; `auto_offload` replaces its
    fraction by the fewest chunks that fit `device_bytes`."""
    return BudgetInputs(
        job.model, family=job.family, world_size=world_size,
        shard_group_size=job.shard_group_size, param_dtype=job.param_dtype,
        states=job.states, finetune=job.finetune, lora_rank=job.lora_rank,
        lora_targets=job.lora_targets, prefetch_depth=setting.prefetch_depth,
        checkpointing=setting.checkpointing, compiled=setting.compile,
        kernels=job.kernels,
        batch=setting.batch, seq=job.seq, micro_batches=setting.micro_batches,
        update_during_backward=job.update_during_backward,
        offload_fraction=None if auto_offload else setting.offload_fraction,
        device_bytes=device_bytes)


def budget_of(job: Job, setting: Setting, *, world_size: int,
              device_bytes: int) -> Budget:
    """
    ### The memory budget of one setting on one rank

    Compiled layers' activations are the family's count for compiled layers:
    the eager set with the fused kernels, less with fp8 products.
    """
    return budget(budget_inputs(job, setting, world_size=world_size,
                                device_bytes=device_bytes))
