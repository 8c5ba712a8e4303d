r"""
---
title: Chunk-size search
summary: Pick the chunk size that trades padding against gathered and gradient memory.
---

# Chunk-size search

The {{see: chunk layout}} packs
parameters, in execution order, into flat *chunks* of one common size $c$ (in
elements); a chunk never spans a *group* (one layer, the unit that the hooks
gather and release), and the space a chunk holds but no parameter fills is
{{term: padding}}. This page picks $c$: like ColossalAI's Gemini
(`search_chunk_configuration`), it tries every *candidate* size in a range and
scores the layout each one gives,

$$\text{score}(c) = W + \mu \, n_{\text{collectives}} + \lambda \, (G + B)$$

of the padding $W$, the collectives $n_{\text{collectives}}$ at a price $\mu$
each, and the peak gathered $G$ and gradient buffer $B$ at a price $\lambda$ per
byte, each term beside the line of `score_candidate` that computes it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from labml_zero.zero3.chunk_layout import (
    ChunkLayout,
    ChunkSpec,
    ParamSpec,
    plan_chunks,
    round_up,
)
from labml_zero.planner.chunk_search_shortcuts import (
    GroupShape,
    group_shapes,
    next_packing_change,
)
from labml_zero.planner.grad_buffers import largest_grad_buffer
from labml_zero.planner.memory_model import peak_window_numel, zero3_step_comm

__all__ = [
    "ChunkSearchConfig",
    "CandidateScore",
    "ChunkSearchResult",
    "search_chunk_size",
]

# ColossalAI's unit for chunk sizes: "m" is $2^{20}$ elements
# (tested: tests/zero3/test_chunk_search.py::test_sizes_in_m_are_mebi_elements).
MEBI = 2**20


@dataclass(frozen=True)
class ChunkSearchConfig:
    """
    ## Search knobs

    Defaults run a tiny model on a laptop; presets for a real model set
    `hidden_dim` to its hidden size.
    """

    hidden_dim: int = 1024
    """
    Step between candidates, in elements: the model's hidden size $d$. The
    default suits no model in particular; pass the real one.
    """

    min_chunk_size_m: float = 0.0
    r"""
    Smallest candidate, $c_{\min}$, in units of `MEBI` elements. ColossalAI's default is
    larger, because it keeps a model smaller than $c_{\min}$ gathered and unsharded;
    we always shard, and with chunks confined to a layer a floor above a layer's
    size only makes every layer one giant chunk, so ours is 0.
    """

    search_range_m: float = 32.0
    r"""
    Width $R$ of the range of candidates, in units of `MEBI` elements (ColossalAI's
    default too): $\lfloor R / d \rfloor + 1$ candidates, 5462
    (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    at GPT-NeoX-20B's hidden size.
    """

    filter_exlarge_params: bool = True
    r"""
    Leave parameters above $\mu + 3\sigma$ elements out of the start size; they
    still get chunks of their own.
    """

    prefetch_depth: int = 1
    """
    Groups gathered ahead of the running one, $D$: the peak window is $D + 1$
    groups. Use the engine's value.
    """

    align: int = 1
    """
    Element alignment of each parameter's offset in its chunk. Pass the engine's
    (`ZeroConfig.align`), since the skipped elements are padding
    (`planner.sharding` does); 1 aligns nothing.
    """

    param_bytes: int = 2
    """
    Bytes per element of the parameter dtype, $p$: 2 for bf16 or fp16, 4 for fp32.
    """

    grad_bytes: int = 4
    """
    Bytes per element of the reduce dtype, $g_r$, in which a trainable chunk's
    full-size gradient buffer is kept: 4 for the engine's default fp32, 2 for a
    bf16 reduce.
    """

    memory_weight: float = 1.0
    r"""
    $\lambda$: a byte of peak memory (gathered parameters plus the largest
    gradient buffer) costs as much as $\lambda$ bytes of waste. At $1$ they count
    alike, so padding in the peak window counts twice; $0$ scores padding alone,
    which favours one giant chunk per layer (see Note: why not padding alone).
    """

    collective_bytes: int = 32 * 2**20
    r"""
    $\mu$: the fixed cost of one collective, priced in bytes of waste. Each
    collective costs the host a launch (c10d, NCCL, our hooks), and all ranks
    must meet before it moves data; over a fast link that time would move tens of
    megabytes. The default, `32 * 2**20` bytes, makes a layer one chunk unless
    that chunk would cost more in padding and memory than the collectives it
    saves (see Note: GPT-NeoX-20B). $0$ ignores the term.
    """

    max_candidates: int = 100_000
    r"""
    Refuse ranges with more candidates than this: a `hidden_dim` of 1 over a
    range as wide as the default would plan tens of millions of layouts.
    """

    def __post_init__(self) -> None:
        for name, minimum in (
            ("hidden_dim", 1),
            ("prefetch_depth", 0),
            ("align", 1),
            ("param_bytes", 1),
            ("grad_bytes", 1),
            ("collective_bytes", 0),
            ("max_candidates", 1),
        ):
            value = getattr(self, name)
            integer = isinstance(value, int) and not isinstance(value, bool)
            if not integer or value < minimum:
                raise ValueError(
                    f"{name} must be an integer >= {minimum}, got {value!r}"
                )
        if not isinstance(self.filter_exlarge_params, bool):
            raise ValueError(
                "filter_exlarge_params must be True or False, "
                f"got {self.filter_exlarge_params!r}"
            )
        for name in ("min_chunk_size_m", "search_range_m", "memory_weight"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if self.num_candidates > self.max_candidates:
            raise ValueError(
                f"search_range_m={self.search_range_m} in steps of hidden_dim="
                f"{self.hidden_dim} gives {self.num_candidates} candidates, more "
                f"than max_candidates={self.max_candidates}"
            )

    @property
    def min_chunk_size(self) -> int:
        return round(self.min_chunk_size_m * MEBI)

    @property
    def search_range(self) -> int:
        return round(self.search_range_m * MEBI)

    @property
    def num_candidates(self) -> int:
        return self.search_range // self.hidden_dim + 1


class CandidateScore(NamedTuple):
    r"""
    ## One row of the search table

    * `chunk_numel` is the candidate after rounding to the granule
      $N_d \cdot$ `align`.
    * `chunks` is the number of chunks; `collectives` the collectives of one
      training step (forward and backward all-gathers, reduce-scatters).
    * `padding` is in elements; `waste_bytes`, `peak_gathered_bytes`,
      `grad_buffer_bytes` and `score` are the terms of the objective and its value.
    """

    chunk_numel: int
    chunks: int
    collectives: int
    padding: int
    waste_bytes: int
    peak_gathered_bytes: int
    grad_buffer_bytes: int
    score: float


@dataclass(frozen=True)
class ChunkSearchResult:
    """
    ## The chosen size, its layout and the table it won

    * `layout` is the full layout for `chunk_numel`.
    * `candidates` are the rows scored, by increasing size; skipped candidates
      (equal after rounding, or packed as the last scored one is) are not in it.
    * `candidates_in_range` is how many sizes the range held.
    * `excluded` names the parameters left out of the start size.
    """

    chunk_numel: int
    layout: ChunkLayout
    padding: int
    waste_bytes: int
    peak_gathered_bytes: int
    grad_buffer_bytes: int
    collectives: int
    score: float
    candidates: tuple[CandidateScore, ...]
    candidates_in_range: int
    excluded: tuple[str, ...]


def search_chunk_size(
    params: Sequence[ParamSpec], world_size: int, *, config: ChunkSearchConfig
) -> ChunkSearchResult:
    r"""
    ## Search the chunk size

    * `params` in execution order, as for `plan_chunks`.
    * `world_size` is $N_d$, the number of ranks a chunk is sharded over.

    *Candidates* step by the hidden size $d$ (`hidden_dim`): transformer
    parameters are multiples of $d$ (a $d \times 4d$ projection, a bias of $3d$),
    so is any run of them, and steps of $d$ reach every size that a run fills
    exactly; finer steps would add sizes that only pad more. They run from $c_0$
    (`start_size`) to $c_0 + R$, $R$ = `search_range_m` $\times$ `MEBI`, which is
    ColossalAI's rule. Where we depart from ColossalAI:

    * We simulate the packer we run: chunks never span a group, trainable and
      frozen parameters never share a chunk, and each group's last chunk of a
      kind is trimmed. ColossalAI packs one stream of parameters, so its waste
      ignores the padding those boundaries cause.
    * Each candidate is rounded up to the layout's *granule* $N_d \cdot$ `align`
      (a chunk must split into $N_d$ aligned shards) *before* it is scored, so the
      score is the score of the layout used; ColossalAI rounds the winner
      afterwards. Candidates that round to the same size are scored once.
    * Excluded parameters (`excluded_params`) are still in the layout we score,
      in chunks of their own; ColossalAI leaves them out of the waste.
    * ColossalAI scores padding alone; we add the memory and collective terms.

    What the search leaves out:

    * Bandwidth enters only as the tie rule (see `search_chunk_size`) and the per-
      collective price $\mu$, one constant; overlap enters only through the size of
      the gradient buffer.
    * One common size for the regular chunks: a layer's chunks cannot each take the
      size that its parameters fill exactly. The trim fixes only each group's last
      chunk of a kind.
    """
    if not params:
        raise ValueError("params is empty: there is nothing to pack")
    # Plan the smallest candidate in full first: it raises the layout's own
    # errors (execution order, world size) before any work is done.
    excluded = excluded_params(params) if config.filter_exlarge_params else []
    start = start_size(params, excluded, config)
    plan_chunks(params, start, world_size, align=config.align)

    # Two shortcuts keep the search fast ([their page](chunk_search_shortcuts.html)):
    # repeated layers are packed once, and sizes that pack as the last scored
    # one did are skipped.
    shapes, shape_of_group = group_shapes(params)
    granule = world_size * config.align

    rows: list[CandidateScore] = []
    best: CandidateScore | None = None
    best_chunks: list[tuple[ChunkSpec, ...]] = []
    last = 0
    # Candidates (after rounding) below this size pack as the last scored one.
    skip_below = 0
    # #### Note: GPT-NeoX-20B
    #
    # A layer holds four layer-norm vectors of $d$, QKV ($3d \times d$ and $3d$), the
    # attention output ($d \times d$, $d$) and the MLP ($4d \times d$, $4d$,
    # $d \times 4d$, $d$): $12d^2 + 13d$
    # (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    # elements. The embeddings are excluded, so
    # the range starts at $c_0 = 4d^2$, the MLP weights.
    #
    # *Without the collective term* ($\mu = 0$) and with a range of
    # $R = 2^{20}$ elements
    # (tested: tests/zero3/test_chunk_search.py::test_20b_without_mu_packs_three_chunks)
    # (less than $d^2$), the giant chunk is out of reach. At $c_0$ the attention
    # output does not fit next to QKV, nor a bias next to an MLP weight: six chunks
    # per layer, $40\%$
    # (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    # of their elements padding. At $c_0 + 7d$ the layer norms, QKV
    # and the attention output weight fill the first chunk exactly, the attention
    # output bias and the first MLP half fill the second within $2d$, and the second
    # MLP half is the trimmed third chunk: three all-gathers per layer and $2d$ of
    # padding per layer. The gradient buffer does not move it: the embedding,
    # trainable and in a chunk of its own, has the largest gradient buffer of all.
    # Bias-only (three biases trainable per layer) picks $c_0 + 4d$, and each layer's
    # biases share one trimmed chunk with no padding.
    #
    # *With the engine's defaults* ([`sharding.choose_chunk_numel`](sharding.html)):
    # the range is stretched to the largest layer and each collective costs $\mu$ =
    # `collective_bytes`. Three
    # chunks instead of one cost $3 \cdot 3 - 3 = 6$ more collectives per layer per
    # step, $192$
    # (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    # MiB, against a gradient buffer and its held gradients
    # $8d^2 \cdot (4 + 2)$ bytes smaller ($1.8$
    # (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    # GB at GPT-NeoX-20B's $d$, but the embedding's buffer is larger still and sets the
    # term): one chunk per layer, $12d^2 + 13d$
    # (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    # elements, no padding, wins.
    for requested in range(start, start + config.search_range + 1, config.hidden_dim):
        chunk_numel = round_up(requested, granule)
        if chunk_numel == last or chunk_numel < skip_below:
            continue
        last = chunk_numel
        row, plans = score_candidate(
            shapes, shape_of_group, chunk_numel, world_size, config
        )
        rows.append(row)
        chunks = [plan.chunks for plan in plans]
        # The tie rule, one rule for two cases. Equal scores, different
        # layouts: the larger size wins (it usually moves the same elements in
        # fewer, larger collectives, which use the links better; ColossalAI
        # keeps the smallest). Equal scores, the same layout under another
        # size: the first, smaller size that gives it is kept, which is what
        # makes skipping sizes that pack alike exact (`next_packing_change`).
        if (
            best is None
            or row.score < best.score
            or (row.score == best.score and chunks != best_chunks)
        ):
            best, best_chunks = row, chunks
        # The same packing, so no better score, until a decision of the packer
        # flips: jump to that size.
        change = next_packing_change(plans)
        if change is None:
            break
        skip_below = change

    assert best is not None, "the range always holds its first candidate"
    layout = plan_chunks(params, best.chunk_numel, world_size, align=config.align)
    return ChunkSearchResult(
        chunk_numel=best.chunk_numel,
        layout=layout,
        padding=best.padding,
        waste_bytes=best.waste_bytes,
        peak_gathered_bytes=best.peak_gathered_bytes,
        grad_buffer_bytes=best.grad_buffer_bytes,
        collectives=best.collectives,
        score=best.score,
        candidates=tuple(rows),
        candidates_in_range=config.num_candidates,
        excluded=tuple(spec.name for spec in excluded),
    )


def excluded_params(params: Sequence[ParamSpec]) -> list[ParamSpec]:
    r"""
    ### Parameters too large to set the start size

    Those above $\bar n + 3\sigma$ elements, $\bar n$ and $\sigma$ the mean and
    the population standard deviation (as ColossalAI's `np.std`) of all parameter
    sizes: ColossalAI's `filter_exlarge_params` rule. In GPT-NeoX these are the
    two vocabulary-sized embeddings; sizing every chunk for them would make every
    candidate larger than a layer. They are still packed: the layout gives a
    parameter larger than $c$ a chunk of its own. With one parameter, or all
    alike, $\sigma = 0$ and none is above.
    """
    sizes = [spec.numel for spec in params]
    limit = statistics.fmean(sizes) + 3 * statistics.pstdev(sizes)
    return [spec for spec in params if spec.numel > limit]


def start_size(
    params: Sequence[ParamSpec],
    excluded: Sequence[ParamSpec],
    config: ChunkSearchConfig,
) -> int:
    r"""
    ### The first candidate, $c_0$

    $$c_0 = d \left\lceil \frac{\max(c_{\min}, n_{\max})}{d} \right\rceil$$

    with $c_{\min}$ = `min_chunk_size_m` $\times$ `MEBI` and $n_{\max}$ the largest
    parameter that is not excluded: a smaller chunk would leave that parameter
    oversized.
    """
    excluded_ids = {id(spec) for spec in excluded}
    largest = max(spec.numel for spec in params if id(spec) not in excluded_ids)
    smallest = max(config.min_chunk_size, largest, 1)
    return round_up(smallest, config.hidden_dim)


def score_candidate(
    shapes: Sequence[GroupShape],
    shape_of_group: Sequence[int],
    chunk_numel: int,
    world_size: int,
    config: ChunkSearchConfig,
) -> tuple[CandidateScore, list[ChunkLayout]]:
    r"""
    ### Score one candidate size

    $\text{score}(c) = W + \mu \, n_{\text{collectives}} + \lambda \, (G + B)$
    with $C_k$ the size of chunk $k$ and $u_k$ the elements of parameters in it,
    $p$ the bytes of the parameter dtype, $g_r$ those of the reduce dtype and $D$
    the prefetch depth (groups gathered ahead of the running one), and

    * the *waste* $W = p \sum_k (C_k - u_k)$, the padding in bytes;
    * $n_{\text{collectives}}$ the collectives of one training step, each at a
      fixed price $\mu$;
    * the *peak gathered* $G = p \max_i \sum_{j=i}^{i+D} C(\text{group}_j)$, the
      most parameter bytes gathered at once ($C(\text{group})$ the elements of a
      group's chunks);
    * the *gradient buffer* $B = (p + g_r) \max_{k \text{ trainable}} C_k$, the
      largest full-size gradient buffer of backward with the gradients held
      until they are copied into it;
    * $\lambda$ the price of a byte of peak memory in bytes of waste.

    Plans each distinct group shape once and adds up the totals, weighted by
    the number of groups of each shape; returns the row and the plans.

    What the score leaves out:

    * The score weighs trainable and frozen padding alike, though a trainable
      element also costs a gradient and optimizer state (sharded);
      `layout_model_states` on the result gives the exact bytes.
    * The peak terms count the window of $D + 1$ whole groups (the same in forward
      and backward: the memory model's Note: backward holds no extra unit) and *one*
      gradient buffer: not the root unit held beside every window, the other live
      buffers (all of them under `no_sync`) or the activations. A trainable
      parameter larger than every candidate (a trainable embedding) sets the
      gradient buffer alone, and then the term cannot tell candidates apart.
    """
    plans = [
        plan_chunks(shape.params, chunk_numel, world_size, align=config.align)
        for shape in shapes
    ]
    padding = sum(plan.padding() * shape.count for plan, shape in zip(plans, shapes))
    chunks = sum(len(plan.chunks) * shape.count for plan, shape in zip(plans, shapes))
    collectives = sum(
        zero3_step_comm(plan).collectives * shape.count
        for plan, shape in zip(plans, shapes)
    )
    # *Collectives*: the all-gathers (forward and backward) and reduce-scatters of
    # a step, $n_{\text{collectives}}$, which the term $\mu$ prices.
    #
    # *Peak gathered* is the memory model's `gathered_peak`: the engine gathers a
    # group's chunks whole and prefetches the next $D$, so the largest sum over
    # $D + 1$ consecutive groups is the parameter memory gathered at once in
    # forward. A group held for the whole step (`zero3_layers`' owner of a
    # tied matrix) counts here as one of the window's, not beside every
    # window as `gathered_peak` counts it: the search only ranks candidates,
    # and the held matrix is nearly the same size under all of them.
    shape_numels = [plan.total_numel() for plan in plans]
    group_numels = [shape_numels[i] for i in shape_of_group]
    peak = peak_window_numel(group_numels, config.prefetch_depth) * config.param_bytes
    # #### Note: why not padding alone
    #
    # The layout trims the last chunk of each kind in a group to what it holds, so
    # padding sits only in the *regular* chunks (of size $c$) that a parameter did
    # not fit into, and in alignment gaps. A candidate that holds a whole group packs
    # it into one trimmed chunk with no padding at all: padding alone favours one
    # giant chunk per group, as soon as the range reaches the size of a layer.
    #
    # The peak of gathered parameters does not stop that. A group is gathered whole,
    # so the peak is the window's parameters (a constant of the model) plus the
    # window's padding: it counts the padding that hurts most a second time, but a
    # giant chunk has none.
    #
    # What does grow with $c$ is the gradient buffer. A giant chunk holds the whole
    # layer's gradient at once, and its reduce-scatter waits for the layer's last
    # gradient, so none of the layer's gradient traffic overlaps the layer's
    # backward. With smaller chunks a chunk whose parameters are done (in backward,
    # the ones used last in forward) is reduced and freed while the rest of the
    # layer runs. A small case, which the tests score: layer 0 holds parameters of 2
    # and 3 elements, layer 1 one of 1, $D = 0$, $p = 2$, $g_r = 4$, $\lambda = 1$,
    # $\mu = 0$; sizes in elements, the score in bytes (`[2.]` is a chunk holding a
    # parameter of 2 and one element of padding).
    #
    # | $c$ | chunks | padding | peak | gradient buffer | score |
    # |---|---|---|---|---|---|
    # | 3 | `[2.] [3]`, `[1]` | 1 | 6 | 3 | $2 \cdot 1 + 2 \cdot 6 + 6 \cdot 3$ |
    # | 4 | `[2..] [3]`, `[1]` | 2 | 7 | 4 | $2 \cdot 2 + 2 \cdot 7 + 6 \cdot 4$ |
    # | 5 | `[2 3]`, `[1]` | 0 | 5 | 5 | $2 \cdot 0 + 2 \cdot 5 + 6 \cdot 5$ |
    #
    # The scores, $2 \cdot$ padding $+ \; 2 \cdot$ peak $+ \; (2 + 4) \cdot$
    # gradient buffer, are 32 (tested:
    # tests/zero3/test_chunk_search.py::test_the_gradient_buffer_picks_a_smaller_chunk),
    # 42 (tested:
    # tests/zero3/test_chunk_search.py::test_the_gradient_buffer_picks_a_smaller_chunk)
    # and 40 (tested:
    # tests/zero3/test_chunk_search.py::test_the_gradient_buffer_picks_a_smaller_chunk).
    # Padding alone picks $c = 5$, one chunk per layer. The score picks $c = 3$: one
    # element of padding and one more gathered, but layer 0's gradient is reduced in
    # two pieces of at most 3, the first as soon as the second parameter's gradient
    # is in. A price of $\mu = 3$ bytes per collective (9 collectives a step at
    # $c = 3$, 6 at $c = 5$) turns it back to $c = 5$. In a real model the same
    # trades set how many chunks a layer gets.
    #
    # *Gradient buffer* is [the gradient buffers'](grad_buffers.html)
    # `largest_grad_buffer`: in backward
    # each trainable chunk holds its parameters' gradients ($p$ bytes an element)
    # until all of them have arrived, copies them into a full-size buffer of
    # $C_k$ elements in the reduce dtype, and reduce-scatters and frees it. A
    # maximum, not a sum: one shape's plan stands for all its groups.
    grad_buffer = max(largest_grad_buffer(plan, config.grad_bytes, config.param_bytes)
                      for plan in plans)
    # *Waste* is the padding of all chunks in bytes. Every rank stores its share
    # of it (summed over ranks, the whole of it), every all-gather moves it and
    # every reduce-scatter reduces it. It is what ColossalAI minimizes (in
    # elements).
    waste = padding * config.param_bytes
    score = (
        waste
        + config.memory_weight * (peak + grad_buffer)
        + config.collective_bytes * collectives
    )
    row = CandidateScore(
        chunk_numel, chunks, collectives, padding, waste, peak, grad_buffer, score
    )
    return row, plans
