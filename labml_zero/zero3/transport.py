r"""
---
title: Transports
summary: The ways a chunk's shards reach the full buffer and its gradients reach
  the shards, each behind one call chosen when the chunk is built.
---

# Transports

Gathering a chunk writes $\text{full}[qS, (q + 1)S) \leftarrow
\text{shard}^{(q)}$ for every rank $q$. Where this rank's shard lives decides
how:

* **collective**: the shard is device memory; one all-gather (NCCL on GPUs,
  gloo on CPU) reads it and writes `full`;
* **peer**: the shard lies in memory that every rank of the host can read
  ([peer memory](peer_memory.html)); each rank copies the peers' shards out,
  and no collective kernel runs;
* **host-staged**: the shard is in host memory (`Chunk.offload_shard`); it is
  first copied up into its own slice of `full`, and the all-gather then runs in
  place there (the in-place form of NCCL's all-gather: the input is the output's
  slice of this rank).

A chunk picks its transport once, when it is built, as FSDP2 picks its
all-gather; moving the shard to the host is the one event that picks again.
`Chunk.gather` then makes one call, `transport.gather(full, shard)`, on the
gather stream.

Reducing writes $g_{\text{shard}}^{(q)} \leftarrow \frac{1}{N_d}\sum_{r}
g^{(r)}[qS, (q + 1)S)$, the mean over all $N_d$ ranks of this rank's slice of the
gradient. A chunk also picks its *reduction* once:

* **collective**: one reduce-scatter with averaging over the shard group;
* **peer**: the ranks push their gradients into a workspace in peer memory and
  each averages its own slice there, in fp32 ([peer memory](peer_memory.html));
* **hybrid**: either of the two inside the shard group of $N_s$ ranks, then an
  all-reduce of the $S$-element result across the $N_d / N_s$ groups
  (explained in [hybrid sharding](hybrid.html)): the mean of the $N_d / N_s$ group
  means, each over $N_s$ ranks, is the mean over all $N_d$.

`ChunkGrads.reduce` then makes one call, `reduction.reduce(shard_grad, full_grad)`,
on the reduce stream.
"""

from __future__ import annotations

import torch

from .communication import Communicator
from .peer_memory import PeerBuffer


class CollectiveGather:
    """
    ## All-gather from a device shard

    The default: `comm.all_gather(full, shard)`.
    """

    def __init__(self, comm: Communicator):
        self.comm = comm

    def gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.comm.all_gather(full, shard)

    def close(self) -> None:
        """Nothing to give back."""


class PeerGather(CollectiveGather):
    """
    ## Copy the shards out of the peers' memory

    * `peers`: the `PeerBuffer` that holds every rank's shard (`shard` is its
      local view, so it is not read here).
    """

    def __init__(self, comm: Communicator, peers: PeerBuffer):
        super().__init__(comm)
        self.peers = peers

    def gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.comm.pull_all_gather(full, self.peers)

    def close(self) -> None:
        """The shard leaves peer memory; its bytes no longer count there."""
        self.comm.forget_shard(self.peers)


class HostStagedGather(CollectiveGather):
    """
    ## Copy a host shard up, then all-gather in place

    * `offset`: where this rank's slice starts in `full`.
    """

    def __init__(self, comm: Communicator, offset: int):
        super().__init__(comm)
        self.offset = offset

    def gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        # [S] this rank's slice of `full`: the copy up lands in place and the
        # all-gather reads it there. The host shard is rewritten only by the
        # optimizer, after waiting for an event that follows this chunk's last
        # gather of the step.
        local = full[self.offset : self.offset + shard.numel()]
        local.copy_(shard, non_blocking=True)
        self.comm.all_gather(full, local)


def new_shard(comm: Communicator, numel: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, CollectiveGather]:
    """
    ### A zero-filled `[numel]` shard and the transport that gathers it

    With `peer_gather` the shard is allocated in peer memory (a collective:
    every rank allocates in the same order) and gathered by `PeerGather`.
    """
    shard, peers = comm.new_shard(numel, dtype)
    if peers is not None:
        return shard, PeerGather(comm, peers)
    return shard, CollectiveGather(comm)


class CollectiveReduce:
    """
    ## Reduce-scatter with averaging

    The default: `comm.reduce_scatter_mean(shard, full)`, both in one dtype.
    `exact_input` says whether `full` may arrive in the parameter dtype with the
    mean still taken in `shard`'s (see `ChunkGrads.exact_dtype`): not for a
    collective, which needs one dtype.
    """

    exact_input = False

    def __init__(self, comm: Communicator):
        self.comm = comm

    def reduce(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """`shard` [S] ← the mean over the shard group of this rank's slice of
        `full` [K·S]."""
        self.comm.reduce_scatter_mean(shard, full)


class PeerReduce(CollectiveReduce):
    """
    ## Reduce through a workspace in peer memory

    The mean is taken in `shard`'s dtype, so a bf16 gradient travels in bf16
    and is still averaged in fp32.
    """

    exact_input = True

    def reduce(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.push_reduce_scatter_mean(shard, full)


class HybridReduce(CollectiveReduce):
    r"""
    ## Reduce inside the shard group, then across the replicas

    * `inner`: the reduction inside the shard group (collective or peer).

    The all-reduce moves $S$ elements, $\frac{1}{N_s}$ of the chunk, across the
    groups.
    """

    def __init__(self, comm: Communicator, inner: CollectiveReduce):
        super().__init__(comm)
        self.inner = inner
        self.exact_input = inner.exact_input

    def reduce(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.inner.reduce(shard, full)
        self.comm.all_reduce_mean_replicas(shard)


def new_reduction(comm: Communicator) -> CollectiveReduce:
    """
    ### The reduction a chunk uses, chosen when it is built
    """
    inner = PeerReduce(comm) if comm.peer_reduce else CollectiveReduce(comm)
    if comm.replicas > 1:
        return HybridReduce(comm, inner)
    return inner
