r"""
---
title: Communication
summary: The three collectives ZeRO-3 needs, their side streams, and a byte counter.
---

# Communication

ZeRO-3 needs three collectives over a shard group, an all-gather of a chunk, a
reduce-scatter of its gradient and an all-reduce of a scalar, and this page is
the only place that calls them (the `Communicator`'s last three methods). A
step moves $3\Psi$ elements through them, against DDP's $2\Psi$ (see
`CommCounter`). The streams that let these overlap with computation are set up
with the `Communicator` below, its groups where it splits them; what runs over these
groups, and how (collective, peer memory, hybrid), is chosen once per model by
the [transports](transport.html).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .group_ranks import shard_group_ranks


@dataclass
class CommCounter:
    r"""
    ## Collective volume

    The size in elements and bytes of every tensor handed to a collective: the
    output of an all-gather and the input of a reduce-scatter, both the full chunk.
    The bytes a ring algorithm puts on each rank's wire are $\frac{N_d - 1}{N_d}$
    of these.

    Per training step a chunk is gathered for the forward pass and again for the
    backward pass, and every trainable chunk's gradient is reduce-scattered once:
    $3\Psi$ elements of collective volume against DDP's $2\Psi$ (its all-reduce is a
    reduce-scatter plus an all-gather), counted in elements
    (tested: tests/zero3/test_memory_model.py::test_zero3_is_three_psi_and_ddp_two_psi).
    That extra $\Psi$, half of DDP's volume again, is the price of holding
    $\frac{(p + 4 + K)\Psi}{N_d}$ bytes ($p$-byte parameters, fp32 gradient
    shards) instead of $(p + 4 + K)\Psi$; this counter counts it so the tests
    can check the claim. Less where the [hooks](hooks.html) skip the backward's gather:
    the root unit is gathered once for the whole step, a unit with no backward (a
    frozen layer at the input end) is not gathered again, and a resident chunk
    never is.
    """

    calls: dict[str, int] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.elements[kind] = self.elements.get(kind, 0) + tensor.numel()
        self.bytes[kind] = (
            self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
        )

    def reset(self) -> None:
        self.calls.clear()
        self.elements.clear()
        self.bytes.clear()


# Private: what `torch.cuda.current_stream` calls underneath, the id of the
# current stream as a tuple, without building a `Stream`; where a build lacks
# it, the public call (slower) stands in.
_current_stream_key = getattr(torch._C, "_cuda_getCurrentStream", None)
# `Stream` handles by that tuple: the same stream always gets the same handle
_stream_handles: dict[tuple, torch.cuda.Stream] = {}


def current_cuda_stream(device_index: int) -> torch.cuda.Stream:
    """
    #### The current stream of a GPU, cheaply

    `torch.cuda.current_stream` builds a new `Stream` each call, inside a
    device guard: microseconds of host time, and the engine asks several times
    per chunk (and `torch.cuda.stream` asks twice more on entering). Here only
    the stream's id is asked, and a handle made once per stream is returned.
    """
    if _current_stream_key is None:
        return torch.cuda.current_stream(device_index)
    key = _current_stream_key(device_index)
    handle = _stream_handles.get(key)
    if handle is None:
        if len(_stream_handles) > 64:  # streams made and dropped by a caller
            _stream_handles.clear()
        handle = _stream_handles[key] = torch.cuda.current_stream(device_index)
    return handle


class OnStream:
    """
    #### `with OnStream(stream):` the enclosed kernels go to `stream`

    What `torch.cuda.stream(stream)` does for a stream of the current device
    (the engine's: the launcher sets it), without its device queries: the
    current stream is kept, `stream` set, and the kept one set back.
    """

    __slots__ = ("stream", "previous")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def __enter__(self) -> None:
        self.previous = current_cuda_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.previous)


class SideStreamHolds:
    """
    ## Tensors kept alive for a side stream

    #### Note: holding a tensor for a side stream

    A tensor that autograd allocated on the compute stream and a side stream then
    reads (a gradient the reduce stream copies) must not be handed out again by
    the caching allocator before that stream is done with it. `record_stream`
    says so per tensor, but it costs a CUDA event per tensor at every free and
    makes every later allocation poll those events: for a chunk of many small
    parameters, hundreds of events a step on the host, which a small model
    feels. So the communicator keeps the Python references instead, one event
    per chunk (`SideStreamHolds`): a tensor is dropped once the side stream has
    passed the event recorded after its last use, or when the compute stream has
    waited for that stream (then every later use of the memory on the compute
    stream comes after), whichever comes first. A tensor allocated on the side
    stream itself needs neither: the stream uses and frees it in order.

    `hold(tensors, event)` keeps `tensors` until `event` (recorded on the side
    stream after their last use) has passed: `drop_finished` drops the held
    groups whose event has, in order, stopping at the first that has not;
    `drop_all` drops every group, once the compute stream has waited for the
    side stream (see Note: holding a tensor for a side stream). An event is
    anything with `query()`, so the tests drive it on a CPU.
    """

    def __init__(self):
        # (event, tensors), oldest first; events on one stream pass in order
        self.held: collections.deque = collections.deque()

    def hold(self, tensors: list, event) -> None:
        self.drop_finished()
        self.held.append((event, tensors))

    def drop_finished(self) -> None:
        held = self.held
        # While a step is captured as a CUDA graph its events cannot be
        # queried; its held tensors wait for `drop_all` at the end of backward.
        if held and not _capturing():
            while held and held[0][0].query():
                held.popleft()

    def drop_all(self) -> None:
        self.held.clear()


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# Recent PyTorch releases rename `all_gather_into_tensor` and
# `reduce_scatter_tensor` to `all_gather_single` and `reduce_scatter_single`
# (the old names warn); older releases have only the old names. Each is looked
# up once, here, so both kinds of release run the same code below.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def profiled(name: str) -> contextlib.AbstractContextManager:
    """
    #### A named profiler range, only while a profiler records

    `torch.profiler.record_function` costs several microseconds of host time
    even when nothing records, tens of times per step: enough to show in a
    step that the host bounds. `_is_profiler_enabled` is private; every
    gather and reduce-scatter reads it, so a release without it fails every
    test at once.
    """
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class Communicator:
    """
    ## The process group, the side streams and the counter

    * `group` is the process group over which chunks are sharded (`None` for the
      default group); with one rank and no initialised group, collectives are copies.
    * `device` is where the chunks live; side streams exist only for CUDA.
    * `side_streams=False` runs every collective on the compute stream, as on
      CPU: no overlap, and no stream ordering to get wrong. A correctness oracle
      for the overlapped schedule (`ZeroConfig.side_streams`).
    * `shard_group_size` $N_s$ shards over groups of $N_s$ consecutive ranks of the
      default group (see `_split_into_shard_groups` below); `None` shards over
      all ranks of `group`.

    Every attribute is set here, once: the device, the group with this rank's
    place in it, the two streams, what is held for the reduce stream, and the
    counter. Peer memory and the {{see: replica group}} are
    [the transports'](transport.html), which count into `counter`.
    """

    def __init__(self, device: torch.device, *, group=None, side_streams: bool = True,
                 shard_group_size: int | None = None):
        if shard_group_size is not None and group is not None:
            # one rule for the communicator and the {{see: replica group}}: hybrid
            # sharding is decided by `shard_group_size` against the default world
            raise ValueError("shard_group_size splits the default process group; "
                             "it cannot be combined with a process group")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # the device "cuda" means now, fixed once: streams are per device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        if shard_group_size is not None and shard_group_size != self.world_size:
            self._split_into_shard_groups(shard_group_size)
        self.counter = CommCounter()
        # what the reduce stream still reads (see Note: holding a tensor for a
        # side stream)
        self.reduce_holds = SideStreamHolds()
        if self.device.type == "cuda" and side_streams:
            # High priority, so that a gather issued while compute kernels are queued
            # starts as soon as possible: the compute stream will be waiting on it.
            self.gather_stream = torch.cuda.Stream(self.device, priority=-1)
            self.reduce_stream = torch.cuda.Stream(self.device, priority=-1)
        else:
            self.gather_stream = self.reduce_stream = None

    @classmethod
    def for_config(cls, device, config, *, group=None) -> "Communicator":
        """
        The communicator a [`ZeroConfig`](config.html) asks for: its side
        streams and its shard group. Peer memory and the
        {{see: replica group}} are the [transports'](transport.html), made from
        the same config.
        """
        return cls(device, group=group, side_streams=config.side_streams,
                   shard_group_size=config.shard_group_size)

    def _split_into_shard_groups(self, size: int) -> None:
        """
        #### This rank's shard group, out of the default group

        By default a chunk is sharded over every rank. With *hybrid sharding*
        (`ZeroConfig.shard_group_size` $= N_s$) the $N_d$ ranks form $N_d / N_s$
        *shard groups* of $N_s$ consecutive ranks, each holding one whole copy
        of the model states, sharded over its $N_s$ ranks; rank $q$ of group $j$
        is world rank $jN_s + q$. The ranks with the same $q$ in every group form
        a {{term: replica group}} of $N_d / N_s$ ranks that hold the same shard.
        All-gathers and reduce-scatters run inside the shard group, and one
        all-reduce per trainable chunk, of the shard only, runs across the
        replica group, which belongs to [hybrid sharding](hybrid.html). After
        this, `rank` and `world_size` are this rank's place in its shard group:
        the $N_d$ of every other page is $N_s$.

        `torch.distributed.new_group` is itself a collective over the default
        group: every rank must create every group, in the same order, even the
        ones it is not in. So each rank walks the same list and keeps the group
        that holds it. [Hybrid sharding](hybrid.html) makes the replica groups
        after these, in the same way.
        """
        world, rank = self.world_size, self.rank
        # checks that $N_s$ divides the world size, in one line naming both
        for j, ranks in enumerate(shard_group_ranks(world, size)):
            made = dist.new_group(ranks)
            if j == rank // size:
                self.group = made
        self.rank, self.world_size = rank % size, size

    ### Stream helpers
    #
    # On CUDA, gathers run on a *gather stream* and reductions on a *reduce
    # stream*, so that they overlap with the computation on the current
    # (*compute*) stream. Three orderings make this safe; each is marked where
    # it is enforced:
    #
    # 1. a gather waits for the compute stream, because the shard it reads may
    #    have just been written by the optimizer, and its output buffer was
    #    allocated there;
    # 2. the compute stream waits for a gather's event before it reads the chunk;
    # 3. a reduction waits for the compute stream, which wrote the gradients, and
    #    the compute stream waits for the reduce stream before the optimizer
    #    reads them.
    #
    # On GPUs of one host, gathers and reductions can also go through the other
    # ranks' memory, with copies instead of NCCL's kernels
    # ([peer memory](peer_memory.html), which owns those buffers and counts its
    # copies here); the streams and orderings are the same. On CPU (gloo) the
    # collectives are synchronous and every stream is `None`: the same code runs
    # with the waits turned into no-ops, which is how the tests exercise it.

    def current_stream(self):
        """The stream the caller's kernels go to (`None` on CPU)."""
        if self.device.type != "cuda":
            return None
        return current_cuda_stream(self.device.index)

    def hold_for_reduce(self, tensors: list) -> None:
        """Keep `tensors` (allocated on the compute stream) until the reduce
        stream has run what is queued on it so far (nothing to keep on CPU or
        without side streams)."""
        if self.reduce_stream is not None:
            self.reduce_holds.hold(tensors, self.record_event(self.reduce_stream))

    def reduce_stream_waited(self) -> None:
        """The compute stream waits for the reduce stream; what it held for it
        can go."""
        self.wait(self.current_stream(), self.reduce_stream)
        self.reduce_holds.drop_all()

    @staticmethod
    def on(stream) -> contextlib.AbstractContextManager:
        """Run the enclosed kernels on `stream` (nothing to do on CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        return OnStream(stream)

    def wait(self, waiter, waited) -> None:
        """Make stream `waiter` wait for all work queued so far on `waited`."""
        if waiter is not None and waited is not None:
            waiter.wait_stream(waited)

    def record_event(self, stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, event) -> None:
        """The compute stream waits for `event` (recorded on a side stream)."""
        if event is not None:
            self.current_stream().wait_event(event)

    ### Collectives
    #
    # With one rank and no process group the collectives become local copies,
    # so a model wrapped for ZeRO also runs in a plain single-process script.

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """`full` [N_d·S] ← the shards [S] of every rank, in rank order: every
        rank contributes its shard of $S = C / N_d$ elements and receives the
        whole chunk of $C$ elements."""
        self.counter.add("all_gather", full)
        if self.world_size == 1:
            # A shard group of one rank (one process, or hybrid sharding with
            # $N_s = 1$): a chunk whose full buffer is its shard never calls
            # this (see [chunk](chunk.html), Note: one rank gathers nothing);
            # the host-staged gather does, in place, and a copy is left for
            # any other caller. No collective call, whose host-side cost a
            # small model feels.
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return
        _all_gather(full, shard, group=self.group)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """
        `shard` [S] ← this rank's slice of the mean over the shard group of
        `full`: every rank contributes a full-size gradient of $C$ elements and
        receives the *average* over ranks of its own shard; a collective, which
        needs both in one dtype.
        """
        self.counter.add("reduce_scatter", full)
        if self.world_size == 1:
            shard.copy_(full)  # the mean over one rank
            return
        _reduce_scatter(shard, full, op=dist.ReduceOp.AVG, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, *, op=None) -> None:
        """Sum (or `op`) `tensor` over ranks, in place; the step's use is the
        squared gradient norm, whose sum over ranks is also how every rank
        learns that one of them overflowed (non-finite)."""
        self.counter.add("all_reduce", tensor)
        if not self.distributed:
            return
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group)
