"""
---
title: Chunk
summary: One flat buffer of parameters, sharded over ranks; gather, release, reduce.
---

# Chunk

A chunk is the unit of memory and of communication in this engine. The
[layout](chunk_layout.html) decided which parameters it holds and where; this page
owns the tensors.

Every rank keeps its *shard*, a flat slice of $S = C / N_d$ elements of the
chunk's $C$ elements, in the parameter dtype (bf16, fp16 or fp32); that and the
rest of the rank's state of the chunk belong to its
[local shard](shard.html) (`chunk.local`). The parameters
of the module are **views into one full-size buffer** `full` of $C$ elements. Most
of the time that buffer has no storage at all; gathering gives it storage and fills
it with one all-gather (through the chunk's [transport](transport.html)),
releasing takes the storage away again. The modules never
notice: their `nn.Parameter` objects stay the same, only the memory behind them
comes and goes.

## Note: why storage resize

Autograd keeps references to the tensors a layer used in its forward pass (the
weight of a linear layer, for its backward). If releasing a chunk made new tensors,
those saved references would pin the old memory and the release would free
nothing; if it freed the memory under them, the backward would read garbage. So the
chunk keeps one tensor and resizes its *storage*: `untyped_storage().resize_(0)`
frees the memory while every view, saved or not, keeps its shape and offset;
`resize_(nbytes)` before the backward pass gives the same views fresh memory, which
the all-gather fills with the same values. A view is only read while its chunk is
gathered, which the [hooks](hooks.html) guarantee.

## Gradients

Autograd accumulates each parameter's gradient into `param.grad`, a full-size
tensor in the parameter dtype. As soon as it is complete (the post-accumulate-grad
hook), the chunk takes it and `param.grad` is dropped. When every trainable
parameter of the chunk has reported, the gradients are copied, in one
multi-tensor copy, into the chunk's full-size gradient buffer in the *reduce
dtype* (fp32 by default), one reduce-scatter averages the buffer over ranks into
this rank's shard gradient `local.grad` (fp32, $S$ elements), and the buffer is
freed. Padding is zero in the buffer, so it is zero in the gradient.

The average, not the sum: each rank's loss is a mean over its own micro-batch, so
the mean over ranks is the gradient of the mean loss over the global batch, the
same gradient an unsharded model gets from the whole batch.

## Memory per rank

| tensor | elements | bytes per element | when |
|---|---|---|---|
| the [local shard](shard.html) | $S$ each | $p$, 4, 4 | see its page |
| `full` | $C$ | $p$ | while gathered |
| held gradients | up to $C$ | $p$ | first gradient to the chunk's last |
| full gradient | $C$ | $g_r$ (reduce dtype) | the chunk's last gradient to reduction |

Under `no_sync` the full gradient lives longer: from the first micro-batch to
the backward that reduces it, every trainable chunk's at once.

## Limitations

* A parameter that gets no gradient in a backward pass counts as a zero gradient
  (PyTorch's optimizers would skip it instead).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Sequence

import torch
from torch import nn

from .chunk_layout import ChunkSpec
from .communication import profiled
from .shard import LocalShard
from .transport import HostStagedGather, PeerGather, Transports


def padding_ranges(spec: ChunkSpec) -> list[tuple[int, int]]:
    """The `[start, end)` ranges of a chunk that hold no parameter."""
    gaps, filled = [], 0
    for slot in sorted(spec.slots, key=lambda s: s.offset):
        if slot.offset > filled:
            gaps.append((filled, slot.offset))
        filled = max(filled, slot.end)
    if filled < spec.chunk_numel:
        gaps.append((filled, spec.chunk_numel))
    return gaps


class ChunkState(Enum):
    r"""
    ## The states of a chunk's parameters

    What each state costs on this rank, beyond the [local shard](shard.html)
    ($S \cdot p$ bytes, always there):

    * `UNINITIALISED`: built from meta parameters; the shard is allocated but
      holds no values until `materialize` (or a load) writes them. Nothing more.
    * `SHARDED`: only the shard exists; the parameter views have no memory and
      must not be read. Nothing more.
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
    2. `gather()`: `full` gets storage, an all-gather is queued → `GATHERING`;
    3. `wait()`: the compute stream waits for the gather → `GATHERED`
       (`RESIDENT` after `keep_resident`, which `release()` then leaves be);
    4. `release()`: `full` loses its storage → `SHARDED`;
    5. for trainable chunks, `add_grad()` for each parameter's gradient, then
       `reduce()` averages them into `local.grad`.

    * `spec` is the chunk's place in the layout.
    * `params` are the module's parameters, in the order of `spec.slots`.
    * `transports` are the model's [transports](transport.html); their
      communicator (`comm`) knows the rank and the world size.
    * `dtype` is the parameter dtype; `reduce_dtype` the dtype of the reduction.
    * `names` are the parameters' qualified names in the model.
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
        self.reduce_dtype = reduce_dtype
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

        # [C] param dtype; views into it replace the parameters' data.
        self.full = torch.empty(self.numel, dtype=dtype, device=device)
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
        self.full.untyped_storage().resize_(0)
        self.state = ChunkState.UNINITIALISED if on_meta else ChunkState.SHARDED
        self._gathered_event = None
        # The placement's decision (`keep_resident`; the placement is explained
        # in [its page](placement.html)), not a state: it outlives a forced
        # release (new weights loaded), after which the next gather makes the
        # chunk `RESIDENT` again.
        self.stays_gathered = False

        # [C] reduce dtype, allocated at the first gradient of a backward pass
        self.grad_full: torch.Tensor | None = None
        # slots (by position) whose gradient arrived in this backward pass
        self.grads_seen: set[int] = set()
        # (position, gradient) not yet in `grad_full`; see `add_grad`
        self.held: list[tuple[int, torch.Tensor]] = []
        # slots written into `grad_full` since it was allocated (across the
        # micro-batches of an accumulation); the rest of it is uninitialised
        self.grads_written: set[int] = set()
        # [start, end) ranges of the chunk that no parameter covers: padding
        self.gaps = padding_ranges(spec)

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
        self.full.untyped_storage().resize_(self._full_nbytes)
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
            self.full.untyped_storage().resize_(0)
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
        # the peer memory (if any) is let go; NCCL gathers a host shard
        self.transport.close()
        self.transport = HostStagedGather(self.comm, self.shard_offset)

    def keep_resident(self) -> None:
        r"""
        ### Keep a frozen chunk gathered from its first gather on

        The opposite of offloading, for when device memory allows: the full
        buffer, $N_d S p$ bytes instead of $S p$, stays, and the chunk is never
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
        comm = self.comm
        compute = comm.current_stream()
        # Allocated on the compute stream, which is the only stream that reads it
        # or frees it; see Note: why storage resize.
        self.full.untyped_storage().resize_(self._full_nbytes)
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
        self.full.untyped_storage().resize_(0)
        self.state = ChunkState.SHARDED

    ### Gradients

    def add_grad(self, position: int, grad: torch.Tensor) -> None:
        r"""
        ### Take the gradient of parameter number `position`

        It is held until the chunk's last parameter reports (`flush_grads`): one
        multi-tensor copy for the whole chunk then, instead of one copy, with its
        Python call and kernel launch, per parameter: for a small model with
        many parameter tensors the host's time per step, not the GPU's, is what
        bounds the step.
        """
        self.held.append((position, grad))
        self.grads_seen.add(position)

    def flush_grads(self, *, stream=None, dtype: torch.dtype | None = None) -> None:
        r"""
        ### Copy the held gradients into the full-size gradient buffer

        The buffer is allocated uninitialised: a parameter's first gradient is
        *copied* in (cast to the reduce dtype), later ones (accumulation) added.
        Zeroing the whole buffer first and adding would cost a write and a read of
        $C \cdot g$ bytes per chunk per step, 8 bytes per parameter in fp32.
        Only padding and parameters that got no gradient are zeroed, at the
        reduction.

        `stream` is the side stream the copy runs on, when not the current one
        (`reduce` runs it on the reduce stream). `dtype` is the buffer's dtype
        if it is allocated now (default: the reduce dtype).
        """
        if not self.held:
            return
        if stream is not None:
            for _, grad in self.held:
                # autograd allocated it on the compute stream, which may reuse
                # its memory as soon as the chunk lets go of it
                grad.record_stream(stream)
        if self.grad_full is None:
            # [C] reduce dtype, uninitialised; see above
            self.grad_full = torch.empty(
                self.numel, dtype=dtype or self.reduce_dtype, device=self.comm.device
            )
        copies: tuple[list, list] = ([], [])
        adds: tuple[list, list] = ([], [])
        for position, grad in self.held:
            slot = self.spec.slots[position]
            target = adds if position in self.grads_written else copies
            target[0].append(self.grad_full[slot.offset : slot.end])
            target[1].append(grad.reshape(-1))
            self.grads_written.add(position)
        # `_foreach_*`: PyTorch's multi-tensor kernels, private but what its own
        # optimizers and FSDP2 use; one call casts and copies all
        if copies[0]:
            torch._foreach_copy_(*copies)
        if adds[0]:
            torch._foreach_add_(*adds)
        self.held.clear()

    def _zero_unwritten(self) -> None:
        """Zero the padding and the parameters without a gradient, before reducing."""
        for start, end in self.gaps:
            self.grad_full[start:end].zero_()
        for position, slot in enumerate(self.spec.slots):
            if position not in self.grads_written:
                self.grad_full[slot.offset : slot.end].zero_()

    @property
    def all_grads_seen(self) -> bool:
        return len(self.grads_seen) == len(self.spec.slots)

    def reduce(self) -> None:
        r"""
        ### Reduce-scatter the gradient into `local.grad`

        $g_{\text{shard}} \mathrel{+}= \frac{1}{N_d} \sum_r g^{(r)}_{\text{shard}}$,
        added to what `local.grad` holds so that gradients accumulate until
        `zero_grad`, as `param.grad` does. One call to the chunk's
        [reduction](transport.html) (`self.reduction`), chosen when the chunk is
        built: collective, peer memory, or hybrid (explained in
        [transports](transport.html)).
        """
        assert self.trainable, "only trainable chunks have gradients"
        comm, local = self.comm, self.local
        # The first reduction of a step in fp32 writes straight into the
        # gradient shard; otherwise (a later micro-batch, or a narrower reduce
        # dtype) into a temporary that is added to it.
        direct = local.grad is None and self.reduce_dtype == torch.float32
        if local.grad is None:
            local.new_grad(zeroed=not direct)
        # One rank holds the whole chunk ($S = C$): the mean over one rank is
        # the gradient itself, so the held gradients are cast straight into the
        # gradient shard. No buffer, no reduction: $p + 4$ bytes a parameter
        # move instead of $p + 4 + 8$. Not when earlier micro-batches are
        # accumulated in `grad_full` (`no_sync`): that buffer holds them.
        alone = direct and self.reduction.identity and self.grad_full is None
        if alone:
            self.grad_full = local.grad
        # [S] reduce dtype
        reduced = local.grad if direct else torch.empty(
            self.shard_numel, dtype=self.reduce_dtype, device=comm.device)
        # reduce stream waits: the gradients were written on the compute stream
        comm.wait(comm.reduce_stream, comm.current_stream())
        with comm.on(comm.reduce_stream):
            # The copy into the buffer, a memory-bound pass over (p + g)·C
            # bytes, runs here, beside the backward of the layers below,
            # instead of on the compute stream before it.
            self.flush_grads(stream=comm.reduce_stream, dtype=self._exact_dtype())
            if self.grad_full is None:
                # No parameter of the chunk got a gradient; every rank must
                # still take part in the collective, so it reduces zeros.
                self.grad_full = torch.zeros(
                    self.numel, dtype=self.reduce_dtype, device=comm.device)
            else:
                self._zero_unwritten()
            if not alone:
                with profiled("zero::reduce_scatter"):
                    self.reduction.reduce(reduced, self.grad_full)
            if not direct:
                local.grad.add_(reduced)
        if comm.reduce_stream is not None:
            # Allocated on the compute stream (`grad_full` too, when it holds
            # accumulated micro-batches) but used on the reduce stream: the
            # allocator must not reuse them before it is done.
            for tensor in (self.grad_full, reduced, local.grad):
                tensor.record_stream(comm.reduce_stream)
        self.grad_full = None
        self.grads_seen.clear()
        self.grads_written.clear()
        local.expose_grad()

    def _exact_dtype(self) -> torch.dtype | None:
        """
        The parameter dtype, when the reduction can take the gradients in it
        without rounding anything: it reduces through peer memory (the mean is
        then computed in the reduce dtype, see [peer memory](peer_memory.html)),
        and each parameter's gradient arrived once, with no earlier micro-batch
        accumulated into the buffer; and it is no wider than the reduce dtype
        (fp32 parameters with a bf16 reduction keep sending bf16). `None`
        otherwise (the reduce dtype).
        """
        positions = [position for position, _ in self.held]
        narrower = self.dtype.itemsize <= self.reduce_dtype.itemsize
        if (self.reduction.exact_input and narrower and self.grad_full is None
                and len(set(positions)) == len(positions)):
            return self.dtype
        return None

    def zero_grad(self) -> None:
        self.local.zero_grad()
