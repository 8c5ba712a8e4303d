r"""
---
title: Assembling a sharded model and its optimizer
summary: The one path from layers on the meta device to a sharded, placed, compiled
  model with AdamFP16 wired to its gradients, used by the fine-tune, the benchmark
  and the tests.
---

# Assembling a sharded model and its optimizer

Every job that trains with the engine builds the same thing in the same order,
and the order matters. `assemble` is that order written once, as six numbered
steps beside its code: **mark** what trains, **shard**, **compile**, **place**,
build the **optimizer**, and **wire** it to the gradients.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
from torch import nn

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.compiled import compile_layers
from labml_zero.zero3.config import ZeroConfig
from labml_zero.planner.placement import (
    AutoPlacement,
    Placement,
    ShardSpec,
    StaticPlacement,
    shard_specs,
)
from labml_zero.planner.placement_probe import (accumulated_step, apply_placement,
                                                first_step_placement)
from labml_zero.planner.placement_report import decision_lines
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3.sharded_model import Zero3Layer, Zero3Sequential
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.state_layout import state_layout
from labml_zero.zero3.trainable import TrainableCount, train_all

__all__ = ["Recipe", "AutoLimits", "Assembled", "assemble"]


class AutoLimits(NamedTuple):
    """
    ## A stand-in for the allocator, for `'auto'` placement off a GPU

    `'auto'` needs the allocator's statistics (CUDA) or this.

    * `measure_peak(run)` runs `run` and returns the bytes it peaked at;
    * `device_capacity`: the bytes the device may hold;
    * `margin`: bytes to keep free.

    `first_step_placement` reads all three from CUDA's allocator when they are
    not given; CPU memory has no such statistics.
    """

    measure_peak: Callable[[Callable[[], None]], int]
    device_capacity: int
    margin: int = 0


@dataclass(frozen=True)
class Recipe:
    r"""
    ## What to assemble

    Everything `assemble` decides with, apart from the layers and the callbacks.
    """

    zero: ZeroConfig
    """The engine's configuration: chunk dtype, chunk size (or `None` to search
    it), prefetch, activation recomputation, transports."""
    finetune: Callable[[Sequence[nn.Module]], TrainableCount] = train_all
    """The fine-tuner that marks what trains ([what trains](zero3/trainable.html)):
    every parameter by default, or a model's own, such as a `FineTuneLoRA` of some
    rank (whose `init_param` the caller's initialiser then goes through). A name
    like `'biases'` is the caller's to resolve (GPT-NeoX's `finetuner(name)`)."""
    compile_types: tuple[type[nn.Module], ...] = ()
    """Layer types whose `forward` is compiled; empty: nothing is compiled."""
    offload_optimizer: float | str = 0.0
    """Fraction of the trainable elements whose optimizer state lives in host
    memory (whole chunks, from the output end), or `'auto'`: as few chunks as
    make the measured step fit."""
    offload_params: float = 0.0
    """Fraction of the parameter shards kept in host memory (static placement
    only; needs `offload_optimizer=1`)."""
    resident: bool = True
    """With `'auto'`: also keep frozen chunks gathered in the device memory left
    over."""
    grad_accum: int = 1
    """Micro-batches per optimizer step, as the caller's training step runs
    them (the first `grad_accum - 1` under `no_sync`). `'auto'`'s probe runs
    as many, so the measured peak holds the full-size gradient buffers of every
    trainable chunk between micro-batches ([the
    probe](planner/placement_probe.html))."""
    lr: float = 1e-3
    """AdamW's learning rate."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    update_during_backward: bool = False
    """Update each shard as soon as its chunk is reduced; only right when nothing
    changes a gradient after its reduce-scatter (no clipping, no loss scaling)
    and no second backward runs before `step()` (no accumulation)."""
    free_grads: bool = False
    r"""With `update_during_backward`: free each shard's fp32 gradient once its
    update has consumed it (`AdamFP16(free_grads=True)`), so the $4\Psi_t/N_d$
    bytes of them never exist at once; `'auto'`'s probe frees them the same way,
    so the measured peak, and the placement, know it."""
    grad_squares: bool = False
    """Sum the squares of the gradients the updates consume
    (`AdamFP16(grad_squares=True)`), the step's gradient norm where
    `free_grads` leaves no gradient to read after `backward()`."""
    states: str = "fp32"
    """The optimizer's [state layout](zero3/state_layout.html) by name
    (`AdamFP16(states=...)`)."""
    seed: int | None = None
    """Seed the initialisation with this (inside a forked RNG, so the caller's
    random state is untouched); `None`: use the current random state."""


class Assembled(NamedTuple):
    r"""
    ## What `assemble` returns

    The benchmark reports it and the fine-tune's tracker records it; with
    `'auto'` rank 0 prints the decision ([its
    report](planner/placement_report.html)).

    * `model`: the `Zero3Sequential` of the sharded layers; its `layout`, one
      for the whole model with a group per layer, feeds the memory model;
    * `layers`: those `Zero3Layer`s, in order;
    * `optimizer`: `AdamFP16` on the trainable shards, wired to the runtime;
    * `counts`: $\Psi_t$ and $\Psi$, from the fine-tuner;
    * `placement`: where the chunks' states live (`None`: all on the device);
    * `decided`: the `'auto'` decision with its predicted peak and host traffic,
      `None` for a static placement.
    """

    model: Zero3Sequential
    layers: list[Zero3Layer]
    optimizer: AdamFP16
    counts: TrainableCount
    placement: Placement | None
    decided: AutoPlacement | None


def assemble(layers: Sequence[nn.Module], recipe: Recipe, *,
             device: torch.device,
             init_param: Callable[[str, torch.Tensor], None] | None = None,
             load: Callable[[list[Zero3Layer]], None] | None = None,
             probe: Callable[[Zero3Sequential], None] | None = None,
             auto_limits: Callable[[list[ShardSpec]], AutoLimits] | None = None,
             ) -> Assembled:
    """
    ## Build the sharded model and its optimizer, in order

    What trains must be known before the chunks are cut (a chunk is trainable
    or frozen, never both), the chunks must exist before anyone can decide
    where they live, and the optimizer can only be built once that is decided,
    because it allocates its fp32 masters and moments on the device or the
    host according to the placement.

    * `layers`: the model's layers on the meta device, input end first;
    * `init_param(name, param)`: the per-parameter initialiser, run chunk by
      chunk; `None`: each layer's `reset_parameters()`, one layer at a time;
    * `load(sharded)`: copies pretrained weights into the shards, right after
      sharding;
    * `probe(model)`: one micro-batch's forward and backward, for `'auto'`
      (run `recipe.grad_accum` times, as the step runs them);
    * `auto_limits(shards)`: the allocator's stand-in for `'auto'` off a GPU.
    """
    if recipe.free_grads and not recipe.update_during_backward:
        raise ValueError("Recipe.free_grads needs update_during_backward=True")
    if recipe.grad_accum < 1:
        raise ValueError(f"Recipe.grad_accum must be at least 1, got "
                         f"{recipe.grad_accum}")
    # 1. **mark**: the fine-tuner sets `requires_grad` on the layers, still on the
    # meta device (shapes, no memory). It decides trainable against frozen chunks,
    # so it must be set before the layout is cut.
    counts = recipe.finetune(layers)

    # 2. **shard**: `zero3_layers` cuts the layers into chunks of one common size
    # (a layer's last trainable and last frozen chunk trimmed to what they
    # hold, a parameter larger than that size in a chunk of its own) and gives
    # each rank its $\frac{1}{N_d}$ slice, initialising (or loading) one chunk
    # or one layer at a time, so that no rank ever holds the whole model.
    # Every rank seeds alike and visits the chunks in the same order, so all draw
    # the same weights and each keeps only its slice of them.
    seeded = contextlib.nullcontext()
    if recipe.seed is not None:
        seeded = torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [])
    with seeded:
        if recipe.seed is not None:
            torch.manual_seed(recipe.seed)
        sharded = zero3_layers(layers, device=device, config=recipe.zero,
                               init_param=init_param)

    # 3. **compile** the chosen layer types' forwards; the engine's hooks stay
    # eager.
    if recipe.compile_types:
        compile_layers(sharded, device=device, types=recipe.compile_types)
    if load is not None:
        load(sharded)
    model = Zero3Sequential(sharded)

    # 4. **place**: decide which chunks keep their optimizer state (and parameter
    # shards) in host memory, and apply that, in one place: a static fraction from
    # the output end, or `'auto'`, decided from the measured forward and backward
    # passes of one step, every micro-batch of it.
    # Before the optimizer exists: it allocates its fp32 masters and moments
    # where the placement says.
    placement, decided = place(model, recipe, probe, auto_limits)
    offload = (frozenset() if placement is None
               else placement.optimizer_offload(shard_specs(model)))

    # 5. **optimizer**: `AdamFP16` on the trainable shards, told which are
    # offloaded.
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=recipe.lr,
                         weight_decay=recipe.weight_decay, offload=offload,
                         update_during_backward=recipe.update_during_backward,
                         free_grads=recipe.free_grads,
                         grad_squares=recipe.grad_squares, states=recipe.states)

    # 6. **wire** the optimizer's gradient-ready callback to the runtime: as each
    # chunk is reduced, an offloaded gradient starts its copy to the host and
    # (with `update_during_backward`) its shard's update.
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return Assembled(model, sharded, optimizer, counts, placement, decided)


def free_probe_grad(shard: torch.Tensor, after=None) -> None:
    """
    #### The probe's stand-in for `free_grads`: drop each reduced gradient

    The optimizer does not exist during the probe; this callback lets each
    gradient go as the optimizer would after its early update, so the probe's
    peak is the step's. Registered for the probe only, and removed after it.
    """
    local = LocalShard.of(shard)
    if local is None or local.grad is None:
        return
    if after is not None and local.grad.is_cuda:
        # the reduce stream still writes it: the allocator waits for that stream
        local.grad.record_stream(after)
    local.zero_grad()


def place(model: Zero3Sequential, recipe: Recipe,
          probe: Callable[[Zero3Sequential], None] | None,
          auto_limits: Callable[[list[ShardSpec]], AutoLimits] | None,
          ) -> tuple[Placement | None, AutoPlacement | None]:
    """
    ### Decide where the chunks live, and apply it

    Static: `StaticPlacement` from the output end. `'auto'`: `probe` runs the
    step's `grad_accum` micro-batches (`accumulated_step`), whose peak
    `first_step_placement` measures, then the fewest optimizer states that make
    the step fit go to the host. `'auto'` needs a device with allocator
    statistics (CUDA), or the caller's stand-in for them (`AutoLimits`), as the
    benchmark's CPU smoke test gives.
    """
    if recipe.offload_optimizer == "auto":
        if probe is None:
            raise ValueError("offload_optimizer 'auto' needs a probe (one forward "
                             "and backward) to measure the step")
        device = model.runtime.comm.device
        limits = {}
        if auto_limits is not None:
            limits = auto_limits(shard_specs(model))._asdict()
        elif device.type != "cuda":
            raise ValueError("offload_optimizer 'auto' needs GPUs (it reads the "
                             "CUDA allocator's peak); give a fraction on CPU")
        freeing = (model.runtime.on_grad_ready(free_probe_grad)
                   if recipe.free_grads else None)
        step = accumulated_step(model, lambda: probe(model), recipe.grad_accum)
        # the optimizer's layout: its $K_d$ is what each offload saves
        decided = first_step_placement(model, step, resident=recipe.resident,
                                       states=state_layout(recipe.states),
                                       **limits)
        if freeing is not None:
            freeing.remove()  # the optimizer frees them from here on
        apply_placement(model, decided.placement)
        # every rank decided the same (`first_step_placement` agrees first), so
        # one prints: world rank 0, rank 0 of the first shard group, since
        # under hybrid sharding `comm.rank` is the rank inside a shard group
        replicas = model.transports.replicas
        if model.runtime.comm.rank == 0 and (replicas is None
                                             or replicas.rank == 0):
            lines = decision_lines(decided, shard_specs(model),
                                   pinned=device.type == "cuda")
            print("\n".join(lines), flush=True)
        return decided.placement, decided
    if recipe.offload_optimizer == 0 and recipe.offload_params == 0:
        return None, None
    placement = StaticPlacement(optimizer_cpu_fraction=recipe.offload_optimizer,
                                param_cpu_fraction=recipe.offload_params
                                ).place(shard_specs(model))
    apply_placement(model, placement)
    return placement, None
