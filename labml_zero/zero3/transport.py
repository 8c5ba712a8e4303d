r"""
---
title: Transports
summary: The ways a chunk's shards reach the full buffer and its gradients reach
  the shards, each behind one call chosen when the chunk is built.
---

# Transports

A chunk's shards reach its full buffer, and its full gradient reaches the
shards, by one of a few transports:

$$\text{full}[qS, (q + 1)S) \leftarrow \text{shard}^{(q)}, \qquad
g_{\text{shard}}^{(q)} \leftarrow \frac{1}{N_d}\sum_{r} g^{(r)}[qS, (q + 1)S),$$

for every rank $q$, a gather and a reduction. A chunk picks each once, when
it is built, as FSDP2 picks its all-gather; moving the shard to the host is the
one event that picks again. `Chunk.gather` then makes one call,
`transport.gather(full, shard)`, on the gather stream, and `ChunkGrads.reduce`
one, `reduction.reduce(shard_grad, full_grad)`, on the reduce stream.
"""

from __future__ import annotations

import torch

from .communication import Communicator
from .config import ZeroConfig
from .hybrid import ReplicaGroup
from .peer_memory import PeerBuffer, PeerMemory

# ## Gathers
#
# Where this rank's shard lives decides how a chunk is gathered:
#
# * **collective**: the shard is device memory; one all-gather (NCCL on GPUs,
#   gloo on CPU) reads it and writes `full`;
# * **peer**: the shard lies in memory that every rank of the host can read
#   ([peer memory](peer_memory.html)); each rank copies the peers' shards out,
#   and no collective kernel runs;
# * **host-staged**: the shard is in host memory (`Chunk.offload_shard`); it is
#   first copied up into its own slice of `full`, and the all-gather then runs in
#   place there (the in-place form of NCCL's all-gather: the input is the output's
#   slice of this rank);
# * **fp8**: the chunk holds weights that only fp8 products read; they travel
#   as one-byte codes at one scale for the chunk, the rest beside them, and
#   are decoded into `full` ([gathering in fp8](float8_gather.html)). The chunk
#   picks it over the collective, from a device or a host shard.


class CollectiveGather:
    """
    ## All-gather from a device shard

    The default: `comm.all_gather(full, shard)`. It holds nothing of a chunk's,
    so the chunks of a model share one.
    """

    def __init__(self, comm: Communicator):
        self.comm = comm

    def gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.comm.all_gather(full, shard)

    def close(self) -> None:
        """Nothing to give back."""


class PeerGather:
    """
    ## Copy the shards out of the peers' memory

    * `memory`: the model's `PeerMemory`, which copies and counts.
    * `peers`: the `PeerBuffer` that holds every rank's shard of this chunk
      (`shard` is its local view, so it is not read here).
    """

    def __init__(self, memory: PeerMemory, peers: PeerBuffer):
        self.memory = memory
        self.peers = peers

    def gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.memory.all_gather(full, self.peers)

    def close(self) -> None:
        """The shard leaves peer memory; its bytes no longer count there."""
        self.memory.forget(self.peers)


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


# ## Reductions
#
# A reduction takes the mean over all $N_d$ ranks of this rank's slice of the
# gradient. A chunk picks its *reduction* once:
#
# * **collective**: one reduce-scatter with averaging over the shard group;
# * **peer**: the ranks push their gradients into a workspace in peer memory and
#   each averages its own slice there, in fp32 ([peer memory](peer_memory.html));
# * **hybrid**: either of the two inside the shard group of $N_s$ ranks, then an
#   all-reduce of the $S$-element result across the $N_d / N_s$ groups
#   (explained in [hybrid sharding](hybrid.html)): the mean of the $N_d / N_s$ group
#   means, each over $N_s$ ranks, is the mean over all $N_d$.
#
# Each has two attributes besides its `reduce`, fixed when it is built, that
# `ChunkGrads.reduce` reads instead of asking what kind it is:
#
# * `exact_input`: whether `full` may arrive in the parameter dtype with the
#   mean still taken in `shard`'s (see `ChunkGrads.exact_dtype`);
# * `identity`: whether the mean is over one rank alone, so that the chunk can
#   cast its gradients straight into the gradient shard and reduce nothing.


class CollectiveReduce:
    """
    ## Reduce-scatter with averaging

    The default: `comm.reduce_scatter_mean(shard, full)`, both in one dtype.
    `exact_input` says whether `full` may arrive in the parameter dtype with the
    mean still taken in `shard`'s (see `ChunkGrads.exact_dtype`): not for a
    collective, which needs one dtype. The identity when the shard group is one
    rank.
    """

    exact_input = False

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.identity = comm.world_size == 1

    def reduce(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """`shard` [S] ← the mean over the shard group of this rank's slice of
        `full` [N_s·S]."""
        self.comm.reduce_scatter_mean(shard, full)


class PeerReduce:
    """
    ## Reduce through a workspace in peer memory

    * `memory`: the model's `PeerMemory`, which keeps the workspace.

    The mean is taken in `shard`'s dtype, so a bf16 gradient travels in bf16
    and is still averaged in fp32. Peer memory exists only for more than one
    rank, so never the identity.
    """

    exact_input = True
    identity = False

    def __init__(self, memory: PeerMemory):
        self.memory = memory

    def reduce(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.memory.reduce_scatter_mean(shard, full)


class HybridReduce:
    r"""
    ## Reduce inside the shard group, then across the replicas

    * `inner`: the reduction inside the shard group (collective or peer).
    * `replicas`: the `ReplicaGroup` across which the result is averaged.

    The all-reduce moves $S$ elements, $\frac{1}{N_s}$ of the chunk, across the
    groups. Never the identity: there are at least two replicas.
    """

    identity = False

    def __init__(self, inner: CollectiveReduce | PeerReduce, replicas: ReplicaGroup):
        self.inner = inner
        self.replicas = replicas
        self.exact_input = inner.exact_input

    def reduce(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.inner.reduce(shard, full)
        self.replicas.all_reduce_mean(shard)


# what `Transports` hands a chunk: its gather, its reduction
Gather = CollectiveGather | PeerGather
Reduction = CollectiveReduce | PeerReduce | HybridReduce


class Transports:
    r"""
    ## A model's transports, chosen once from its config

    Reads `ZeroConfig.peer_gather`, `peer_reduce` and `shard_group_size` once
    (`for_config`), builds what they need, and from then on answers each
    chunk's two questions without looking at the config again:

    * `new_shard(numel, dtype)`: a zero-filled shard and the gather that reads
      it;
    * `reduction(trainable)`: the reduction of a chunk's gradients, `None` for
      a frozen chunk.

    It holds

    * `comm`, the [communicator](communication.html) (its shard group, streams
      and counter);
    * `peer_memory`, the model's `PeerMemory`, or `None` (neither flag, or one
      rank: with one rank nothing is gathered, the chunk's full buffer is its
      shard);
    * `replicas`, the `ReplicaGroup`, or `None` without hybrid sharding;
    * `gathers_peers`: whether shards go into peer memory (`peer_gather`);
    * the one gather and the one reduction the chunks share, since neither
      holds anything of a chunk's (a `PeerGather` holds its chunk's buffer,
      so each such chunk gets its own).

    Each transport holds what it moves the bytes with, and nothing else: the
    [communicator](communication.html) for a collective, the model's
    [peer memory](peer_memory.html) (`PeerMemory`) for copies, the
    [replica group](hybrid.html) (`ReplicaGroup`) for hybrid sharding's second
    step. This class reads the config once per model, builds
    those owners, and hands each chunk its gather and its reduction.
    """

    def __init__(self, comm: Communicator, *, peer_memory: PeerMemory | None = None,
                 gathers_peers: bool = False, reduces_peers: bool = False,
                 replicas: ReplicaGroup | None = None):
        if (gathers_peers or reduces_peers) and peer_memory is None:
            raise ValueError("gathers or reductions through peer memory need a "
                             "PeerMemory")
        self.comm = comm
        self.peer_memory = peer_memory
        self.replicas = replicas
        self.gathers_peers = gathers_peers
        self._gather = CollectiveGather(comm)
        inner = PeerReduce(peer_memory) if reduces_peers else CollectiveReduce(comm)
        self._reduction: Reduction = (
            inner if replicas is None else HybridReduce(inner, replicas))

    @classmethod
    def for_config(cls, comm: Communicator, config: ZeroConfig) -> "Transports":
        """
        ### The transports a [`ZeroConfig`](config.html) asks for

        A collective on every rank, in the same order (the replica groups, the
        peers' host check and run name), right after the communicator.
        """
        # with one rank there is no peer to read from: the chunk's full buffer is
        # its shard
        many = comm.world_size > 1
        gathers, reduces = config.peer_gather and many, config.peer_reduce and many
        memory = PeerMemory(comm) if gathers or reduces else None
        return cls(comm, peer_memory=memory, gathers_peers=gathers,
                   reduces_peers=reduces, replicas=ReplicaGroup.for_config(comm,
                                                                           config))

    def new_shard(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Gather]:
        """
        ### A zero-filled `[numel]` shard and the transport that gathers it

        With `peer_gather` the shard is allocated in peer memory (a collective:
        every rank allocates in the same order) and gathered by a `PeerGather`.
        """
        if not self.gathers_peers:
            return (torch.zeros(numel, dtype=dtype, device=self.comm.device),
                    self._gather)
        peers = self.peer_memory.new_buffer(numel, dtype)
        return peers.local, PeerGather(self.peer_memory, peers)

    def reduction(self, trainable: bool) -> Reduction | None:
        """### The reduction of a chunk's gradients (none if it is frozen)"""
        return self._reduction if trainable else None
