r"""
---
title: Gathering from the peers' memory
summary: An all-gather without a kernel. Every rank copies the other ranks' shards
  straight out of their memory, on the GPU's copy engines.
---

# Gathering from the peers' memory

NCCL's all-gather is a *kernel*: while it runs beside a layer's matrix
products, its thread blocks hold streaming multiprocessors (SMs) that the
products would use, and the products slow down.

The GPUs of one host can read each other's memory:

* CUDA's virtual memory API maps a buffer of one GPU into the address space of the
  others (PyTorch's *symmetric memory*);
* every GPU has *copy engines*: DMA units that move bytes without any SM.

So a chunk of $C = N_d S$ elements can be gathered with $N_d$ plain memory copies,
one per rank $q$:

$$\text{full}[qS, (q + 1)S) \leftarrow \text{shard}^{(q)}.$$

Each rank *pulls*: it reads the peers' shards and writes only its own `full`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
import warnings

import torch
import torch.distributed as dist

from .communication import Communicator


class PeerBuffer:
    """
    ## A shard of $S$ elements on every rank that every rank can read

    * `local` [S] is this rank's shard, zero-filled.
    * `of(q)` is rank `q`'s shard, read through the peer mapping.
    * `barrier()` returns, or on CUDA its kernel ends, once every rank called it.

    Building one is a collective: every rank must build its chunks' shards in
    the same order.

    #### On CPU

    Processes of one host share memory through a file that all of them map
    (`torch.from_file(..., shared=True)` in `/dev/shm`). `dist.barrier` orders
    them: each rank finishes its writes before it enters the barrier. The copies
    are then `memcpy`. This is the same code path as on a GPU, with the same
    barriers, so the tests exercise it without a GPU.
    """

    def __init__(self, numel: int, dtype: torch.dtype, *, device: torch.device,
                 group, rank: int, world_size: int, name: str):
        self.numel = numel
        self.group = group
        self.rank = rank
        self.world_size = world_size
        if device.type == "cuda":
            self._open_cuda(numel, dtype, device, group)
        else:
            self._open_files(numel, dtype, name)
        self.local.zero_()

    ### CUDA: symmetric memory
    #
    # CUDA's symmetric memory may come from its own allocator, which
    # `torch.cuda.max_memory_allocated` does not count. `counted` says whether it
    # does; `PeerMemory.bytes_uncounted` sums the rest, and the benchmark adds
    # it to the peaks it reports.

    def _open_cuda(self, numel, dtype, device, group) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = (group or dist.group.WORLD).group_name
        with warnings.catch_warnings():
            # Older PyTorch releases need the group enabled; newer ones warn
            # that it is no longer needed, or drop the call.
            warnings.simplefilter("ignore")
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(
                    group_name):
                enable(group_name)
        before = torch.cuda.memory_allocated(device)
        # [S] this rank's shard, in memory the peers map
        self.local = symm_mem.empty(numel, dtype=dtype, device=device)
        # Whether the caching allocator's statistics include it: they do when
        # PyTorch allocates it from a pool of the caching allocator.
        self.counted = (torch.cuda.memory_allocated(device) - before
                        >= self.local.nbytes)
        self._handle = symm_mem.rendezvous(self.local, group_name)
        self._peers = [
            self.local if q == self.rank
            else self._handle.get_buffer(q, (numel,), dtype, 0)
            for q in range(self.world_size)
        ]

    ### CPU: files that every process maps

    def _open_files(self, numel, dtype, name) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

        def path(q: int) -> str:
            return os.path.join(folder, f"labml_zero-{name}-{q}")

        self.counted = False  # no allocator statistics on CPU
        # A mapped file larger than the free space of a tmpfs (Docker gives a
        # container a small /dev/shm by default) fails with SIGBUS when its pages
        # are first touched: refuse it here, in one line, instead.
        needed = numel * torch.empty(0, dtype=dtype).element_size()
        stat = os.statvfs(folder)
        if needed > stat.f_bavail * stat.f_frsize:
            raise ValueError(f"peer memory needs {needed} bytes in {folder}, which "
                             f"has {stat.f_bavail * stat.f_frsize} free")
        # creates the file, of exactly `numel` elements
        self.local = torch.from_file(path(self.rank), shared=True, size=numel,
                                     dtype=dtype)
        dist.barrier(group=self.group)  # every file exists
        self._peers = [
            self.local if q == self.rank
            else torch.from_file(path(q), shared=True, size=numel, dtype=dtype)
            for q in range(self.world_size)
        ]
        dist.barrier(group=self.group)  # every rank mapped every file
        # The mappings keep the memory; the names are no longer needed, and no
        # file outlives the processes.
        os.unlink(path(self.rank))

    ### Reading the peers

    def of(self, rank: int) -> torch.Tensor:
        return self._peers[rank]

    def barrier(self) -> None:
        """Wait for every rank, without a time limit, as NCCL's kernels do."""
        if hasattr(self, "_handle"):
            # queued on the current stream; it ends when every rank's has started
            self._handle.barrier(channel=0)
        else:
            dist.barrier(group=self.group)


def pull_all_gather(full: torch.Tensor, shards: PeerBuffer) -> None:
    """
    ### `full` [N_d·S] ← every rank's shard, copied out of its memory

    On the current stream (the gather stream on a GPU), between two barriers,
    for the reasons below.

    #### When the copies pay

    The copies take no SM from the computation, so the larger the chunk and the
    busier the SMs, the more a gather through peer memory saves the matrix
    products beside it. For small chunks there is no gain: each gather is four
    operations (two barriers and two copies) instead of one kernel, which costs
    host time, and a step bound by the host's time gets slower.
    `bench/peer_gather_probe.py` measures both sides; the figures are on the
    results page.

    #### What the copies cannot do: agree with the peers

    A collective synchronises the ranks by itself. Plain copies do not, so each
    gather is enclosed in two *barriers*. A barrier is a tiny kernel that every rank
    queues on its gather stream, and that ends when every rank has reached it.

    1. **Before the copies.** Each rank's gather stream has already waited for its
       compute stream, which holds the optimizer's last write to the shard (see
       [communication](communication.html)). Once every rank has passed the first
       barrier, every shard is current.
    2. **After the copies.** Once every rank has passed the second barrier, no rank
       still reads this chunk. The gather's event is recorded after it, and the
       optimizer writes a shard only after its chunk's computation, which waited for
       that event. So no rank can overwrite a shard that a peer is still reading.
    """
    size = shards.numel
    shards.barrier()  # every rank's shard is written
    for q in range(shards.world_size):
        # a contiguous copy of the same dtype: `cudaMemcpyAsync`, on a copy engine
        full[q * size:(q + 1) * size].copy_(shards.of(q))
    shards.barrier()  # no rank reads this chunk any more


def push_reduce_scatter_mean(shard: torch.Tensor, full: torch.Tensor,
                             workspace: PeerBuffer) -> None:
    r"""
    ### `shard` [S] ← the mean over ranks of this rank's slice of `full` [N_d·S]

    `workspace` has room for $N_d S$ elements of `full`'s dtype; the mean is in
    `shard`'s dtype.

    #### Reducing through the peers' memory

    A reduce-scatter can be done the same way, with a *workspace*: a buffer of
    $N_d S$ elements on every rank, one slot per rank. Rank $r$ writes slice $q$
    of its full gradient into slot $r$ of rank $q$'s workspace (a copy engine
    writing over NVLink); after a barrier, each rank averages its $N_d$ slots:

    $$g_{\text{shard}}^{(q)} = \frac{1}{N_d} \sum_r \text{workspace}^{(q)}[r].$$

    The average is one kernel (`torch.mean` over the slots), and it runs in fp32
    whatever the dtype of the slots. That allows something a collective cannot
    do. NCCL reduces in the dtype it sends, so an fp32 reduction must send fp32
    values, and every bf16 gradient is first cast into an fp32 buffer. Yet a
    gradient that autograd computed in bf16, with no micro-batches accumulated
    into it, holds nothing that bf16 cannot hold. So `ChunkGrads.reduce` keeps it in
    bf16, and the copies move half the bytes. The sum is still fp32, and on two
    ranks it is the same number an fp32 all-reduce gives.

    The barrier after the copies says that every slice has arrived. The one
    before them says that the workspace is free: a rank reaches it only after its
    previous average on the same stream, so once all ranks have passed it, none
    still reads its workspace, and the copies may overwrite it. No barrier is
    needed after the average; the next reduction's first one covers it.

    The workspace holds one chunk's full gradient on every rank, which the
    [memory model](../planner/memory_model.html) does not count; a chunk whose gradients
    stay bf16 saves as much in its gradient buffer while it is reduced.
    """
    size, world, rank = shard.numel(), workspace.world_size, workspace.rank

    def slots(q: int) -> torch.Tensor:
        # [N_d·S] rank q's workspace, seen in the dtype of `full`
        return workspace.of(q).view(full.dtype)[:world * size]

    workspace.barrier()  # no rank still averages the previous reduction
    for q in range(world):
        # slot `rank` of rank q ← what rank q reduces from this rank
        slots(q)[rank * size:(rank + 1) * size].copy_(full[q * size:(q + 1) * size])
    workspace.barrier()  # every rank's slice has arrived
    torch.mean(slots(rank).view(world, size), dim=0, dtype=shard.dtype, out=shard)


def new_run_name(group) -> str:
    """A name shared by all ranks of `group` and unique to this run (a collective)."""
    name = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group or
                                                             dist.group.WORLD, 0),
                               group=group)
    return name[0]


def check_one_host(group) -> None:
    """
    Peer memory needs every rank on one host: a one-line error otherwise, when
    the model's `PeerMemory` is built (before any buffer).
    """
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise ValueError(f"peer_gather needs every rank on one host; the ranks run "
                         f"on {sorted(set(hosts))}")


class PeerMemory:
    r"""
    ## A model's peer memory

    Built once per model, by its [transports](transport.html), on every rank of
    the shard group in the same order (a collective): it checks that the ranks
    share a host and agrees on `run_name`. Then

    * `new_buffer(numel, dtype)` allocates a `PeerBuffer` of every rank's shard
      (a collective too: every rank allocates its chunks in the same order,
      which is what makes the `allocations`-th buffer's name the same on all);
    * `all_gather` and `reduce_scatter_mean` gather and reduce through them,
      counted in the communicator's `counter` as the collectives they replace;
    * `bytes` are the bytes of this rank's buffers in peer memory (shards and
      workspaces), `bytes_uncounted` those of them the caching allocator does
      not count (`PeerBuffer.counted`), which the benchmark adds to its peaks;
    * `workspaces` are the reduction's workspaces, the last one the largest
      (see `workspace`).

    The transports `PeerGather` and `PeerReduce` each make one call to it. Shards
    kept in host memory (`offload_shard`) are gathered by NCCL as before.
    """

    def __init__(self, comm: Communicator):
        self.comm = comm
        check_one_host(comm.group)
        # the buffers' files (on CPU) are named `<run_name>-<allocation>`
        self.run_name = new_run_name(comm.group)
        self.allocations = 0
        self.bytes = self.bytes_uncounted = 0
        self.workspaces: list[PeerBuffer] = []

    ### Buffers

    def new_buffer(self, numel: int, dtype: torch.dtype) -> PeerBuffer:
        """A zero-filled `PeerBuffer` of `numel` elements on every rank."""
        comm = self.comm
        buffer = PeerBuffer(numel, dtype, device=comm.device, group=comm.group,
                            rank=comm.rank, world_size=comm.world_size,
                            name=f"{self.run_name}-{self.allocations}")
        self.allocations += 1
        self._count(buffer, +1)
        return buffer

    def forget(self, buffer: PeerBuffer) -> None:
        """A chunk no longer uses `buffer` (its shard moved to the host)."""
        self._count(buffer, -1)

    def _count(self, buffer: PeerBuffer, sign: int) -> None:
        self.bytes += sign * buffer.local.nbytes
        if not buffer.counted:
            self.bytes_uncounted += sign * buffer.local.nbytes

    def workspace(self, full: torch.Tensor) -> PeerBuffer:
        """
        #### A reduction workspace with room for `full`; grown, never shrunk

        A reduction already queued on the reduce stream may still use the
        old one: its copies and its average run later, and the peers' copies
        write into it too. Nothing records when the last of them has ended on
        every rank, so the old workspace is kept, not freed, and stays counted
        in `bytes`.

        Every rank holds one chunk's full gradient here, which the
        [memory model](../planner/memory_model.html) does not count.
        """
        nbytes = full.numel() * full.element_size()
        if not self.workspaces or self.workspaces[-1].local.nbytes < nbytes:
            # [⌈bytes / 4⌉] fp32; viewed in the dtype of each `full`
            self.workspaces.append(self.new_buffer(-(-nbytes // 4), torch.float32))
        return self.workspaces[-1]

    ### Gather and reduce

    def all_gather(self, full: torch.Tensor, shards: PeerBuffer) -> None:
        """`full` [N_d·S] ← every rank's shard in `shards`: copies, no kernel."""
        self.comm.counter.add("all_gather", full)
        pull_all_gather(full, shards)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """
        `shard` [S] ← the mean over the shard group of this rank's slice of
        `full` [N_d·S], through the workspace: the mean in `shard`'s dtype
        whatever `full`'s.
        """
        self.comm.counter.add("reduce_scatter", full)
        push_reduce_scatter_mean(shard, full, self.workspace(full))
