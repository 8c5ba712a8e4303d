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

Setting `ZeroConfig.shard_group_size` to $N_s$, which must divide $N_d$,
turns it on; `--shard-group-size` in the fine-tune.

"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .communication import CommCounter, Communicator
from .config import ZeroConfig
from .group_ranks import replica_group_ranks


class ReplicaGroup:
    r"""
    ## The replica group, and the all-reduce across it

    The ranks that hold the same shard, one in each of the $R = N_d / N_s$
    shard groups (listed by `replica_group_ranks`).

    * `group` is the process group of this rank's replicas.
    * `size` is $R$, the number of shard groups, each with a copy of the model
      states.
    * `rank` is this rank's place in it, which is its shard group's: $j$ for
      world rank $jN_s + q$. The group with `rank` 0 writes the checkpoints.
    * `counter` is the communicator's, into which the all-reduces count.

    Built by `for_config`, once per model, right after the
    [communicator](communication.html) has made its shard group. The shard group is
    $N_s$ consecutive ranks, so a host's ranks must be consecutive, as `torchrun`
    numbers them. Checkpoints are written by the first shard group alone (every
    group holds the same shards); the per-rank state saved, the RNG and
    `rank_extra`, is that group's.
    """

    def __init__(self, group, *, size: int, rank: int, counter: CommCounter):
        self.group = group
        self.size = size
        self.rank = rank
        self.counter = counter

    @classmethod
    def for_config(cls, comm: Communicator,
                   config: ZeroConfig) -> "ReplicaGroup | None":
        """
        ### The replica group a [`ZeroConfig`](config.html) asks for

        `None` without hybrid sharding, or with one shard group ($N_s = N_d$):
        nothing to average across. Like the shard groups (see
        `Communicator._split_into_shard_groups`), every rank makes every replica
        group, in the same order, and keeps its own. `shard_group_size` splits
        the default process group; with a `group` of one's own it is refused.
        """
        size = config.shard_group_size
        world = dist.get_world_size() if comm.distributed else 1
        if size is None or size == world:
            return None
        # rank $q$ of shard group $j$ is world rank $jN_s + q$
        rank, q = dist.get_rank() // size, comm.rank
        mine = None
        for index, ranks in enumerate(replica_group_ranks(world, size)):
            made = dist.new_group(ranks)
            if index == q:
                mine = made
        return cls(mine, size=world // size, rank=rank, counter=comm.counter)

    def all_reduce_mean(self, shard: torch.Tensor) -> None:
        r"""
        ### `shard` [S] ← its mean over the replicas, in place

        The second half of a hybrid reduction. A sum, then a division by the
        $R$ replicas: gloo has no averaging all-reduce. Counted as
        `replica_all_reduce`, the only traffic that crosses shard groups.

        #### Cost

        A rank holds $\frac{(p + g + K)\Psi_t + p\Psi_f}{N_s}$ bytes of model states
        ($K$ the optimizer's bytes per element): what it would hold in a world of
        $N_s$ ranks, however many hosts join
        (`hybrid_memory.hybrid_model_states`). Per step it sends, for a model of
        $\Psi$ elements that all train,

        $$T_{\text{hybrid}} = \frac{N_s - 1}{N_s}
        \cdot \frac{(2p + g_r)\,\Psi}{B_\text{in}}
        + 2\,\frac{R - 1}{R} \cdot \frac{g_r\,\Psi / N_s}{B_\text{out}}$$

        seconds of communication, with $B_\text{in}$ a rank's bandwidth inside
        its host and $B_\text{out}$ its bandwidth to other hosts, against ZeRO-3
        over all $N_d$ ranks,

        $$T_{\text{flat}} = \frac{N_d - 1}{N_d}
        \cdot \frac{(2p + g_r)\,\Psi}{B_\text{out}}$$

        (`hybrid_memory.hybrid_step_seconds` and `flat_step_seconds`). Across hosts,
        hybrid sends at most $2g_r\Psi / N_s$ bytes per rank, against nearly
        $(2p + g_r)\Psi$.

        #### When to use it

        When the model states of one copy fit in the memory of one host's $N_s$
        ranks, with room for activations, and the network is much slower than
        the links inside a host. Then hybrid sharding's step costs about what one
        host's costs, whatever the number of hosts. When they do not fit, shard
        over more ranks: a group of two hosts, or ZeRO-3 over all.

        #### Predictions

        A model of $\Psi =$ {{py: hybrid_memory.HYBRID_EXAMPLE.psi / 1e9 | .0f}}
        billion trainable elements, bf16 parameters ($p = 2$), an fp32 reduction
        ($g_r = 4$), Adam ($K = 12$
        (tested: tests/zero3/test_hybrid.py::test_prediction_table)), on hosts of
        {{py: hybrid_memory.HYBRID_EXAMPLE.ranks_per_host}} GPUs with nominal
        links of $B_\text{in} =$
        {{py: hybrid_memory.HYBRID_EXAMPLE.bandwidth_in / 1e9 | .0f}} GB/s
        (NVLink, one direction) and $B_\text{out} =$
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

        The mean of $R$ group means, each over $N_s$ ranks, is the mean over all $N_d$:
        the gradient is the one ZeRO-3 over $N_d$ ranks computes, in another order of
        summation. After it every group holds the whole averaged gradient, so a sum
        over ranks of the shards, such as the gradient norm for clipping, runs over
        the shard group alone.
        """
        self.counter.add("replica_all_reduce", shard)
        dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=self.group)
        shard.div_(self.size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum a few scalars (a failure flag) across the replicas, in place."""
        self.counter.add("all_reduce", tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
