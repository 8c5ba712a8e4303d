r"""
---
title: Chunk
summary: One flat buffer of parameters, sharded over ranks; gather, release, reduce.
---

# Chunk

A chunk is the unit of memory and of communication in this engine; the
[layout](chunk_layout.html) decided which parameters it holds, this page owns
the tensors. Every rank keeps its *shard* (its [local shard](shard.html),
`chunk.local`), a flat slice of

$$S = \frac{C}{N_d}$$

of the chunk's $C$ elements. The parameters of the module are **views into one
full-size buffer** `full` of $C$ elements, which has storage only while
gathered: the modules never notice, their `nn.Parameter` objects stay the
same, only the memory behind them comes and goes.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Sequence

import torch
from torch import nn

from .chunk_grads import ChunkGrads
from .chunk_layout import ChunkSpec
from .communication import profiled
from .float8_gather import Float8Gather
from .shard import LocalShard
from .transport import CollectiveGather, HostStagedGather, PeerGather, Transports


class ChunkState(Enum):
    r"""
    ## The states of a chunk's parameters

    What each state costs on this rank, beyond the [local shard](shard.html)
    ($S \cdot p$ bytes, always there):

    * `UNINITIALISED`: built from meta parameters; the shard is allocated but
      holds no values until `materialize` (or a load) writes them. Nothing more.
    * `SHARDED`: only the shard exists; the parameter views have no memory and
      must not be read (with one rank they read the shard: see Note: one rank
      gathers nothing). Nothing more.
    * `GATHERING`: the full buffer is allocated ($C \cdot p$ bytes) and an
      all-gather into it is queued on the gather stream.
    * `GATHERED`: the compute stream has waited for the gather; the views hold the
      parameters ($C \cdot p$ bytes) until `release`.
    * `RESIDENT`: gathered, and kept so between steps (a frozen chunk that the
      {{see: placement}} keeps, `keep_resident`): $C \cdot p$ bytes for
      the whole run, and no all-gather after the first.
    """

    UNINITIALISED = "uninitialised"
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    RESIDENT = "resident"


# the states in which the full buffer has memory
GATHERED_STATES = frozenset(
    {ChunkState.GATHERING, ChunkState.GATHERED, ChunkState.RESIDENT})


class Chunk:
    """
    ## A chunk

    Lifecycle:

    1. built: the shard is filled from the module's parameters (this rank's slice
       only), the parameters become views into `full`, which has no storage
       → `SHARDED` (`UNINITIALISED` from meta parameters, until `materialize`);
    2. `gather()`: `full` gets storage, an all-gather is queued → `GATHERING`
       (with one rank neither: see Note: one rank gathers nothing);
    3. `wait()`: the compute stream waits for the gather → `GATHERED`
       (`RESIDENT` after `keep_resident`, which `release()` then leaves be);
    4. `release()`: `full` loses its storage → `SHARDED`;
    5. for trainable chunks, `grads` takes each parameter's gradient and
       reduces them into `local.grad` (its own lifecycle: see `ChunkGrads`).

    * `spec` is the chunk's place in the layout.
    * `params` are the module's parameters, in the order of `spec.slots`.
    * `transports` are the model's [transports](transport.html); their
      communicator (`comm`) knows the rank and the world size.
    * `dtype` is the parameter dtype; `reduce_dtype` the dtype of the reduction.
    * `names` are the parameters' qualified names in the model.

    ### Gradients

    A trainable chunk's gradients are an object of their own, `grads` (explained in
    [a chunk's gradients](chunk_grads.html)): it holds each parameter's gradient as
    autograd completes it, writes them into a full-size buffer in the reduce dtype,
    and reduce-scatters that into this rank's shard gradient `local.grad`. A frozen
    chunk has none. So a chunk runs two state machines, each on its own object:
    its parameters' (`ChunkState`, below) and its gradients' (held, written,
    reduced). They share no tensor: releasing the parameters' `full` after a
    unit's backward leaves the gradients where they are, whether or not the
    chunk has been reduced yet.

    ### Memory per rank

    | tensor | elements | bytes per element | when |
    |---|---|---|---|
    | the [local shard](shard.html) | $S$ each | $p$, 4, 4 | see its page |
    | `full` | $C$ | $p$ | while gathered (with one rank, none: it is the shard) |
    | `grads` | up to $C$ | $p$, then $g_r$ | see [its page](chunk_grads.html) |
    """

    def __init__(
        self,
        spec: ChunkSpec,
        params: Sequence[nn.Parameter],
        transports: Transports,
        *,
        dtype: torch.dtype,
        reduce_dtype: torch.dtype = torch.float32,
        names: Sequence[str] = (),
    ):
        self.spec = spec
        self.comm = comm = transports.comm
        self.dtype = dtype
        self.trainable = spec.trainable
        self.numel = spec.chunk_numel
        self.shard_numel = self.numel // comm.world_size
        # first element of this rank's shard inside the chunk
        self.shard_offset = comm.rank * self.shard_numel
        self.params = list(params)
        # qualified names of the parameters, for checkpoints and error messages
        self.names = list(names) or [
            f"chunk{spec.index}.{i}" for i in range(len(self.params))
        ]
        device = comm.device

        # [S] param dtype; the only copy of these parameters this rank keeps,
        # and the [transport](transport.html) that gathers it (with
        # `peer_gather` the shard lies in memory the other ranks read).
        shard, self.transport = transports.new_shard(self.shard_numel, dtype)
        # weights that only fp8 products read travel as fp8 codes
        # ([gathering in fp8](float8_gather.html)), with several ranks
        fp8 = Float8Gather.for_chunk(comm, spec, self.params, dtype=dtype)
        if fp8 is not None:
            if isinstance(self.transport, PeerGather):
                raise ValueError(f"chunk {spec.index} holds weights gathered in "
                                 "fp8, which peer memory does not gather: turn "
                                 "peer_gather off or fp8 products off")
            self.transport = fp8
        # and the reduction that averages its gradients into this rank's shard
        self.reduction = transports.reduction(self.trainable)
        # [S] fp32; the original fp32 values, when the parameters were fp32 and the
        # chunk is bf16 or fp16, so the optimizer's master copy starts exact
        # (AdamFP16 takes it and drops it).
        master_init = None
        if (
            self.trainable
            and dtype != torch.float32
            and any(p.dtype == torch.float32 for p in self.params)
        ):
            master_init = torch.zeros(
                self.shard_numel, dtype=torch.float32, device=device
            )
        on_meta = False
        for slot, param in zip(spec.slots, self.params):
            if param.device.type == "meta":
                on_meta = True
                continue
            self._copy_into_shard(slot, param.detach(), shard, master_init)
        # this rank's state of the chunk: see [the shard](shard.html)
        self.local = LocalShard(shard, trainable=self.trainable,
                                master_init=master_init)
        # a trainable chunk's gradients, from autograd to `local.grad`
        self.grads = (ChunkGrads(spec, self.local, comm, self.reduction, dtype=dtype,
                                 reduce_dtype=reduce_dtype)
                      if self.trainable else None)

        # ### Note: one rank gathers nothing
        #
        # With one rank (one process, or hybrid sharding with groups of one)
        # the shard is the whole chunk, $S = C$, and an all-gather would copy
        # it into a second buffer of $C \cdot p$ bytes, twice a step (the
        # forward pass and the backward's). So when that shard is on the
        # device and gathered by the plain collective (`full_is_shard`),
        # `full` *is* the shard: gathering and releasing only move the state,
        # and the gathered window's memory and $2 C p$ bytes of copies per
        # gather are saved. The optimizer's writes into the shard are ordered
        # before the next read (see `gather`). A shard moved to the host
        # (`offload_shard`) leaves the device memory to `full`, gathered into
        # from then on as on $N_d$ ranks.
        self.full_is_shard = (comm.world_size == 1
                              and isinstance(self.transport, CollectiveGather))
        # [C] param dtype; views into it replace the parameters' data.
        self.full = (shard if self.full_is_shard
                     else torch.empty(self.numel, dtype=dtype, device=device))
        # (position, new parameter) for meta parameters, which cannot take a real
        # tensor as `.data`: the owner module must swap in the new `nn.Parameter`
        self.replaced: list[tuple[int, nn.Parameter]] = []
        for position, (slot, param) in enumerate(zip(spec.slots, self.params)):
            view = self.full[slot.offset : slot.end].view(param.shape)
            if param.device.type == "meta":
                # Not `nn.Parameter(view)`: a view shares the version counter of
                # `full`, which every all-gather bumps, and autograd would reject
                # the saved weight as modified in place. `.data =` keeps the new
                # parameter's own counter, as for parameters built for real.
                new = nn.Parameter(
                    torch.empty(0, dtype=dtype, device=device),
                    requires_grad=param.requires_grad,
                )
                new.data = view
                self.params[position] = new
                self.replaced.append((position, new))
            else:
                param.data = view
        # Free the full buffer's storage but keep the tensor, which the
        # parameters are views of (see Note: why storage resize).
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self._free_full()
        self.state = ChunkState.UNINITIALISED if on_meta else ChunkState.SHARDED
        self._gathered_event = None
        # The placement's decision (`keep_resident`; the placement is explained
        # in [its page](../planner/placement.html)), not a state: it outlives a forced
        # release (new weights loaded), after which the next gather makes the
        # chunk `RESIDENT` again.
        self.stays_gathered = False

    @property
    def shard(self) -> torch.Tensor:
        """`[S]` this rank's shard: an `nn.Parameter` if trainable (`local.param`)."""
        return self.local.param

    @property
    def shard_on_host(self) -> bool:
        return self.local.on_host

    @property
    def peers(self):
        """The `PeerBuffer` of a shard in peer memory, else `None`."""
        return self.transport.peers if isinstance(self.transport, PeerGather) else None

    def _copy_into_shard(self, slot, source: torch.Tensor, shard, master_init) -> None:
        """
        #### Copy this rank's part of a parameter into the shard

        The parameter covers chunk elements $[o, o + n)$ and the shard
        $[rS, (r + 1)S)$; only the overlap is copied, so a rank never materialises
        the rest of the chunk.
        """
        start = max(slot.offset, self.shard_offset)
        end = min(slot.end, self.shard_offset + self.shard_numel)
        if start >= end:
            return
        # [n] flat slice of the parameter, still on its own device and dtype
        part = source.reshape(-1)[start - slot.offset : end - slot.offset]
        lo, hi = start - self.shard_offset, end - self.shard_offset
        shard[lo:hi].copy_(part)
        if master_init is not None:
            master_init[lo:hi].copy_(part)

    def materialize(
        self, init: Callable[[str, torch.Tensor], None], *, names: Sequence[str] = ()
    ) -> None:
        """
        ### Initialise a chunk built from meta parameters

        Gathers nothing: the full buffer gets storage, `init(name, param)` writes
        each parameter's initial values in place (every rank draws the same ones;
        `names` replace the qualified names given to `init`),
        this rank's slice goes into the shard (and the fp32 master's first value),
        and the buffer loses its storage again. One chunk at a time, so lazy
        initialisation never holds more than one chunk beyond the shards.
        """
        if self.state is not ChunkState.UNINITIALISED:
            return
        self._allocate_full()
        try:
            with torch.no_grad():
                # padding stays zero, as in chunks built from real parameters
                self.full.zero_()
                for name, param in zip(names or self.names, self.params):
                    init(name, param)
                lo = self.shard_offset
                self.shard.data.copy_(self.full[lo : lo + self.shard_numel])
                master_init = self.local.master_init
                if master_init is not None:
                    master_init.copy_(self.full[lo : lo + self.shard_numel])
        finally:
            self._free_full()
        self.state = ChunkState.SHARDED

    def load_param(self, position: int, value: torch.Tensor) -> None:
        """
        ### Load a parameter's value into this rank's shard

        For pretrained weights loaded after sharding: only the slice this rank
        keeps is copied, from wherever `value` lives (CPU, say). The fp32 master
        starts from `value` too, when the optimizer has not taken it yet.
        """
        param = self.params[position]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{self.names[position]}: checkpoint shape {tuple(value.shape)} "
                f"does not match the model's {tuple(param.shape)}"
            )
        master_init = self.local.master_init
        # a resident gathered copy would no longer match the shard
        self.release(force=True)
        with torch.no_grad():
            self._copy_into_shard(
                self.spec.slots[position], value.detach(), self.shard.data, master_init
            )

    def offload_shard(self) -> None:
        r"""
        ### Keep this rank's shard in host memory

        The shard moves to host memory (page-locked on a GPU, so that the copy up
        is a DMA that runs beside the computation), saving $p S$ device bytes; each
        gather then first copies it up into its own slice of the full buffer and
        all-gathers in place. A trainable shard stays the same `nn.Parameter` (its
        `.data` moves), so its optimizer must keep the master on the host too
        (`AdamFP16(offload=...)`): the update then writes the rounded master
        straight into it. Its gradient stays on the device
        (`LocalShard.grad_device`).
        """
        if self.local.on_host:
            return
        assert not self.is_gathered, "offload a shard between steps"
        self.local.move_to_host(pin=self.comm.device.type == "cuda")
        if self.full_is_shard:
            # the shard went to the host; the device memory the views still
            # point to is the full buffer's now, gathered into like any other
            self.full_is_shard = False
            self._free_full()
        # the peer memory (if any) is let go; NCCL gathers a host shard
        self.transport.close()
        # the fp8 gather copies a host shard up itself
        if isinstance(self.transport, Float8Gather):
            self.transport.staged = True
        else:
            self.transport = HostStagedGather(self.comm, self.shard_offset)

    def keep_resident(self) -> None:
        r"""
        ### Keep a frozen chunk gathered from its first gather on

        The opposite of offloading, for when device memory allows: the full
        buffer, $N_d S p$ bytes beside the shard's $S p$, stays, and the chunk is never
        gathered again, neither in the backward pass nor in later steps. Only
        frozen chunks: a trainable chunk's buffer would be stale after each
        optimizer step.
        """
        if self.trainable:
            raise ValueError(f"chunk {self.spec.index} is trainable: its gathered "
                             "copy would be stale after each optimizer step; only "
                             "frozen chunks can stay resident")
        self.stays_gathered = True
        if self.state is ChunkState.GATHERED:
            self.state = ChunkState.RESIDENT

    @property
    def is_gathered(self) -> bool:
        """Whether the full buffer has memory (`GATHERING`, `GATHERED`, `RESIDENT`)."""
        return self.state in GATHERED_STATES

    ### Gather and release

    def gather(self) -> None:
        """Queue the all-gather of the chunk; idempotent."""
        # an uninitialised chunk gathers as a sharded one does (its shard may have
        # been written by a load); what it gathers is the caller's business
        if self.is_gathered:
            return
        if self.full_is_shard:
            # The views read the shard itself: nothing to allocate, copy or
            # wait for. The optimizer writes it in place, before the compute
            # stream's next read: `step()` runs on the compute stream, and an
            # update during the backward pass starts after the chunk's last
            # gradient and ends with the compute stream waiting for it.
            self._gathered_event = None
            self.state = ChunkState.GATHERING
            return
        comm = self.comm
        compute = comm.current_stream()
        # Allocated on the compute stream, which is the only stream that reads it
        # or frees it; see Note: why storage resize.
        self._allocate_full()
        # gather stream waits: the optimizer may have just written the shard, and
        # the new storage may reuse memory the compute stream was still using.
        comm.wait(comm.gather_stream, compute)
        # stable profiler name, which the benchmark and the timeline refer to
        with profiled("zero::gather"), comm.on(comm.gather_stream):
            self.transport.gather(self.full, self.shard.detach())
        self._gathered_event = comm.record_event(comm.gather_stream)
        self.state = ChunkState.GATHERING

    def wait(self) -> None:
        """The compute stream waits for the gather; then the views hold the data."""
        if self.state is ChunkState.GATHERING:
            # compute stream waits: the all-gather writes `full` on the gather stream
            self.comm.wait_event(self._gathered_event)
            self._gathered_event = None
            self.state = (ChunkState.RESIDENT if self.stays_gathered
                          else ChunkState.GATHERED)

    def release(self, *, force: bool = False) -> None:
        """Free the full buffer; the shard stays. A resident chunk keeps it,
        unless `force`."""
        if not self.is_gathered:
            return
        if self.stays_gathered and not force:
            return
        # A prefetched chunk may never have been waited for: wait before freeing,
        # or the allocator could hand the memory out while the gather still writes.
        self.wait()
        self._free_full()
        self.state = ChunkState.SHARDED

    # ### Note: why storage resize
    #
    # Autograd keeps references to the tensors a layer used in its forward pass
    # (the weight of a linear layer, for its backward). If releasing a chunk made
    # new tensors, those saved references would pin the old memory and the release
    # would free nothing; if it freed the memory under them, the backward would
    # read garbage. So the chunk keeps one tensor and resizes its *storage*:
    # `untyped_storage().resize_(0)` frees the memory while every view, saved or
    # not, keeps its shape and offset; `resize_(nbytes)` before the backward pass
    # gives the same views fresh memory, which the all-gather fills with the same
    # values. A view is only read while its chunk is gathered, which the
    # [hooks](hooks.html) guarantee.

    def _allocate_full(self) -> None:
        """Give `full` its storage back (none to give when it is the shard)."""
        if not self.full_is_shard:
            self.full.untyped_storage().resize_(self._full_nbytes)

    def _free_full(self) -> None:
        """Take `full`'s storage away, unless it is the shard's."""
        if not self.full_is_shard:
            self.full.untyped_storage().resize_(0)

    def zero_grad(self) -> None:
        self.local.zero_grad()
