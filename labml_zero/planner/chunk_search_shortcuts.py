r"""
---
title: Search shortcuts
summary: Two shortcuts that keep the chunk-size search to seconds of pure Python: repeated layers are packed once, and sizes that pack as the last scored one are skipped.
---

# Search shortcuts

The [chunk-size search](chunk_search.html) scores every candidate size of its
range by planning the layout that size gives, and planning is linear in the
number of parameters. Two shortcuts make the search cheap without changing its
answer: `group_shapes` packs each
distinct layer once, and `next_packing_change` tells the search the next size
at which the packing can change. With $m$ the candidates in the range, $m'$ those
left after the skips, $L$ the groups and $U$ their distinct shapes, the search
plans

$$m' \cdot U \;\le\; m \cdot L$$

group layouts instead of every group's layout at every candidate.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from labml_zero.zero3.chunk_layout import ChunkLayout, ChunkSpec, ParamSpec, round_up


class GroupShape(NamedTuple):
    """
    #### The parameters of one group, and how many groups share their sizes

    `params` are the specs of the first group with this shape; `count` is how
    many groups have it.
    """

    params: tuple[ParamSpec, ...]
    count: int


def group_shapes(params: Sequence[ParamSpec]) -> tuple[list[GroupShape], list[int]]:
    """
    ### Distinct group shapes

    The search plans every candidate's layout, linear in the number of
    parameters; two shortcuts keep GPT-NeoX-20B (47
    (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    groups, 5462
    (tested: tests/zero3/test_chunk_search.py::test_figures_in_the_search_notes)
    candidates) to
    seconds of pure Python. This is the first: *repeated layers are packed once*.

    Returns the distinct shapes, and for each group in execution order the index
    of its shape. A shape is the sequence of (size, trainable) of its parameters:
    two groups with the same shape are packed the same way for any $c$, because a
    chunk never spans groups, so the totals are weighted by how often each shape
    repeats.
    """
    runs: list[list[ParamSpec]] = []
    for spec in params:
        if runs and runs[-1][0].group == spec.group:
            runs[-1].append(spec)
        else:
            runs.append([spec])
    index_of: dict[tuple, int] = {}
    shapes: list[GroupShape] = []
    shape_of_group: list[int] = []
    for run in runs:
        key = tuple((spec.numel, spec.trainable) for spec in run)
        if key not in index_of:
            index_of[key] = len(shapes)
            shapes.append(GroupShape(tuple(run), 0))
        i = index_of[key]
        shapes[i] = shapes[i]._replace(count=shapes[i].count + 1)
        shape_of_group.append(i)
    return shapes, shape_of_group


def is_oversized(plan: ChunkLayout, chunk: ChunkSpec) -> bool:
    """A chunk made for one parameter larger than the chunk size."""
    first = chunk.slots[0]
    oversized = plan.params[first.param_index].numel > plan.chunk_numel
    return len(chunk.slots) == 1 and oversized


def next_packing_change(plans: Sequence[ChunkLayout]) -> int | None:
    r"""
    #### The next size at which the packing can change

    The second shortcut: *sizes that pack as the last scored one did are
    skipped*. The packer decides by two comparisons with $c$ and nothing else:
    a parameter of $n$ elements is oversized while $n > c$, and it closes the
    open chunk while $o + n > c$, $o$ the aligned fill of that chunk. Each
    decision that came out true flips at its own threshold, $n$ or $o + n$,
    and those that came out false stay false for any larger $c$. Below the
    smallest threshold $t$ every decision, so every offset and every chunk's
    parameters, stays as it was; only the regular chunks (those closed by an
    overflow) grow with $c$, since trimmed chunks and oversized ones are sized
    by what they hold.

    So from the scored size up to $t$ the score cannot fall. With a regular
    chunk its padding grows with $c$ while the collectives stay and the peak and
    gradient buffer do not shrink: every larger size scores strictly worse.
    Without one (every group packed into one trimmed chunk of each kind, the
    case ColossalAI's search never reaches) the chunks are exactly the same,
    so the score is equal and the tie rule keeps the first, smaller size. Either
    way no size below $t$ can win, and the search jumps to $t$; `None` when no
    decision can flip, and no larger size can change anything. The tests check
    the jump against scoring every candidate.

    The threshold of a closing is read off the finished plan: within a group
    and kind, each regular chunk was closed by the first parameter of the next
    chunk of its kind that is not oversized.
    """
    changes: list[int] = []
    for plan in plans:
        previous: dict[tuple[int, bool], ChunkSpec] = {}
        for chunk in plan.chunks:
            first = chunk.slots[0]
            if is_oversized(plan, chunk):
                changes.append(first.numel)
                continue
            key = (chunk.group, chunk.trainable)
            closed = previous.get(key)
            if closed is not None:
                changes.append(round_up(closed.slots[-1].end, plan.align) + first.numel)
            previous[key] = chunk
    return min(changes, default=None)
