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
$N_s$ ranks, however many hosts join (`hybrid_memory.hybrid_model_states`). Per
step it sends, for $\Psi$ trainable elements,

$$T_{\text{hybrid}} = \frac{N_s - 1}{N_s} \cdot \frac{(2p + g_r)\,\Psi}{B_{in}}
+ 2\,\frac{R - 1}{R} \cdot \frac{g_r\,\Psi / N_s}{B_{out}}$$

seconds of communication, with $B_{in}$ a rank's bandwidth inside its host and
$B_{out}$ its bandwidth to other hosts, against ZeRO-3 over all $N_d$ ranks,

$$T_{\text{flat}} = \frac{N_d - 1}{N_d} \cdot \frac{(2p + g_r)\,\Psi}{B_{out}}$$

(`hybrid_memory.hybrid_step_seconds` and `flat_step_seconds`). Across hosts,
hybrid sends at most $2g_r\Psi / N_s$ bytes per rank, against nearly
$(2p + g_r)\Psi$.

## When to use it

When the model states of one copy fit in the memory of one host's $N_s$ ranks,
with room for activations, and the network is much slower than the links
inside a host. Then hybrid sharding's step costs about what one host's costs,
whatever the number of hosts. When they do not fit, shard over more ranks: a
group of two hosts, or ZeRO-3 over all.

## Predictions

A model of $\Psi =$ {{py: hybrid_memory.HYBRID_EXAMPLE.psi / 1e9 | .0f}} billion
trainable elements, bf16 parameters ($p = 2$), an fp32 reduction ($g_r = 4$),
Adam ($K = 12$
(tested: tests/zero3/test_hybrid.py::test_prediction_table)), on hosts of
{{py: hybrid_memory.HYBRID_EXAMPLE.ranks_per_host}} GPUs with nominal links of $B_{in} =$
{{py: hybrid_memory.HYBRID_EXAMPLE.bandwidth_in / 1e9 | .0f}} GB/s
(NVLink, one direction) and $B_{out} =$
{{py: hybrid_memory.HYBRID_EXAMPLE.bandwidth_out / 1e9 | .0f}} GB/s (one
network card per GPU), $N_s$ one host. Communication seconds per step and
gigabytes of model states per rank (`hybrid_memory.hybrid_prediction`):

| hosts | ranks $N_d$ | flat s | hybrid s | flat GB | hybrid GB |
|---|---|---|---|---|---|
{{py: hybrid_memory.hybrid_prediction(1).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(2).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(4).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(8).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(16).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(32).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(64).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(128).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(256).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(512).markdown_row()}}
{{py: hybrid_memory.hybrid_prediction(1024).markdown_row()}}

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
