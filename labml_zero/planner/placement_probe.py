r"""
---
title: Placing a live model from its measured first step
summary: The automatic placement's probe of a built model, before its optimizer
  exists: one optimizer step's forward and backward passes, every micro-batch
  of it, measured; then the chunks are moved where the policy says.
---

# Placing a live model from its measured first step

The [placement policy](placement.html) decides from numbers: the shards'
sizes, the device's capacity and the step's peak without optimizer state.
This page gets those numbers from a built model and applies the decision to
it: `first_step_placement` runs the first step's forward and backward passes
before the optimizer exists and measures their peak, and `apply_placement`
moves the chosen chunks. The probe must hold what the real step holds; under
gradient accumulation that includes every trainable chunk's buffer at once,

$$g_r \sum_{c \text{ trainable}} C_c \approx g_r\,\Psi_t \text{ bytes per rank,}$$

with $g_r$ the bytes per element of the reduce dtype, in which the
[gradient buffers](../zero3/chunk_grads.html) are kept.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from labml_zero.planner.placement import (AutoPlacement, Placement, auto_placement,
                                          shard_specs)
from labml_zero.zero3.state_layout import FP32_STATES, StateLayout

__all__ = ["accumulated_step", "first_step_placement", "agreed_limits",
           "apply_placement", "cuda_peak", "cuda_capacity"]


def accumulated_step(model, micro_batch: Callable[[], None],
                     micro_batches: int) -> Callable[[], None]:
    """
    ## One optimizer step's forward and backward passes, as the step runs them

    `micro_batch()` runs one micro-batch's forward and backward pass; the
    returned function runs it `micro_batches` times, the first
    `micro_batches - 1` under `model.no_sync()` ([hooks](../zero3/hooks.html)), so every
    trainable chunk keeps its full-size gradient buffer, $C_c$ elements of $g_r$
    bytes (the reduce dtype's), until the last backward reduces them, and the
    last micro-batch runs on top of them: the formula above, which one
    micro-batch without `no_sync` never holds at once (each chunk's buffer goes
    at its reduce-scatter). A probe of one micro-batch would under-offload by
    that much and the first real step would run out of memory. The probe's
    micro-batches cost one step's compute, spent before training.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")

    def step() -> None:
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                micro_batch()

    return step


def cuda_peak(device: torch.device) -> Callable[[Callable[[], None]], int]:
    """Run a function and return the peak of allocated device bytes during it."""

    def measure(run: Callable[[], None]) -> int:
        # host sync: the peak must cover every kernel of `run`, and none before
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)

    return measure


def cuda_capacity(device: torch.device) -> int:
    """
    Bytes PyTorch can allocate on `device`: what its caching allocator holds
    plus what is free. The CUDA context and NCCL's buffers are not in it.
    """
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def first_step_placement(
    model,
    forward_backward: Callable[[], None],
    *,
    margin: int | None = None,
    device_capacity: int | None = None,
    measure_peak: Callable[[Callable[[], None]], int] | None = None,
    resident: bool = True,
    states: StateLayout = FP32_STATES,
) -> AutoPlacement:
    r"""
    ## The automatic placement, from one measured forward and backward

    Call it after building the model and before building the optimizer:

    1. `forward_backward()` runs one step's forward and backward passes, all
       its micro-batches as the step runs them (`accumulated_step`); its peak
       of allocated bytes is measured;
    2. the gradients it left are cleared: the probe trains nothing, the step
       then runs again with the optimizer;
    3. the fp32 `master_init` copies still on the shards are taken off the
       peak (they become the masters, which `auto_placement` counts in $K_d$);
    4. the ranks agree on the numbers (`agreed_limits`), and `auto_placement`
       picks, on every rank alike, the chunks to offload.

    * `margin`: bytes kept free; default 5% of the capacity, for the
      allocator's fragmentation and steps that use a little more. The peak is
      predicted from one step: a job whose memory use varies (longer sequences
      later) needs a larger margin.
    * `device_capacity`: default, on a GPU, what PyTorch can allocate there
      (free plus reserved).
    * `measure_peak(run)`: runs `run` and returns its peak; default, on a GPU,
      the CUDA allocator's statistics. CPU memory has no such statistics, so on
      CPU (the tests) both must be given.
    * `resident`: also keep frozen chunks resident in the memory left over.
    * `states`: the [state layout](../zero3/state_layout.html) the optimizer will be
      built with (`AdamFP16(states=...)`): its $K_d$ is what an offload saves.

    Then `apply_placement(model, result.placement)` and
    `AdamFP16(model.get_trainable_chunk(), ...,
    offload=result.placement.optimizer_offload(shard_specs(model)))`.

    #### The decision for the benchmark's capability job

    On the benchmark's job {{see: W5}} (GPT-NeoX-20B, every parameter trained,
    activation checkpointing, two ranks) the measured step leaves room for
    the optimizer state of only part of the model: the fewest chunks whose state
    must go are the last transformer layers (one chunk each, the largest
    chunks, so they go first), and `offload_traffic` and `resident_bytes` give
    the link's bytes and the host's memory for that choice. PyTorch FSDP2 with
    `CPUOffloadPolicy` and DeepSpeed ZeRO-3 with `offload_optimizer` put *all*
    of the optimizer state (and FSDP2 the parameters and gradients too) in host
    memory, $K + 4$ bytes per parameter and rank (the state and an fp32
    gradient), where this policy puts only what does not fit; the [benchmark's
    results](../../results.html) give the measured figures.

    #### Where each chunk lives during a step

    ![where each chunk lives under two placements](figures/placement.svg)

    In the backward pass each chunk is gathered, recomputed, run backward and
    reduce-scattered into its fp32 gradient; a host chunk's gradient then goes
    down ($4$ bytes an element) and its Adam starts on the host at once, while
    the backward pass goes on to the earlier layers. At the step the device's
    Adam updates the device chunks; the host's rounded bf16 masters go up
    ($p$ bytes an element) in time for the next forward's all-gathers. The
    readout and the embedding are smaller than a layer, so the fewest-chunks
    rule takes the layers first, from the output end.
    """
    device = model.runtime.comm.device
    if device.type == "cuda":
        measure_peak = measure_peak or cuda_peak(device)
    if measure_peak is None or (device.type != "cuda" and device_capacity is None):
        raise ValueError(f"first_step_placement on {device.type} needs "
                         "measure_peak and device_capacity (no allocator "
                         "statistics there)")
    peak = measure_peak(forward_backward)
    shards = model.get_trainable_chunk()
    master_bytes = sum(c.local.master_init_nbytes() for c in model.chunks)
    model.zero_grad()
    if device_capacity is None:
        device_capacity = cuda_capacity(device)
    peak_other, device_capacity, margin = agreed_limits(
        model, peak_other=max(peak - master_bytes, 0),
        device_capacity=device_capacity, margin=margin)
    if margin is None:
        margin = device_capacity // 20
    param_bytes = shards[0].element_size() if shards else 2
    return auto_placement(shard_specs(model), device_capacity=device_capacity,
                          measured_peak_other=peak_other,
                          margin=margin, param_bytes=param_bytes, states=states,
                          resident_world_size=(model.runtime.comm.world_size
                                               if resident else None))


def agreed_limits(model, *, peak_other: int, device_capacity: int,
                  margin: int | None) -> tuple[int, int, int | None]:
    r"""
    ## Every rank decides the same placement

    A placement changes which collectives a chunk runs (a resident chunk skips
    the all-gathers a sharded one issues), and the ranks must issue the same
    collectives in the same order. But each rank measured its own peak and
    reads its own capacity, and GPUs differ there (the CUDA context, another
    process, what the allocator keeps), so a decision from a rank's own numbers
    can differ from its neighbour's, and then the collectives stop matching (a
    hang, or a message of the wrong size). So before deciding, the ranks take
    the worst case of each number, the same on all of them: the largest peak
    and margin, the smallest capacity,

    $$\text{peak} = \max_r \text{peak}_r, \qquad
      \text{capacity} = \min_r \text{capacity}_r,$$

    and each then computes the same decision, which fits on every rank. The
    maximum runs over the shard group, then, with [hybrid
    sharding](../zero3/hybrid.html), over the replica group: the two together
    are every rank of the model. `margin` stays `None` (the default) only if no
    rank gave one.
    """
    comm = model.runtime.comm
    # [3] int64: one MAX gives all three, the capacity negated for its minimum
    # and a missing margin as -1, below any margin given
    limits = torch.tensor([peak_other, -device_capacity,
                           -1 if margin is None else margin],
                          dtype=torch.int64, device=comm.device)
    if comm.distributed:
        dist.all_reduce(limits, op=dist.ReduceOp.MAX, group=comm.group)
        replicas = model.transports.replicas
        if replicas is not None:
            dist.all_reduce(limits, op=dist.ReduceOp.MAX, group=replicas.group)
    # host sync: the decision is made on the host
    peak_other, capacity, agreed_margin = limits.tolist()
    return peak_other, -capacity, None if agreed_margin < 0 else agreed_margin


def apply_placement(model, placement: Placement) -> None:
    """
    ## Put `model.chunks` where `placement` says

    Moves the parameter shards of `param_on_host` to the host and marks the
    chunks of `resident` to stay gathered. Before building the optimizer, which
    must keep the offloaded chunks' optimizer state on the host too
    (`placement.optimizer_offload(...)`; `Placement.check` refuses a trainable
    chunk whose state would stay on the device).
    """
    placement.check(shard_specs(model))
    for i in sorted(placement.param_on_host):
        model.chunks[i].offload_shard()
    for i in sorted(placement.resident):
        model.chunks[i].keep_resident()
