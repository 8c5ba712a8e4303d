r"""
---
title: Gathering weights in fp8
summary: A chunk whose weights only fp8 products read gathers them as one-byte
  fp8 codes with one power-of-two scale for the chunk, half the bytes of a
  bf16 all-gather, and the product sees exactly the values it would have cast.
---

# Gathering weights in fp8

A weight that only an [fp8 product](../layers/float8.html) reads is cast to
fp8 by the product anyway, so it can travel in fp8: one byte an element
instead of $p$. A chunk holding such weights (the set $F$ of its elements)
all-gathers them as fp8 codes with **one scale for the whole chunk**, agreed
by one all-reduce of each rank's largest magnitude,

$$a = \max_q \max_{i \in F \cap \text{shard}_q} |w_i|, \qquad
  s = 2^{\lfloor \log_2 (m_4 / a) \rfloor}, \qquad
  \hat w_i = \operatorname{fp8}(s\, w_i) / s \quad (i \in F),$$

with $m_4$ = 448 the largest e4m3 value
(tested: tests/zero3/test_float8_gather.py::test_the_largest_e4m3_value).
Its other elements (norms, biases), which no fp8 product reads, travel
beside the codes in the chunk's own dtype, exactly. The gathered bytes fall
from $pC$ to about $C$.

## Limitations

* Not with shards in [peer memory](peer_memory.html), which the peers read
  in the parameter dtype: refused when the chunk is built, and by the
  fine-tune job before the start.
* One GPU runs none of it, so its speed is not measured here; the CPU tests
  check the gathered values, the bytes and training at several world sizes.
  The [step time](../planner/step_time.html) counts its bytes on the wire,
  not its own passes over the chunk (the amax, the cast, the decode), which
  run on the gather stream beside the computation.
"""

from __future__ import annotations

import torch
from torch import nn

from .chunk_layout import ChunkSpec
from .communication import Communicator

__all__ = ["E4M3_MAX", "mark_fp8_gathered", "fp8_gathered", "fp8_slots",
           "other_slots", "side_pieces", "gathered_bytes", "power_of_two_scale",
           "Float8Gather"]

E4M3_MAX = 448.0
"""$m_4$: the largest finite e4m3 value."""

# The mark is an attribute of the parameter, set by the model code that makes
# the weight an fp8 product's (`layers/float8.py`'s `to_float8`), read here
# when the chunk is built: the engine knows no model class.
_MARK = "_zero_fp8_gathered"


def mark_fp8_gathered(param: nn.Parameter) -> None:
    """Say that `param` is read only by an fp8 product whose scales are powers
    of two: a chunk may gather it as fp8 codes."""
    setattr(param, _MARK, True)


def fp8_gathered(param: torch.Tensor) -> bool:
    """Whether `param` was marked by `mark_fp8_gathered`."""
    return getattr(param, _MARK, False)


def fp8_slots(spec: ChunkSpec, params) -> list[tuple[int, int]]:
    """The chunk's element ranges `[start, end)` of the marked parameters, in
    `spec.slots` order (`params` in the same order)."""
    return [(slot.offset, slot.end) for slot, p in zip(spec.slots, params)
            if fp8_gathered(p)]


def other_slots(spec: ChunkSpec, params) -> list[tuple[int, int]]:
    """The element ranges of the chunk's other (unmarked) parameters."""
    return [(slot.offset, slot.end) for slot, p in zip(spec.slots, params)
            if not fp8_gathered(p)]


def side_pieces(other_ranges: list[tuple[int, int]], shard: int, n: int
                ) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The elements outside $F$ as pieces `(rank, start, end)` in the chunk,
    one per rank and parameter they share, in rank order; and how many each
    rank has."""
    pieces = [(q, max(a, q * shard), min(b, (q + 1) * shard))
              for q in range(n) for a, b in sorted(other_ranges)
              if max(a, q * shard) < min(b, (q + 1) * shard)]
    per_rank = [sum(hi - lo for r, lo, hi in pieces if r == q) for q in range(n)]
    return pieces, per_rank


def gathered_bytes(spec: ChunkSpec, params, world_size: int, itemsize: int
                   ) -> tuple[int, int]:
    r"""
    ### What one gather of a chunk moves, and what it holds meanwhile

    `(bytes, transient)`: the all-gather's full size, $N_d (S + pM)$ for a
    chunk gathered in fp8 (else $pC$), and the most its temporaries hold
    beside the full buffer while it is gathered (none for a plain gather),
    the larger of two moments of `Float8Gather.gather`:

    * making the codes: the bytes sent, $S + pM$, and the fp32 product $s w$
      of the shard, $4S$;
    * decoding: the bytes sent and received, $(N_d + 1)(S + pM)$, the
      received elements outside $F$ made contiguous, $N_d M p$, and for each
      of the $P$ of them its positions (`_positions`: at most five int64
      temporaries at once, $5 \cdot 8$ bytes) and its value, $p$.

    For [the memory budget](../planner/memory_budget.html), from a layout and
    the marked parameters, before any tensor exists.
    """
    fp8 = fp8_slots(spec, params)
    if not fp8 or world_size < 2:
        return itemsize * spec.chunk_numel, 0
    shard = spec.chunk_numel // world_size
    per_rank = side_pieces(other_slots(spec, params), shard, world_size)[1]
    send = shard + itemsize * max(per_rank)
    codes = send + 4 * shard
    decode = ((world_size + 1) * send + world_size * max(per_rank) * itemsize
              + sum(per_rank) * (5 * 8 + itemsize))
    return world_size * send, max(codes, decode)


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    r"""
    ### $s = 2^{\lfloor \log_2 (m_4 / a) \rfloor}$, on the device

    #### Why a power of two

    The product casts $\hat w$ again, at a scale $s_t$ of its own tensor, which
    [its configuration](../layers/float8.html) (`torchao_config`) rounds to a
    power of two too. A tensor's largest element is at most its chunk's, so $s_t
    \ge s$, and $s_t \hat w_i = \operatorname{fp8}(s w_i) \cdot s_t / s$ is an
    e4m3 code times a power of two, no larger than $m_4$: another e4m3 code. The
    second cast rounds nothing, and the product reads the very codes the gather
    sent. Decoding is exact as well: an e4m3 code times a power of two is a bf16
    (or fp32) number. At a scale that is not a power of two the product would
    round every weight a second time
    (tested: tests/zero3/test_float8_gather.py::test_a_products_power_of_two_cast_reads_the_gathered_codes).

    `amax` is a one-element fp32 tensor; a chunk of zeros gets $s = 1$ (every
    code is zero whatever the scale). No host synchronisation: the scale never
    leaves the device, so the gather can be queued ahead and captured in a
    CUDA graph.
    """
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / safe)))
    return torch.where(amax > 0, scale, torch.ones_like(amax))


class Float8Gather:
    r"""
    ## The gather of a chunk with fp8-gathered weights

    Built once per chunk, from the chunk's layout: which of its elements are in
    $F$ (`fp8_ranges`), how many elements a shard has ($S$), the rank and world
    size. For every rank $q$ it precomputes which elements of $q$'s shard are
    *not* in $F$ (the chunk's other elements, padding between parameters
    excluded: it is zero, exact in fp8); $M$ is the most any rank has. A
    gather then sends, from each rank, one byte buffer of $S + pM$ bytes:

    | bytes | what |
    |---|---|
    | $S$ | the shard's fp8 codes at scale $s$ (elements outside $F$ too, overwritten below) |
    | $pM$ | the shard's elements outside $F$, in the chunk's dtype, zero-padded to $M$ |

    and one all-gather brings every rank's, $N_d (S + pM)$ bytes, from which
    the full buffer is decoded: the codes times $1/s$, then the elements
    outside $F$ written back over theirs.

    ### What it changes

    * **The bytes.** Each layer's fp8 weights are gathered twice a step
      (forward, and again for the backward pass), so a step's all-gathers shrink
      by $2(p - 1)$ bytes per such weight. Pythia-1.4B over eight ranks, the
      [memory budget](../planner/memory_budget.html)'s count: {{py:
      memory_budget.budget(memory_budget.BudgetInputs(neox_model.pythia_1_4b(),
      family=families.NEOX, world_size=8)).all_gather / 2**30 | .2f}} GiB of
      all-gathers a step in bf16, {{py:
      memory_budget.budget(memory_budget.BudgetInputs(neox_model.pythia_1_4b(),
      family=families.NEOX, world_size=8,
      kernels=neox_kernels.ModelKernels.from_names('loss,rotary,norms,fp8'))
      ).all_gather / 2**30 | .2f}} GiB with its products in fp8.
    * **The values.** Each weight of $F$ is rounded once to e4m3 at its chunk's
      scale, as the product would round it at its tensor's; a tensor whose
      largest element is far below its chunk's loses digits only where its values
      fall below e4m3's normal range, octaves below its largest. The gradient
      passes through the rounding unchanged (the straight-through rule, as in
      FSDP2's fp8 all-gather) into the shard's gradient and the fp32 master.
    * **One rank.** Nothing is gathered (the chunk's full buffer is its shard),
      so each product casts its weight at its own tensor's scale.

    * `comm`: the [communicator](communication.html) (shard group, counter).
    * `fp8_ranges`: the chunk's element ranges of $F$ (`fp8_slots`).
    * `other_ranges`: those of its other parameters; what lies in neither is
      padding, zero, exact in fp8.
    * `chunk_numel`: $C = N_d S$.
    * `dtype`: the chunk's parameter dtype.
    """

    def __init__(self, comm: Communicator, fp8_ranges: list[tuple[int, int]],
                 other_ranges: list[tuple[int, int]], *, chunk_numel: int,
                 dtype: torch.dtype):
        n = comm.world_size
        if n < 2:
            raise ValueError("Float8Gather with one rank: nothing is gathered")
        self.comm = comm
        self.dtype = dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        shard = chunk_numel // n
        if shard * n != chunk_numel or shard % self.itemsize:
            raise ValueError(f"chunk of {chunk_numel} elements over {n} ranks: "
                             f"shards of {shard} bytes of codes do not align "
                             f"{dtype} values behind them")
        self.shard_numel = shard
        device = comm.device
        # The elements outside F as *pieces*, one per (rank, parameter) they
        # share, in rank order: a few per rank, kept as three short tensors
        # (an index of every element would cost 8 bytes each, for as long as
        # the chunk lives); `_positions` spreads them at each gather.
        pieces, per_rank = side_pieces(other_ranges, shard, n)
        self.side_numel = max(per_rank)  # M
        side_starts, filled = [], [0] * n
        for q, lo, hi in pieces:
            side_starts.append(q * self.side_numel + filled[q])
            filled[q] += hi - lo

        def short(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        # every rank's pieces: where each starts in the chunk and in the
        # gathered side values ([N_d, M] flattened), and its length
        self.others = (short([lo for _, lo, _ in pieces]), short(side_starts),
                       short([hi - lo for _, lo, hi in pieces]), sum(per_rank))
        # this rank's: where each starts in its shard and in its side values
        mine = [(lo - comm.rank * shard, hi - lo) for q, lo, hi in pieces
                if q == comm.rank]
        starts = [0]
        for _, length in mine[:-1]:
            starts.append(starts[-1] + length)
        self.mine = (short([lo for lo, _ in mine]), short(starts[:len(mine)]),
                     short([length for _, length in mine]), per_rank[comm.rank])
        # [K] this rank's ranges of F, as ranges of its shard, for the amax
        lo, hi = comm.rank * shard, (comm.rank + 1) * shard
        self.local_ranges = [(max(a, lo) - lo, min(b, hi) - lo)
                             for a, b in fp8_ranges if max(a, lo) < min(b, hi)]
        # bytes a rank sends: S codes, then M values in the chunk's dtype
        self.send_bytes = shard + self.itemsize * self.side_numel
        self.scale: torch.Tensor | None = None
        """The last gather's $s$ (one fp32 element on the device)."""
        self.staged = False
        """Whether the shard is in host memory (`Chunk.offload_shard`), copied
        up into this rank's slice of `full` before the codes are made."""

    @classmethod
    def for_chunk(cls, comm: Communicator, spec: ChunkSpec, params, *,
                  dtype: torch.dtype) -> "Float8Gather | None":
        """The fp8 gather of a chunk, or `None` where it has no marked
        parameter or one rank (nothing is gathered)."""
        fp8 = fp8_slots(spec, params)
        if not fp8 or comm.world_size < 2:
            return None
        return cls(comm, fp8, other_slots(spec, params),
                   chunk_numel=spec.chunk_numel, dtype=dtype)

    def gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        r"""
        ### Gather the chunk: codes and the other elements, then decode

        On the gather stream, as every transport's gather. A shard in host
        memory (`staged`) is copied up first, into this rank's slice of `full`,
        which the decode overwrites after the all-gather (as the host-staged
        gather does, on a CPU too, so the tests run this path).
        """
        n, s = self.comm.world_size, self.shard_numel
        local = shard
        if self.staged:
            local = full[self.comm.rank * s:(self.comm.rank + 1) * s]
            local.copy_(shard, non_blocking=True)
        # the chunk's amax over F: this rank's ranges, then the shard group's
        parts = [local[a:b] for a, b in self.local_ranges]
        amax = (torch.stack(torch._foreach_norm(parts, ord=float("inf"))).amax()
                .float().reshape(1) if parts
                else torch.zeros(1, dtype=torch.float32, device=full.device))
        self.comm.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        scale = power_of_two_scale(amax)
        self.scale = scale
        # [S + pM] bytes: the codes, then the elements outside F
        send = torch.empty(self.send_bytes, dtype=torch.uint8, device=full.device)
        codes = send[:s].view(torch.float8_e4m3fn)
        # [S] fp32: s w exactly (s is a power of two); elements outside F may
        # exceed the range, clamped here and overwritten after the gather
        codes.copy_(torch.mul(local, scale).clamp_(-E4M3_MAX, E4M3_MAX))
        if self.side_numel:
            side = send[s:].view(self.dtype)
            side.zero_()
            in_shard, in_side = _positions(*self.mine)
            side[in_side] = local[in_shard]
        # [N_d, S + pM] bytes: every rank's
        received = torch.empty(n, self.send_bytes, dtype=torch.uint8,
                               device=full.device)
        self.comm.all_gather(received.view(-1), send)
        # decode: exact, an e4m3 code times a power of two (see Why the scale
        # is a power of two)
        full.view(n, s).copy_(received[:, :s].view(torch.float8_e4m3fn))
        full.mul_(1 / scale)
        if self.side_numel:
            # [N_d M] every rank's elements outside F
            values = received[:, s:].contiguous().view(self.dtype).reshape(-1)
            in_chunk, in_side = _positions(*self.others)
            full[in_chunk] = values[in_side]

    def close(self) -> None:
        """Nothing to give back."""


def _positions(starts: torch.Tensor, side_starts: torch.Tensor,
               lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """
    #### The pieces' elements, one by one

    `[total]` positions in the chunk (or shard) and in the side values of
    every element of the pieces, piece after piece; `total` is known on the
    host, so no kernel waits for the device (the gather stays capturable).
    """
    # [total] which piece each element is of, and its place inside it
    piece = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device),
                                    lengths, output_size=total)
    first = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total, device=lengths.device) - first[piece]
    return starts[piece] + within, side_starts[piece] + within
