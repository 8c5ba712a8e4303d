r"""
---
title: Hybrid sharding
summary: Shard inside a host, replicate across hosts; only gradient shards cross
  the network. When it pays, and the step's communication time on two links.
---

# Hybrid sharding

ZeRO-3 over all $N_d$ ranks divides the model states by $N_d$, but every
all-gather and reduce-scatter then runs over all of them, and a ring that
crosses hosts goes at the pace of its slowest hop: the network. *Hybrid
sharding* (FSDP2's two-dimensional mesh, DeepSpeed's hpZ) splits the ranks
into $R = N_d / N_s$ *shard groups* of $N_s$ consecutive ranks,
one host each, and gives each group a whole copy of the model states, sharded
over its $N_s$ ranks. The ranks that hold the same shard in every group form a
*replica group*. A step then runs

1. the all-gathers and the reduce-scatter of ZeRO-3 inside the shard group,
   over the fast links of one host;
2. one all-reduce (mean) per trainable chunk across the replica group, of the
   $S = C / N_s$ elements of the shard only.

The mean of $R$ group means, each over $N_s$ ranks, is the mean over all $N_d$:
the gradient is the one ZeRO-3 over $N_d$ ranks computes, in another order of
summation. After it every group holds the whole averaged gradient, so a sum
over ranks of the shards, such as the gradient norm for clipping, runs over
the shard group alone. `ZeroConfig(shard_group_size=K)` turns it on
([communication](communication.html) builds the groups,
[transports](transport.html) the reduction); `--shard-group-size K` in the
fine-tune.

## Cost

A rank holds $\frac{(p + g + K)\Psi_t + p\Psi_f}{N_s}$ bytes of model states
($K$ the optimizer's bytes per element): what it would hold in a world of
$N_s$ ranks, however many hosts join (`memory_model.hybrid_model_states`). Per
step it sends, for $\Psi$ trainable elements,

$$T_{\text{hybrid}} = \frac{N_s - 1}{N_s} \cdot \frac{(2p + g_r)\,\Psi}{B_{in}}
+ 2\,\frac{R - 1}{R} \cdot \frac{g_r\,\Psi / N_s}{B_{out}}$$

seconds of communication, with $B_{in}$ a rank's bandwidth inside its host and
$B_{out}$ its bandwidth to other hosts, against ZeRO-3 over all $N_d$ ranks,

$$T_{\text{flat}} = \frac{N_d - 1}{N_d} \cdot \frac{(2p + g_r)\,\Psi}{B_{out}}$$

(`memory_model.hybrid_step_seconds` and `flat_step_seconds`). Across hosts,
hybrid sends at most $2g_r\Psi / N_s$ bytes per rank, against nearly
$(2p + g_r)\Psi$.

## When to use it

When the model states of one copy fit in the memory of one host's $N_s$ ranks,
with room for activations, and the network is much slower than the links
inside a host. Then hybrid sharding's step costs about what one host's costs,
whatever the number of hosts. When they do not fit, shard over more ranks: a
group of two hosts, or ZeRO-3 over all.

## Predictions

A model of $\Psi =$ {{py: memory_model.HYBRID_EXAMPLE.psi / 1e9 | .0f}} billion
trainable elements, bf16 parameters ($p = 2$), an fp32 reduction ($g_r = 4$),
Adam ($K = 12$
(tested: tests/zero3/test_hybrid.py::test_prediction_table)), on hosts of
{{py: memory_model.HYBRID_EXAMPLE.ranks_per_host}} GPUs with nominal links of $B_{in} =$
{{py: memory_model.HYBRID_EXAMPLE.bandwidth_in / 1e9 | .0f}} GB/s
(NVLink, one direction) and $B_{out} =$
{{py: memory_model.HYBRID_EXAMPLE.bandwidth_out / 1e9 | .0f}} GB/s (one
network card per GPU), $N_s$ one host. Communication seconds per step and
gigabytes of model states per rank (`memory_model.hybrid_prediction`):

| hosts | ranks $N_d$ | flat s | hybrid s | flat GB | hybrid GB |
|---|---|---|---|---|---|
{{py: memory_model.hybrid_prediction(1).markdown_row()}}
{{py: memory_model.hybrid_prediction(2).markdown_row()}}
{{py: memory_model.hybrid_prediction(4).markdown_row()}}
{{py: memory_model.hybrid_prediction(8).markdown_row()}}
{{py: memory_model.hybrid_prediction(16).markdown_row()}}
{{py: memory_model.hybrid_prediction(32).markdown_row()}}
{{py: memory_model.hybrid_prediction(64).markdown_row()}}
{{py: memory_model.hybrid_prediction(128).markdown_row()}}
{{py: memory_model.hybrid_prediction(256).markdown_row()}}
{{py: memory_model.hybrid_prediction(512).markdown_row()}}
{{py: memory_model.hybrid_prediction(1024).markdown_row()}}

Latency is not modelled: at many hosts an all-reduce of small shards is bound
by it, not by bandwidth, and the hybrid column is then a lower bound.

## Limitations

* The group is $N_s$ consecutive ranks: a host's ranks must be consecutive, as
  `torchrun` numbers them.
* Checkpoints are written by the first shard group alone (every group holds
  the same shards); the per-rank state saved, the RNG and `rank_extra`, is
  that group's.
* `shard_group_size` splits the default process group; it does not combine
  with a `group` of one's own.
"""

from __future__ import annotations

from typing import NamedTuple


def check_shard_group_size(world_size: int, shard_group_size: int) -> None:
    """$N_s$ must divide the world size: one line naming both otherwise."""
    if shard_group_size < 1 or world_size % shard_group_size:
        raise ValueError(f"shard_group_size {shard_group_size} does not divide "
                         f"the world size {world_size}")


def shard_group_ranks(world_size: int, shard_group_size: int) -> list[list[int]]:
    r"""
    ## The shard groups

    Group $j$ is world ranks $jN_s, \dots, jN_s + N_s - 1$: the ranks of one host
    when each host runs $N_s$ consecutive ranks.
    """
    check_shard_group_size(world_size, shard_group_size)
    size = shard_group_size
    return [list(range(j * size, (j + 1) * size)) for j in range(world_size // size)]


def replica_group_ranks(world_size: int, shard_group_size: int) -> list[list[int]]:
    r"""
    ## The replica groups

    Group $q$ is the $q$-th rank of every shard group, $q, q + N_s, q + 2N_s, \dots$:
    the ranks that hold the same shard, one per host.
    """
    check_shard_group_size(world_size, shard_group_size)
    return [list(range(q, world_size, shard_group_size))
            for q in range(shard_group_size)]


# ## The step's communication time, and the page's example


def flat_step_seconds(psi: float, world_size: int, ranks_per_host: int, *,
                      bandwidth_in: float, bandwidth_out: float,
                      param_bytes: int = 2, grad_bytes: int = 4) -> float:
    r"""
    ### Communication time of a ZeRO-3 step sharded over all $N_d$ ranks

    $$T_{\text{flat}} = \frac{N_d - 1}{N_d} \cdot \frac{(2p + g_r)\,\Psi}{B}$$

    where $B$ is $B_{in}$ on one host and $B_{out}$ once the ring crosses hosts:
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

    $$T_{\text{hybrid}} = \frac{N_s - 1}{N_s} \cdot \frac{(2p + g_r)\,\Psi}{B_{in}}
    + 2\,\frac{R - 1}{R} \cdot \frac{g_r\,\Psi / N_s}{B_{out}}$$

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
    ### The example of the [hybrid sharding](hybrid.html) page

    * `psi`: trainable elements, a model of seven billion;
    * `ranks_per_host`: GPUs per host, the shard group;
    * `bandwidth_in`: bytes per second per GPU inside a host, NVLink's nominal
      figure in one direction on H100 and H200 GPUs;
    * `bandwidth_out`: bytes per second per GPU between hosts, one network
      card of {{py: memory_model.HYBRID_EXAMPLE.bandwidth_out * 8 / 1e9 | .0f}}
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
                      optimizer_bytes: int = 12) -> HybridPrediction:
    """The example's figures on `hosts` hosts (bf16, fp32 reduction, Adam)."""
    # here, not at the top: the memory model imports this page
    from labml_zero.zero3.memory_model import hybrid_model_states, zero_model_states

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
