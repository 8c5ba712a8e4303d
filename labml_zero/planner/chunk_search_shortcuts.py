r"""
---
title: Search shortcuts
summary: Two shortcuts that keep the chunk-size search to seconds of pure Python: repeated layers are packed once, saturated candidates are skipped.
---

# Search shortcuts

The [chunk-size search](chunk_search.html) scores every candidate size of its
range by planning the layout that size gives, and planning is linear in the
number of parameters. Two shortcuts make the search cheap without changing its
answer: `group_shapes` packs each
distinct layer once, and `is_saturated` tells the search when a larger size can
no longer change the packing. With $m$ the candidates in the range, $m'$ those
left after the skips, $L$ the groups and $U$ their distinct shapes, the search
plans

$$m' \cdot U \;\le\; m \cdot L$$

group layouts instead of every group's layout at every candidate.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from labml_zero.zero3.chunk_layout import ChunkLayout, ChunkSpec, ParamSpec


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


def is_saturated(plans: Sequence[ChunkLayout]) -> bool:
    """
    #### Does every group hold at most one regular chunk of each kind?

    The second shortcut: *saturated candidates are skipped*. Once each group's
    trainable parameters, and its frozen ones, fit in one chunk (oversized
    parameters aside, in chunks of their own), a larger $c$ packs every group
    into exactly the same chunks: every parameter is placed where it was, the one
    chunk of a kind is the group's last and so trimmed to the same size, and an
    oversized parameter's chunk does not depend on $c$. Waste, peak and gradient
    buffer all stay equal, and for the same layout the tie rule keeps the first,
    smaller size that gives it, so the search
    jumps to the next size at which a parameter stops being oversized, the first
    at which the packing can change. The tests check this against scoring every
    candidate.
    """
    return all(
        sum(c.trainable == kind and not is_oversized(plan, c) for c in plan.chunks)
        <= 1
        for plan in plans
        for kind in (True, False)
    )
