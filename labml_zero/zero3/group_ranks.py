r"""
---
title: Which ranks form which group
summary: Hybrid sharding's shard groups and replica groups as rank arithmetic,
  shared by the communicator, the replica group and the memory model.
---

# Which ranks form which group

With [hybrid sharding](hybrid.html) the $N_d$ ranks form $R = N_d / N_s$
shard groups of $N_s$ consecutive ranks, each holding
one copy of the model states; the ranks that hold the same shard, one per shard
group, form a {{see: replica group}}. Which ranks form which group is
arithmetic, here; the [communicator](communication.html) makes its shard group
from it, [hybrid sharding](hybrid.html) its replica group, and [hybrid
sharding's memory](../planner/hybrid_memory.html) checks $N_s$ with it.
"""

from __future__ import annotations

__all__ = ["check_shard_group_size", "shard_group_ranks", "replica_group_ranks"]


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
