r"""
---
title: Transports
summary: The three ways a chunk's shards reach the full buffer, behind one call
  chosen when the chunk is built.
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
gather stream. The reduction has one form for all three (`Communicator.
reduce_scatter_mean`, which itself goes through peer memory with
`peer_reduce`).
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
