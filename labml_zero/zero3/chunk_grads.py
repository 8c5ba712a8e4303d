r"""
---
title: A chunk's gradients
summary: How a trainable chunk's gradients are held, written into one full-size
  buffer (across the micro-batches of an accumulation), and reduce-scattered into
  this rank's shard gradient, with the invariants each step keeps.
---

# A chunk's gradients

The [chunk](chunk.html) owns its parameters' memory; this object, `chunk.grads`,
owns what happens to their gradients between autograd and this rank's shard
gradient `local.grad` (fp32, $S$ elements, on [the local shard](shard.html)).
In each backward pass every trainable parameter's gradient arrives once, through
the gradient hook of [the schedule](hooks.html); the chunk's *full gradient* is
their concatenation in the chunk's layout, $C$ elements, and one reduce-scatter
averages it over the ranks into this rank's slice:

$$g_{\text{shard}} \mathrel{+}= \frac{1}{N_d} \sum_r g^{(r)}_{\text{shard}}$$
"""

from __future__ import annotations

import torch

from .chunk_layout import ChunkSpec
from .communication import Communicator, profiled
from .shard import LocalShard


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


class ChunkGrads:
    r"""
    ## A chunk's gradient accumulation

    Lifecycle, in each step (see Note: a gradient's three steps):

    1. built empty: nothing held, no buffer (a trainable chunk builds one;
       a frozen chunk has none);
    2. `add(position, grad)` for each parameter's gradient: held, $p$ bytes an
       element; it says when every slot has arrived in this backward pass;
    3. `flush()`: the held gradients go into `full` ($C \cdot g_r$ bytes,
       allocated at the first flush of an accumulation);
    4. `end_backward()`, a backward pass under `no_sync` ends: flushed, `seen`
       forgotten, `full` kept for the next micro-batch;
    5. `reduce()`: flushed, zero-filled, reduce-scattered into `local.grad`,
       `full` freed, nothing held, seen or written: back to 1.

    * `spec` is the chunk's place in the layout: its slots and its padding.
    * `local` is this rank's [shard](shard.html), whose `grad` gets the mean.
    * `comm` is the communicator (rank, world size, streams).
    * `reduction` is the chunk's reduction, which the chunk picked (explained in
      [transports](transport.html)).
    * `dtype` is the parameter dtype; `reduce_dtype` the dtype of `full`.

    ### Note: a gradient's three steps

    A slot (one parameter's place in the chunk) goes through three steps in each
    accumulation:

    1. **held**: autograd's gradient, a full-size tensor in the parameter dtype,
       taken from `param.grad` as soon as it is complete and kept as is;
    2. **written**: when the chunk's last parameter has reported, every held
       gradient is copied (a slot's first micro-batch) or added (a later one) into
       `full`, the chunk's full-size buffer in the *reduce dtype*, in one
       multi-tensor call;
    3. **reduced**: the buffer's padding and its unwritten slots are zero-filled,
       one reduce-scatter averages it into `local.grad`, and the buffer is freed.

    Without `no_sync` the three follow each other inside one backward pass. Under
    `no_sync` a backward pass stops after step 2 (`end_backward`): the buffer stays
    for the next micro-batch, and the first backward outside `no_sync` reduces the
    sum once.

    ### Memory per rank

    | tensor | elements | bytes per element | when |
    |---|---|---|---|
    | held gradients | up to $C$ | $p$ | a parameter's gradient to the chunk's last |
    | `full` | $C$ | $g_r$ (reduce dtype) | the first `flush` to `reduce` |
    | `local.grad` | $S$ | 4 ($p$ on one rank, see the shard's Note: one rank keeps the parameter dtype) | the first `reduce` to `zero_grad` |

    The held gradients and `full` are alive together at the copy, and the reduce
    stream holds the gradients until it has read them: $(p + g_r)\,C$ bytes for
    the largest chunk, the [memory model](../planner/grad_buffers.html)'s
    `largest_grad_buffer`. Under `no_sync`, `full` lives from the first
    micro-batch to the backward that reduces it, every trainable chunk's at once:
    about $g_r \Psi_t$ bytes per rank, not divided by $N_d$, with one chunk's
    held gradients beside them; the memory model counts both.
    """

    def __init__(self, spec: ChunkSpec, local: LocalShard, comm: Communicator,
                 reduction, *, dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.slots = spec.slots
        self.numel = spec.chunk_numel
        self.shard_numel = self.numel // comm.world_size
        # [start, end) ranges of the chunk that no parameter covers: padding
        self.gaps = padding_ranges(spec)
        self.local = local
        self.comm = comm
        self.reduction = reduction
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype
        # The invariants, one per piece of state:
        # (position, gradient) that arrived but are not in `full` yet, each
        # position in `seen`; `flush` empties it (see `add`)
        self.held: list[tuple[int, torch.Tensor]] = []
        # slots (by position) whose gradient arrived in *this* backward pass;
        # every backward pass ends with it empty (`end_backward` under
        # `no_sync`, `reduce` otherwise), so the next one counts from nothing
        self.seen: set[int] = set()
        # slots where `full` holds values, the sum of the micro-batches so far;
        # the rest of `full` is uninitialised until `reduce` zero-fills it
        self.written: set[int] = set()
        # [C] reduce dtype; exists from the first `flush` of an accumulation to
        # its `reduce`, and only then: it outlives the backward passes of
        # `no_sync`, and no backward pass outside it
        self.full: torch.Tensor | None = None
        # fixed here, not per call: `add` runs once per parameter per backward
        self._slot_count = len(spec.slots)

    ### Held

    def add(self, position: int, grad: torch.Tensor) -> bool:
        r"""
        ### Take the gradient of parameter number `position`

        Returns whether every slot has now reported in this backward pass. The
        gradient is held until then, for one multi-tensor copy for the whole
        chunk (`flush`) instead of one copy, with its Python call and kernel
        launch, per parameter: for a small model with many parameter tensors
        the host's time per step, not the GPU's, is what bounds the step.
        """
        self.held.append((position, grad))
        self.seen.add(position)
        return len(self.seen) == self._slot_count

    ### Written

    def flush(self, *, dtype: torch.dtype | None = None) -> None:
        r"""
        ### Copy the held gradients into the full-size buffer

        The buffer is allocated uninitialised: a slot's first gradient is
        *copied* in (cast to the reduce dtype), later ones (accumulation) added.
        Zeroing the whole buffer first and adding would cost a write and a read
        of $C \cdot g_r$ bytes per chunk per step, 8 bytes per parameter in
        fp32. Only padding and slots that got no gradient are zeroed, at the
        reduction.

        It runs on the current stream: `reduce` runs it on the reduce stream,
        and keeps the gradients alive for it. `dtype` is the buffer's dtype if
        it is allocated now (default: the reduce dtype).
        """
        if not self.held:
            return
        if self.full is None:
            # [C] reduce dtype, uninitialised; see above
            self.full = torch.empty(
                self.numel, dtype=dtype or self.reduce_dtype, device=self.comm.device
            )
        copies: tuple[list, list] = ([], [])
        adds: tuple[list, list] = ([], [])
        for position, grad in self.held:
            slot = self.slots[position]
            target = adds if position in self.written else copies
            target[0].append(self.full[slot.offset : slot.end])
            target[1].append(grad.reshape(-1))
            self.written.add(position)
        # `_foreach_*`: PyTorch's multi-tensor kernels, private but what its own
        # optimizers and FSDP2 use; one call casts and copies all
        if copies[0]:
            torch._foreach_copy_(*copies)
        if adds[0]:
            torch._foreach_add_(*adds)
        self.held.clear()

    def end_backward(self) -> None:
        """
        ### End a backward pass that does not reduce (`no_sync`)

        The held gradients go into `full`, which stays for the next
        micro-batch with `written`; `seen` starts again from nothing, so that
        the next backward pass reports when all its gradients have arrived.

        `zero_grad` frees `local.grad` only: an accumulation still inside `no_sync`
        keeps its buffer, and the next reduction adds it in.
        """
        self.flush()
        self.seen.clear()

    def discard(self) -> None:
        """Forget every gradient of the pass and of the accumulation: a backward
        pass that raised (the runtime's `_abandon_backward`)."""
        self.held.clear()
        self.seen.clear()
        self.written.clear()
        self.full = None

    ### Reduced

    def _zero_unwritten(self) -> None:
        """Zero the padding and the slots without a gradient, before reducing.

        A parameter that gets no gradient in a backward pass counts as a zero
        gradient (PyTorch's optimizers would skip it instead).
        """
        for start, end in self.gaps:
            self.full[start:end].zero_()
        for position, slot in enumerate(self.slots):
            if position not in self.written:
                self.full[slot.offset : slot.end].zero_()

    def reduce(self) -> None:
        r"""
        ### Reduce-scatter the full gradient into `local.grad`

        The formula above, through one call to the chunk's `reduction`
        (collective, peer memory, or hybrid), on the reduce stream. The mean,
        not the sum: each rank's loss is a mean over its own micro-batch, so
        the mean over ranks is the gradient of the mean loss over the global
        batch, the one an unsharded model gets from the whole batch. It is
        *added* to `local.grad`, so that gradients accumulate until
        `zero_grad`, as `param.grad` does; for an fp32 shard `local.grad` *is*
        `param.grad`, so an optimizer's own `zero_grad` ends them as well (the
        shard's Note: why the gradient lives beside the parameter). Ends the
        accumulation: the buffer is freed and `seen` and `written` are empty.
        """
        comm, local = self.comm, self.local
        # The first reduction of a step in fp32 writes straight into the
        # gradient shard; otherwise (a later micro-batch, or a narrower reduce
        # dtype) into a temporary that is added to it.
        direct = local.grad is None and self.reduce_dtype == torch.float32
        # One rank holds the whole chunk ($S = C$): the mean over one rank is
        # the gradient itself, so the held gradients are cast straight into the
        # gradient shard. No buffer, no reduction: $p + 4$ bytes a parameter
        # move instead of $p + 4 + 8$, and $2p$ when the shard keeps the
        # parameter dtype (see the shard's Note: one rank keeps the parameter
        # dtype). Not when earlier micro-batches are accumulated in `full`
        # (`no_sync`): that buffer holds them.
        alone = direct and self.reduction.identity and self.full is None
        if local.grad is None:
            narrow = alone and local.grad_read_once
            local.new_grad(zeroed=not direct,
                           dtype=self.dtype if narrow else torch.float32)
        if alone:
            self.full = local.grad
        # What the reduce stream reads that the compute stream allocated: the
        # gradients autograd made, and `full` when it holds earlier
        # micro-batches; kept alive for it below, not `record_stream`ed (see
        # [communication](communication.html), Note: holding a tensor for a
        # side stream). What is allocated below, on the reduce stream, needs
        # nothing; `local.grad` lives until the compute stream has waited.
        read = [grad for _, grad in self.held]
        if self.full is not None and not alone:
            read.append(self.full)
        # reduce stream waits: the gradients were written on the compute stream
        comm.wait(comm.reduce_stream, comm.current_stream())
        with comm.on(comm.reduce_stream):
            # [S] reduce dtype
            reduced = local.grad if direct else torch.empty(
                self.shard_numel, dtype=self.reduce_dtype, device=comm.device)
            # The copy into the buffer, a memory-bound pass over (p + g)·C
            # bytes, runs here, beside the backward of the layers below,
            # instead of on the compute stream before it.
            self.flush(dtype=self.exact_dtype())
            if self.full is None:
                # No parameter of the chunk got a gradient; every rank must
                # still take part in the collective, so it reduces zeros.
                self.full = torch.zeros(
                    self.numel, dtype=self.reduce_dtype, device=comm.device)
            else:
                self._zero_unwritten()
            if not alone:
                with profiled("zero::reduce_scatter"):
                    self.reduction.reduce(reduced, self.full)
            if not direct:
                local.grad.add_(reduced)
        comm.hold_for_reduce(read)
        self.full = None
        self.seen.clear()
        self.written.clear()

    def exact_dtype(self) -> torch.dtype | None:
        """
        #### The dtype `reduce` allocates `full` in

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
        if (self.reduction.exact_input and narrower and self.full is None
                and len(set(positions)) == len(positions)):
            return self.dtype
        return None
