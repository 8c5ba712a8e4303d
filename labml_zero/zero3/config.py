"""
---
title: ZeRO-3 configuration
summary: The knobs of the engine, with their defaults and what each one costs.
---

# ZeRO-3 configuration

Every knob of the engine, in one dataclass whose defaults run on a laptop. The
memory each one costs is in the [memory model](../planner/memory_model.html).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The dtypes a chunk may hold or reduce in: bf16 and fp16, which the engine is
# for, and fp32, the reference every parity test trains against.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ZeroConfig:
    """
    ## Engine configuration
    """

    dtype: torch.dtype = torch.bfloat16
    """
    Parameter dtype: what the gathered chunks and the computation use, and what
    the shards store. bf16 or fp16 for training ($p = 2$ bytes); fp32 makes the
    arithmetic exact, which the parity tests use ($p = 4$, and the optimizer's master
    copy is then the shard itself).
    """

    reduce_dtype: torch.dtype = torch.float32
    """
    Dtype of the full-size gradient buffers and of the reduce-scatter (fp32,
    bf16 or fp16). fp32 (default) averages $N_d$ gradients without rounding each
    partial sum to 8 bits of mantissa; bf16 halves the bytes the reduce-scatter
    moves ($g_r = 2$ instead of 4). The gradient shard the optimizer reads stays
    fp32 either way ($g = 4$).
    """

    chunk_numel: int | None = None
    """
    Elements per chunk; an integer fixes it. `None` leaves it to a chooser:
    `labml_zero.planner.sharding`'s `shard_model` and `zero3_layers` pass the
    [chunk-size search](../planner/chunk_search.html); the engine's own refuse
    `None` with no chooser.
    """

    prefetch_depth: int = 1
    """
    How many units ahead are gathered while one computes: each costs the gathered
    size of one more unit, and hides one more all-gather behind computation.
    """

    reshard_after_forward: bool = True
    """
    Release a unit's chunks after its forward (ZeRO-3). `False` keeps them until
    its backward: one all-gather per unit per step instead of two, for the memory of
    every unit's gathered chunks at the peak.
    """

    activation_checkpointing: bool = False
    """
    Recompute each layer's activations in the backward pass instead of keeping
    them (`torch.utils.checkpoint`, non-reentrant): activation memory falls from
    every layer's to one layer's, for one more forward per layer. The recompute
    finds the layer's chunks already gathered, so it costs no communication.
    Applies to `Zero3Sequential` (all its layers but a loss head, a last layer
    given the targets); with `shard_model`, checkpoint in the model.
    """

    side_streams: bool = True
    """
    Run gathers and reductions on their own CUDA streams, overlapped with the
    computation. `False` puts them on the compute stream: slower, but a run that
    changes when this is switched off has a stream-ordering bug.
    """

    peer_gather: bool = False
    """
    Gather chunks by copying the shards out of the other ranks' memory instead
    of with NCCL's all-gather kernel, {{term: peer memory}}: on GPUs the copy
    engines move the bytes and no SM is taken from the computation
    ([its page](peer_memory.html)). Needs every rank on one host; the same code
    runs on CPU through shared memory.
    """

    peer_reduce: bool = False
    """
    Reduce-scatter gradients by copying them into a workspace in the other
    ranks' memory and averaging there, in fp32, instead of with NCCL's kernel.
    A gradient computed in bf16 then travels in bf16 (half the bytes of an fp32
    reduction) and is still summed in fp32 ([peer memory](peer_memory.html)).
    Needs every rank on one host.
    """

    shard_group_size: int | None = None
    r"""
    Hybrid sharding: shard the model states over groups of $N_s$ consecutive
    ranks (one host, say) and replicate them across the $N_d / N_s$ groups, so that
    only shard-sized gradient traffic crosses groups (explained in
    [hybrid sharding](hybrid.html)). $N_s$ must divide the world size. `None`
    shards over every rank.
    """

    align: int = 64
    """
    Each parameter starts at a multiple of this many elements inside its chunk
    (by default {{py: zero_config.ZeroConfig().align}} bf16 elements,
    {{py: zero_config.ZeroConfig().align * memory_model.PARAM_BYTES}} bytes), so
    kernels read aligned memory.
    """

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype}")
        if self.reduce_dtype not in _DTYPES:
            raise ValueError(
                f"reduce_dtype must be one of {_DTYPES}, got {self.reduce_dtype}"
            )
        if self.chunk_numel is not None and self.chunk_numel < 1:
            raise ValueError(
                f"chunk_numel must be positive or None, got {self.chunk_numel}"
            )
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise ValueError("shard_group_size must be positive or None, got "
                             f"{self.shard_group_size}")
        if self.align < 1:
            raise ValueError(f"align must be >= 1, got {self.align}")
