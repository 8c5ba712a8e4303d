r"""
---
title: Hybrid sharding's memory and communication
summary: The memory model's counts when each group of ranks holds a whole copy
  of the model states, and a step's communication time on two kinds of link.
---

# Hybrid sharding's memory and communication

This page deepens the [memory model](memory_model.html) for hybrid sharding
(explained in [its page](../zero3/hybrid.html)): a rank holds the model states of a
world of $N_s$ ranks, whatever the world size $N_d$,

$$M_{\text{hybrid}} = \frac{(p + g + K)\,\Psi_t + p\,\Psi_f}{N_s},$$

and a step's traffic splits into what stays inside a host and what crosses
the network. The time formulas and the example tabulated on the hybrid page
close it.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from labml_zero.zero3.chunk_layout import ChunkLayout
from labml_zero.zero3.group_ranks import check_shard_group_size
from labml_zero.planner.memory_model import (OPTIMIZER_BYTES, PARAM_BYTES,
                                             REDUCE_BYTES, StepComm,
                                             Traffic, _check_at_least,
                                             ring_wire_bytes, zero3_step_comm,
                                             zero_model_states)

__all__ = [
    "hybrid_model_states",
    "HybridStepComm",
    "hybrid_step_comm",
    "hybrid_wire_bytes",
    "flat_step_seconds",
    "hybrid_step_seconds",
    "HybridExample",
    "HYBRID_EXAMPLE",
    "HybridPrediction",
    "hybrid_prediction",
]

# ## Hybrid sharding
#
# With hybrid sharding (explained in [its page](../zero3/hybrid.html)) the $N_d$
# ranks form $R = N_d / N_s$
# {{term: shard groups | shard group}} of $N_s$ ranks. Each group holds one copy of
# the model states, so a rank holds ZeRO-3's share of a world of $N_s$, and a step
# adds to ZeRO-3's collectives inside the group one all-reduce, across the $R$
# groups, of each trainable chunk's gradient shard. Which ranks form which
# group is [rank arithmetic](../zero3/group_ranks.html), the engine's.


def hybrid_model_states(psi_trainable: int, psi_frozen: int, world_size: int,
                        shard_group_size: int, **bytes_per_element) -> int:
    r"""
    ## Model states per rank with hybrid sharding

    $$\frac{(p + g + K)\,\Psi_t + p\,\Psi_f}{N_s}$$

    ($K$ is the optimizer's bytes, `optimizer_bytes`): `zero_model_states`
    over the $N_s$ ranks of a shard group, whatever the world size $N_d$ it
    divides. `bytes_per_element` are `zero_model_states`' keywords.
    """
    check_shard_group_size(world_size, shard_group_size)
    return zero_model_states(psi_trainable, psi_frozen, shard_group_size,
                             **bytes_per_element)


class HybridStepComm(NamedTuple):
    """
    ## Communication of one hybrid step, by kind of link

    * `intra`: the all-gathers and the reduce-scatter inside the shard group,
      as `zero3_step_comm` counts them (full chunk sizes).
    * `inter`: the all-reduce across the {{see: replica group}}, of the
      $S$-element gradient shards (their size, in the reduce dtype); nothing
      with one group.
    """

    intra: StepComm
    inter: Traffic


def hybrid_step_comm(layout: ChunkLayout, *, replicas: int,
                     param_bytes: int = PARAM_BYTES,
                     grad_bytes: int = REDUCE_BYTES,
                     backward_groups: Iterable[int] | None = None) -> HybridStepComm:
    r"""
    ## Collectives of one hybrid step, per rank

    `layout` is the layout of the shard group (its `world_size` is $N_s$), and
    `replicas` is $R = N_d / N_s$. Per trainable chunk of $C$ elements the
    all-reduce takes $S = C / N_s$ elements: $\Psi_t / N_s$ in all, against the
    $\Psi_t$ of the reduce-scatter inside the group.
    """
    _check_at_least("replicas", replicas, 1)
    intra = zero3_step_comm(layout, param_bytes=param_bytes, grad_bytes=grad_bytes,
                            backward_groups=backward_groups)
    shards = [chunk.chunk_numel // layout.world_size for chunk in layout.chunks
              if chunk.trainable]
    if replicas == 1:
        shards = []
    numel = sum(shards)
    return HybridStepComm(intra, Traffic(len(shards), numel, numel * grad_bytes))


def hybrid_wire_bytes(comm: HybridStepComm, shard_group_size: int,
                      replicas: int) -> tuple[int, int]:
    r"""
    ### Bytes each rank sends per step: (inside its group, across groups)

    Inside: a ring all-gather or reduce-scatter over $N_s$ ranks,
    $\frac{N_s - 1}{N_s}$ of each full size (`ring_wire_bytes`). Across: a ring
    all-reduce over $R$ ranks is a reduce-scatter and an all-gather of the
    shard, $2 \frac{R - 1}{R}$ of its size.
    """
    inside = ring_wire_bytes(comm.intra.nbytes, shard_group_size)
    across = 2 * ring_wire_bytes(comm.inter.nbytes, replicas)
    return inside, across


# ## The step's communication time, and the page's example


def flat_step_seconds(psi: float, world_size: int, ranks_per_host: int, *,
                      bandwidth_in: float, bandwidth_out: float,
                      param_bytes: int = 2, grad_bytes: int = 4) -> float:
    r"""
    ### Communication time of a ZeRO-3 step sharded over all $N_d$ ranks

    $$T_{\text{flat}} = \frac{N_d - 1}{N_d} \cdot \frac{(2p + g_r)\,\Psi}{B}$$

    where $B$ is $B_\text{in}$ on one host and $B_\text{out}$ once the ring crosses hosts:
    every hop of a ring carries the same bytes, so its slowest hop sets the
    pace. All $\Psi$ trainable, gathered twice; bandwidths in bytes per second
    per rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    bandwidth = bandwidth_in if world_size <= ranks_per_host else bandwidth_out
    volume = (2 * param_bytes + grad_bytes) * psi
    return (world_size - 1) / world_size * volume / bandwidth


def hybrid_step_seconds(psi: float, world_size: int, shard_group_size: int, *,
                        bandwidth_in: float, bandwidth_out: float,
                        param_bytes: int = 2, grad_bytes: int = 4) -> float:
    r"""
    ### Communication time of a hybrid step, shard groups of one host

    $$T_{\text{hybrid}} = \frac{N_s - 1}{N_s} \cdot \frac{(2p + g_r)\,\Psi}{B_\text{in}}
    + 2\,\frac{R - 1}{R} \cdot \frac{g_r\,\Psi / N_s}{B_\text{out}}$$

    the two terms in sequence (the all-reduce of a chunk waits for its
    reduce-scatter; overlap across chunks would only lower it).
    """
    check_shard_group_size(world_size, shard_group_size)
    replicas = world_size // shard_group_size
    inside = ((shard_group_size - 1) / shard_group_size
              * (2 * param_bytes + grad_bytes) * psi / bandwidth_in)
    across = (2 * (replicas - 1) / replicas
              * grad_bytes * psi / shard_group_size / bandwidth_out)
    return inside + across


class HybridExample(NamedTuple):
    """
    ### The example of the [hybrid sharding](../zero3/hybrid.html) page

    * `psi`: trainable elements, a model of seven billion;
    * `ranks_per_host`: GPUs per host, the shard group;
    * `bandwidth_in`: bytes per second per GPU inside a host, NVLink's nominal
      figure in one direction on H100 and H200 GPUs;
    * `bandwidth_out`: bytes per second per GPU between hosts, one network
      card of {{py: hybrid_memory.HYBRID_EXAMPLE.bandwidth_out * 8 / 1e9 | .0f}}
      Gb/s per GPU.
    """

    psi: int = 7 * 10**9
    ranks_per_host: int = 8
    bandwidth_in: float = 450e9
    bandwidth_out: float = 50e9


HYBRID_EXAMPLE = HybridExample()


class HybridPrediction(NamedTuple):
    """
    ### One row of the page's table

    Communication seconds per step, and gigabytes (billions of bytes) of model
    states per rank, for ZeRO-3 over all ranks (`flat_`) and hybrid sharding
    over one host (`hybrid_`).
    """

    hosts: int
    ranks: int
    flat_seconds: float
    hybrid_seconds: float
    flat_gb: float
    hybrid_gb: float

    def markdown_row(self) -> str:
        """The row as the page prints it."""
        return (f"| {self.hosts:,} | {self.ranks:,} | {self.flat_seconds:.3f} | "
                f"{self.hybrid_seconds:.3f} | {self.flat_gb:.2f} | "
                f"{self.hybrid_gb:.2f} |")


def hybrid_prediction(hosts: int, example: HybridExample = HYBRID_EXAMPLE, *,
                      param_bytes: int = 2, grad_bytes: int = 4,
                      optimizer_bytes: int = OPTIMIZER_BYTES) -> HybridPrediction:
    """The example's figures on `hosts` hosts (bf16, fp32 reduction, Adam)."""
    if hosts < 1:
        raise ValueError(f"hosts must be at least 1, got {hosts}")
    ranks, size = hosts * example.ranks_per_host, example.ranks_per_host
    links = dict(bandwidth_in=example.bandwidth_in,
                 bandwidth_out=example.bandwidth_out,
                 param_bytes=param_bytes, grad_bytes=grad_bytes)
    states = dict(param_bytes=param_bytes, grad_bytes=grad_bytes,
                  optimizer_bytes=optimizer_bytes)
    return HybridPrediction(
        hosts, ranks,
        flat_step_seconds(example.psi, ranks, size, **links),
        hybrid_step_seconds(example.psi, ranks, size, **links),
        zero_model_states(example.psi, 0, ranks, **states) / 1e9,
        hybrid_model_states(example.psi, 0, ranks, size, **states) / 1e9,
    )
