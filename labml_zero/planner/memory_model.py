r"""
---
title: Memory and communication model
summary: The bytes a rank holds, term by term as the engine holds them, and a
  step's traffic against DDP's, in elements and in bytes.
---

# Memory and communication model

This page counts bytes without allocating any. The tests compare the engine's real
tensors against it, the chunk-size search (explained in
[its page](chunk_search.html), the last of the core path) scores layouts with
it, and the benchmark prints it beside what it measures.

*Model states* are the tensors that live for the whole of training: for each of
the $\Psi_t$ trainable parameters, mixed-precision Adam keeps

* $p = 2$ bytes of half-precision parameter (bf16 or fp16), used by forward and
  backward,
* $g = 4$ bytes of gradient shard (`GRAD_BYTES`): this engine keeps it in fp32
  whatever the parameter dtype, because the ranks' gradients are averaged in
  fp32 by default and the optimizer reads fp32, so the mean is never rounded
  on its way (the ZeRO paper counts an fp16 gradient instead, $g = 2$; one
  exception here too: see Note: one rank keeps the parameter dtype),
* $K = 12$
  (tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
  bytes of optimizer state: an fp32 master copy of the parameter and Adam's two
  fp32 moments, $4 + 4 + 4$ (other [state layouts](../zero3/state_layout.html)
  keep fewer bytes).

That is $p + g + K = 18$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes per trainable parameter here; the paper's formula gives 16
(tested: tests/zero3/test_memory_model.py::test_zero_model_states_is_the_paper_formula).
Data parallelism (DDP) replicates all of it on each of the $N_d$ data-parallel
ranks. ZeRO-3 (the paper's $P_{os+g+p}$) partitions all three over them, so a
rank holds, of model states,

$$M_{\text{ZeRO-3}} = \frac{(p + g + K)\,\Psi_t + p\,\Psi_f}{N_d}$$

where $\Psi_t$ are the trainable and $\Psi_f$ the frozen parameters; a frozen
parameter has neither gradient nor optimizer state.

## What a model costs: the calculator

{{calculator}}
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

from labml_zero.zero3.chunk_layout import ChunkLayout
from labml_zero.zero3.state_layout import FP32_STATES

__all__ = [
    "PARAM_BYTES",
    "GRAD_BYTES",
    "REDUCE_BYTES",
    "OPTIMIZER_BYTES",
    "STAGING_BYTES",
    "pinned_bytes",
    "MASTER_INIT_BYTES",
    "zero_model_states",
    "layout_model_states",
    "FORWARD",
    "BACKWARD",
    "BACKWARD_EXTRA_UNITS",
    "gathered_units",
    "gathered_peak",
    "peak_window_numel",
    "ROOT_GROUP",
    "root_unit_bytes",
    "Traffic",
    "StepComm",
    "zero3_step_comm",
    "ddp_step_comm",
    "ring_wire_bytes",
]


# Bytes per element of the engine's model states, the one place of these
# numbers: the {{see: placement}}, the benchmark and the fine-tune's checks count
# with them.
# $p$: a half-precision parameter shard (bf16 or fp16).
PARAM_BYTES = 2
# $g$: the shard gradient (`LocalShard.grad`), fp32 whatever the chunk dtype:
# the optimizer reads it in fp32, and micro-batches reduced one by one add into
# it without rounding. The one exception, a gradient on one rank that only an
# update during backward reads (see Note: one rank keeps the parameter dtype),
# is not counted: the model gives the fp32 bound.
GRAD_BYTES = 4
# $g_r$: the bytes of the {{see: reduce dtype}}, the dtype of the full-size
# gradient buffers and of the reduce-scatter; fp32 is `ZeroConfig`'s default
# `reduce_dtype` (bf16 or fp16: 2).
REDUCE_BYTES = 4
# $K$ of the default state layout: AdamW's fp32 master copy and two fp32
# moments. Another layout's is `StateLayout.bytes_per_element()`, not always
# whole: 8-bit moments count each block's scale as $4/B$ bytes per element
# (a shard's partial last block holds a whole scale, a few bytes more).
OPTIMIZER_BYTES = FP32_STATES.bytes_per_element()
# the pinned fp32 staging buffer of a shard whose optimizer state is on the host
STAGING_BYTES = 4


def pinned_bytes(nbytes: int) -> int:
    r"""
    #### The host memory a page-locked buffer takes

    PyTorch serves page-locked ("pinned") host tensors from its host caching
    allocator, which rounds each block up to the next power of two so that a
    freed block fits later requests of other sizes: a staging buffer of $4S$
    bytes takes $2^{\lceil \log_2 4S \rceil}$, between once and twice its
    size
    (tested: tests/planner/test_memory_budget.py::test_pinned_staging_is_rounded_to_a_power_of_two).
    """
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
# the fp32 copy of a trainable shard's initial values, held until the first step
MASTER_INIT_BYTES = 4


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def zero_model_states(
    psi_trainable: int,
    psi_frozen: int,
    world_size: int,
    *,
    param_bytes: int = PARAM_BYTES,
    grad_bytes: int = GRAD_BYTES,
    optimizer_bytes: int = OPTIMIZER_BYTES,
) -> int:
    r"""
    ## Model states per rank, the ZeRO paper's way

    $$\frac{(p + g + K)\,\Psi_t + p\,\Psi_f}{N_d}$$

    * `psi_trainable` is $\Psi_t$ and `psi_frozen` is $\Psi_f$ (elements).
    * `world_size` is $N_d$; $N_d = 1$ gives DDP's $(p + g + K)\Psi$.
    * `param_bytes`, `grad_bytes` and `optimizer_bytes` are $p$, $g$ and $K$;
      the defaults are this engine's (bf16 parameters, an fp32 gradient shard):
      18
      (tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
      bytes per trainable parameter. `grad_bytes=2` gives the paper's count.

    Each $\Psi / N_d$ is rounded up: a rank holds whole elements, and the largest
    shard is the one that decides whether a rank runs out of memory.

    GPT-NeoX-20B, with about
    20.6 (tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
    billion parameters, needs about $370$
    (tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
    GB per rank without sharding, and $46$
    (tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
    GB per rank with ZeRO-3 over $N_d = 8$ (`zero_model_states`).
    The same counts for hybrid sharding have [their own page](hybrid_memory.html);
    a real {{see: chunk layout}}, {{see: padding}} included, is counted by
    `layout_model_states`.
    """
    _check_at_least("psi_trainable", psi_trainable, 0)
    _check_at_least("psi_frozen", psi_frozen, 0)
    _check_at_least("world_size", world_size, 1)
    _check_at_least("param_bytes", param_bytes, 1)
    _check_at_least("grad_bytes", grad_bytes, 0)
    _check_at_least("optimizer_bytes", optimizer_bytes, 0)
    per_rank_trainable = -(-psi_trainable // world_size)
    per_rank_frozen = -(-psi_frozen // world_size)
    return (
        (param_bytes + grad_bytes + optimizer_bytes) * per_rank_trainable
        + param_bytes * per_rank_frozen
    )


def layout_model_states(
    layout: ChunkLayout,
    *,
    param_bytes: int = PARAM_BYTES,
    grad_bytes: int = GRAD_BYTES,
    optimizer_bytes: int = OPTIMIZER_BYTES,
    master_aliases_param: bool = False,
) -> int:
    r"""
    ## Exact model states per rank of a chunk layout

    A chunked layout stores a little more than the paper's formula: chunks are
    padded, and padding costs what a parameter in the same chunk costs. The exact
    bytes per rank are

    $$M_{\text{layout}} = \sum_{c} \frac{C_c}{N_d}\, b_c, \qquad
    b_c = \begin{cases} p + g + K & c \text{ trainable} \\ p & c \text{ frozen}
    \end{cases}$$

    with $C_c$ the size of chunk $c$, padding included, a multiple of $N_d$. Each
    group's last chunk of a kind is trimmed to what it holds, so a group whose
    trainable part is small (bias-only fine-tuning) pays for that part only.
    The engine's gradient shard is fp32, the default `grad_bytes`.

    * `master_aliases_param`: when the parameters are fp32 ($p = 4$) the engine
      uses the parameter shard itself as the fp32 master copy instead of keeping a
      second one, so the optimizer adds $K - 4$ bytes (the two moments), not $K$.
    """
    _check_at_least("param_bytes", param_bytes, 1)
    _check_at_least("grad_bytes", grad_bytes, 0)
    _check_at_least("optimizer_bytes", optimizer_bytes, 0)
    if master_aliases_param:
        if param_bytes != 4:
            raise ValueError(
                "master_aliases_param needs fp32 parameters (param_bytes=4), "
                f"got param_bytes={param_bytes}"
            )
        if optimizer_bytes < 4:
            raise ValueError(
                "master_aliases_param needs optimizer_bytes to include a 4-byte "
                f"master copy, got optimizer_bytes={optimizer_bytes}"
            )
        optimizer_bytes -= 4
    trainable_bytes = param_bytes + grad_bytes + optimizer_bytes
    return sum(
        layout.shard_numel(c) * (trainable_bytes if c.trainable else param_bytes)
        for c in layout.chunks
    )


# ## Gathered parameters
#
# A *unit* is what the hooks gather and release together: one layer, whose
# parameters form one *group* of the layout. Before a unit runs, its chunks are
# gathered in full; the chunks of the next $D$ units (the
# {{see: prefetch depth}}, `prefetch_depth`, explained in [hooks](../zero3/hooks.html))
# are gathered ahead of time, so their all-gathers overlap the running unit's
# compute; a unit's chunks are released when it is done.
#
# During a step a rank also holds, each counted beside its code below:
#
# * the gathered chunks of $1 + D$ units ($D$ the {{see: prefetch depth}},
#   `prefetch_depth`; `gathered_peak`), and those of the root unit and the
#   held units for the whole step (`root_unit_bytes`, `gathered_peak`);
# * in backward, a chunk's gradients, held until they are copied into its
#   full-size gradient buffer, and that buffer until it is reduced, all the
#   buffers at once under gradient accumulation, in the
#   {{term: reduce dtype}} of $g_r$ bytes, the dtype gradients are
#   reduce-scattered in: counted on [their own page](grad_buffers.html).

FORWARD = "forward"
BACKWARD = "backward"

# ## Note: backward holds no extra unit
#
# In forward, a unit's post-forward hook releases it before the next unit's
# pre-forward hook gathers: $1 + D$ units are gathered at once. In backward both
# hooks wait for the same gradient, that of the tensor between the two units
# (the finished unit's input, the next unit's output). The engine releases the
# finished unit first (see Note: release before the next gather), also when a
# layer returns several tensors, so backward too holds
# $1 + D$ units and this constant is $0$; were the next unit gathered first, the
# finished one would be held beside it, one unit more. The tests count the units
# the engine really holds in each phase and assert `gathered_units`.
BACKWARD_EXTRA_UNITS = 0


def gathered_units(prefetch_depth: int, phase: str) -> int:
    r"""
    ## Units gathered at once

    $$n_{\text{fwd}} = 1 + D, \qquad n_{\text{bwd}} = 1 + D + \beta$$

    with $D$ = `prefetch_depth` and $\beta$ = `BACKWARD_EXTRA_UNITS`, which is
    $0$ (see Note: backward holds no extra unit). `phase` is `FORWARD` or `BACKWARD`.
    """
    _check_at_least("prefetch_depth", prefetch_depth, 0)
    if phase == FORWARD:
        return 1 + prefetch_depth
    if phase == BACKWARD:
        return 1 + prefetch_depth + BACKWARD_EXTRA_UNITS
    raise ValueError(f"phase must be {FORWARD!r} or {BACKWARD!r}, got {phase!r}")


def gathered_peak(
    layout: ChunkLayout, prefetch_depth: int, param_bytes: int, *, phase: str = FORWARD
) -> int:
    r"""
    ## Peak bytes of gathered chunks

    With $n$ = `gathered_units(prefetch_depth, phase)` consecutive groups gathered
    at once, beside the layout's held groups $H$, gathered for the whole step,

    $$G = p \left(\sum_{h \in H} C(\text{group}_h)
      + \max_i \sum_{j=i}^{i+n-1} C(\text{group}'_j)\right)$$

    with $C(\text{group})$ the elements of a group's chunks, $\text{group}'$
    the groups not held, in order, and $p$ = `param_bytes`. With fewer than
    $n$ groups, all of them. A held group is a layer that owns a parameter a
    later layer reads ([sharding a model](../zero3/sharded_model.html), Note: a
    parameter of two layers): its gather is not one of the $n$ (the prefetch
    finds it gathered and moves on), so it adds to every window. Backward's windows are
    the same runs of consecutive groups taken in the other order, as wide as
    forward's ($\beta = 0$), so both phases have the same peak. The root unit
    (`shard_model`'s group 0) is held for the whole step, beside every window
    (`root_unit_bytes`); this window counts it only where it is one of $n$
    consecutive groups.

    The peak assumes the engine's rule that a group is gathered and released whole;
    a schedule that releases early or gathers chunk by chunk would need its own
    count.
    """
    _check_at_least("param_bytes", param_bytes, 1)
    # `by_group` lists groups in the order of their chunks: execution order.
    sizes = [layout.group_numel(group) for group in layout.by_group
             if group not in layout.held]
    held = sum(layout.group_numel(group) for group in layout.held)
    return (held + peak_window_numel(sizes, prefetch_depth, phase=phase)) * param_bytes


def gathered_memory(layout: ChunkLayout, prefetch_depth: int, param_bytes: int) -> int:
    r"""
    ## What the gathered chunks add to a rank's memory

    $G$ of `gathered_peak`, the larger of the two phases; $0$ with one rank
    (or groups of one under hybrid sharding), whose full buffers are its shards (see
    [chunk](../zero3/chunk.html), Note: one rank gathers nothing), so its gathered
    chunks are already counted with the shards. A parameter shard that a
    placement puts in host memory (`param_on_host`, never chosen
    automatically) is gathered into a buffer of its own on one rank too; this
    counts none.
    """
    if layout.world_size == 1:
        return 0
    return max(gathered_peak(layout, prefetch_depth, param_bytes, phase=phase)
               for phase in (FORWARD, BACKWARD))


def peak_window_numel(
    group_numels: Sequence[int], prefetch_depth: int, *, phase: str = FORWARD
) -> int:
    """
    #### Largest sum of $n$ consecutive group sizes

    `group_numels` are the gathered sizes of the groups in execution order, and
    $n$ = `gathered_units(prefetch_depth, phase)`. The search calls this directly
    with sizes it computed without a full layout. A sliding window keeps it
    linear in the number of groups.
    """
    width = gathered_units(prefetch_depth, phase)
    window = sum(group_numels[:width])
    peak = window
    for i in range(width, len(group_numels)):
        window += group_numels[i] - group_numels[i - width]
        peak = max(peak, window)
    return peak


ROOT_GROUP = 0
"""`shard_model`'s group of the root unit (a `Zero3Sequential` has none)."""


def root_unit_bytes(layout: ChunkLayout, param_bytes: int = PARAM_BYTES) -> int:
    r"""
    ## The root unit, gathered for the whole step

    $$R = p \cdot C(\text{group}_0)$$

    `shard_model` puts the parameters of no wrapped layer (embeddings, a tied
    readout) in group 0, the root unit: gathered at the start of the forward
    pass and released at the end of the backward pass, so these bytes are held
    beside every window of `gathered_peak`, and belong on top of it. Only for a
    layout made by `shard_model`: a `Zero3Sequential`'s group 0 is its first
    layer, an ordinary unit.
    """
    _check_at_least("param_bytes", param_bytes, 1)
    return layout.group_numel(ROOT_GROUP) * param_bytes


class Traffic(NamedTuple):
    """
    ## Volume of one kind of collective in a step

    We count each collective by the size of the *whole* tensor it produces or
    consumes: the output of an all-gather (the gathered chunk) and the input of a
    reduce-scatter (the full-size gradient).

    * `collectives` is how many calls are made.
    * `numel` is the sum of their full tensor sizes (gathered output, or
      reduce-scatter input), in elements.
    * `nbytes` is the same in bytes of the dtype they run in.
    """

    collectives: int
    numel: int
    nbytes: int


class StepComm(NamedTuple):
    """
    ## Communication of one ZeRO-3 training step

    The three phases of a step, each counted by full tensor size (`Traffic`);
    `ring_wire_bytes` turns a size into bytes on the wire.
    """

    forward_all_gather: Traffic
    backward_all_gather: Traffic
    reduce_scatter: Traffic

    @property
    def collectives(self) -> int:
        return sum(phase.collectives for phase in self)

    @property
    def numel(self) -> int:
        return sum(phase.numel for phase in self)

    @property
    def nbytes(self) -> int:
        return sum(phase.nbytes for phase in self)


def zero3_step_comm(
    layout: ChunkLayout,
    *,
    param_bytes: int = PARAM_BYTES,
    grad_bytes: int = REDUCE_BYTES,
    backward_groups: Iterable[int] | None = None,
) -> StepComm:
    r"""
    ## Collectives of one ZeRO-3 step

    One step moves

    * a forward all-gather of every chunk: $\Psi$ elements in $p$ bytes,
    * a backward all-gather of the chunks that were released after forward and
      run a backward: at most $\Psi$ again, fewer in the engine, which keeps the
      root unit and *resident* chunks (frozen chunks that the placement keeps
      gathered, explained in [placement](placement.html)) gathered for the
      whole step, and never
      gathers again the frozen layers at the input end, where no backward runs,
    * a reduce-scatter of every trainable chunk's gradient: $\Psi_t$ in the reduce
      dtype's $g_r$ bytes,

    at most $3\Psi$ in total (padding included; frozen chunks need no
    reduce-scatter). DDP's all-reduce of the gradients counts as $2\Psi$ in the
    same units (`ddp_step_comm`).

    * `param_bytes` is $p$, the bytes of the dtype the all-gathers run in (the
      parameter dtype; bf16 by default).
    * `grad_bytes` is $g_r$, the bytes of the dtype the reduce-scatters run in
      (the reduce dtype; fp32 by default, as in the engine).
    * `backward_groups` are the groups whose chunks backward gathers again; all
      groups by default, the upper bound. The tests pass the groups the engine
      really gathers again.
    """
    _check_at_least("param_bytes", param_bytes, 1)
    _check_at_least("grad_bytes", grad_bytes, 1)
    if backward_groups is None:
        backward = list(layout.chunks)
    else:
        backward = []
        for group in backward_groups:
            if group not in layout.by_group:
                raise ValueError(
                    f"backward_groups names group {group}, which has no chunks "
                    "in the layout"
                )
            backward.extend(layout.chunks_of_group(group))
    trainable = [chunk for chunk in layout.chunks if chunk.trainable]

    def traffic(chunks, nbytes_per_element: int) -> Traffic:
        numel = sum(chunk.chunk_numel for chunk in chunks)
        return Traffic(len(chunks), numel, numel * nbytes_per_element)

    return StepComm(
        forward_all_gather=traffic(layout.chunks, param_bytes),
        backward_all_gather=traffic(backward, param_bytes),
        reduce_scatter=traffic(trainable, grad_bytes),
    )


def ddp_step_comm(psi_trainable: int, grad_bytes: int = REDUCE_BYTES) -> Traffic:
    r"""
    ## DDP's all-reduce, in the same units

    An all-reduce of $\Psi_t$ gradient elements counts as $2\Psi_t$: it *is* a
    reduce-scatter followed by an all-gather of the full tensor, which is how ring
    and NCCL's algorithms run it. `collectives` is $1$, as
    if the gradients were one flat bucket; DDP really uses buckets of a few
    megabytes (`bucket_cap_mb`), which changes the count but not the volume.
    `grad_bytes` is $g_r$, fp32's by default: DDP compared in the engine's
    reduce dtype.
    """
    _check_at_least("psi_trainable", psi_trainable, 0)
    _check_at_least("grad_bytes", grad_bytes, 1)
    return Traffic(1, 2 * psi_trainable, 2 * psi_trainable * grad_bytes)


def ring_wire_bytes(nbytes: int, world_size: int) -> int:
    r"""
    ### Bytes each rank sends for a collective of `nbytes` (full tensor size)

    A ring all-gather of a tensor of $M$ bytes makes each rank send (and receive)

    $$\frac{N_d - 1}{N_d}\,M$$

    bytes: it passes along the $N_d - 1$ shards that are not its own. A
    reduce-scatter moves the same; zero on one rank. Exact when `nbytes` is a
    multiple of $N_d$, as chunk sizes are. So per rank and step, ZeRO-3 sends at
    most $\frac{N_d - 1}{N_d}(2p\Psi + g_r\Psi_t)$ bytes and DDP
    $\frac{N_d - 1}{N_d} \cdot 2g_r\Psi_t$. In elements ($\Psi_t = \Psi$) that is
    $3\Psi$ against $2\Psi$, $1.5\times$
    (tested: tests/zero3/test_memory_model.py::test_zero3_is_three_psi_and_ddp_two_psi)
    the traffic of DDP for $\frac{1}{N_d}$ of its model states. In bytes it
    depends on the reduce dtype. At the defaults (bf16 gathers, $p = 2$; an fp32
    reduce, $g_r = 4$, for DDP's all-reduce too) both send $8\Psi$: the same bytes
    (tested: tests/zero3/test_memory_model.py::test_default_step_bytes_match_ddp).
    With a bf16 reduce ($g_r = p = 2$) it is $6\Psi$ against $4\Psi$, $1.5\times$
    in bytes as well
    (tested: tests/zero3/test_memory_model.py::test_zero3_is_three_psi_and_ddp_two_psi).

    Bytes on the wire assume ring-like algorithms; tree and NVLS algorithms move
    other amounts, and the latency of each collective is not modelled at all.
    """
    _check_at_least("nbytes", nbytes, 0)
    _check_at_least("world_size", world_size, 1)
    return nbytes * (world_size - 1) // world_size
