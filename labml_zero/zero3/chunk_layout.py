r"""
---
title: Chunk layout
summary: Packing parameters, in execution order, into flat chunks of one common
  size; a group's last trainable and last frozen chunk trimmed, a parameter
  larger than that size in a chunk of its own.
---

# Chunk layout

A *chunk* is one flat buffer that holds several parameters back to back.
Sharding whole chunks instead of single tensors is the idea ColossalAI's Gemini
takes from PatrickStar: one all-gather moves a whole chunk, so the collectives are
few and large (a collective's bandwidth grows with its message size), and a rank's
share of a chunk is one contiguous slice, so the optimizer updates it with a
handful of kernels.

This page is pure arithmetic: the {{term: chunk layout}} decides *where*
every parameter lives and touches no tensor.

The layout of a Pythia-160M-shaped model on two ranks, at two chunk sizes,
computed by `plan_chunks` itself (hover a box for its parameter):

![chunk layout](figures/chunk_layout.svg)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class ParamSpec:
    """
    ## What the layout needs to know about a parameter

    * `name` is the parameter's qualified name (for error messages and checkpoints).
    * `shape` is its shape; only the number of elements matters for packing.
    * `trainable` says whether it gets gradients and optimizer state.
    * `group` is the index of the layer (the unit of gather and release) it belongs to.
      A parameter shared by two groups (tied weights) must belong to one group
      only; the wrapper that builds the specs puts it in the group it meets
      first.
    """

    name: str
    shape: tuple[int, ...]
    trainable: bool
    group: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamSlot:
    """
    ### A parameter's place in a chunk

    Elements `[offset, offset + numel)` of the chunk's flat buffer hold parameter
    number `param_index` (an index into the list of `ParamSpec`s).
    """

    param_index: int
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ChunkSpec:
    """
    ## One chunk

    * `index` is the chunk's position in the layout (execution order).
    * `group` is the layer that owns it; `trainable` its kind.
    * `slots` are the parameters it holds, by increasing offset.
    * `chunk_numel` is its size in elements, padding included, a multiple of $N_d$.
    """

    index: int
    group: int
    trainable: bool
    slots: tuple[ParamSlot, ...]
    chunk_numel: int

    @property
    def used_numel(self) -> int:
        return sum(slot.numel for slot in self.slots)

    @property
    def padding(self) -> int:
        """Space no parameter fills: every rank stores its share of it and every
        collective moves it, so the layout reports it and the
        [chunk-size search](../planner/chunk_search.html) trades it against the size of
        the gathered chunks."""
        return self.chunk_numel - self.used_numel


@dataclass(frozen=True)
class ChunkLayout:
    """
    ## A whole layout

    `chunk_numel` is the common chunk size (oversized parameters aside) and
    `world_size` is $N_d$. No tensor is touched, so the search can simulate
    thousands of layouts and the tests can check layouts by hand.
    """

    chunk_numel: int
    world_size: int
    align: int
    chunks: tuple[ChunkSpec, ...]
    # the parameters, as given to `plan_chunks`; slots index into it
    params: tuple[ParamSpec, ...] = field(compare=False, repr=False)
    # chunk indices of each group, in order; derived, so kept out of `__eq__`
    by_group: dict[int, tuple[int, ...]] = field(compare=False, repr=False)
    # groups gathered for the whole step: a layer that owns a parameter a
    # later layer reads (`zero3_layers`' tied embedding)
    held: frozenset[int] = field(default=frozenset(), compare=False)

    def chunks_of_group(self, group: int) -> list[ChunkSpec]:
        return [self.chunks[i] for i in self.by_group.get(group, ())]

    def total_numel(self, *, trainable: bool | None = None) -> int:
        """Elements stored over all ranks, padding included."""
        return sum(c.chunk_numel for c in self._select(trainable))

    def used_numel(self, *, trainable: bool | None = None) -> int:
        """Elements that hold parameters."""
        return sum(c.used_numel for c in self._select(trainable))

    def padding(self, *, trainable: bool | None = None) -> int:
        return self.total_numel(trainable=trainable) - self.used_numel(
            trainable=trainable
        )

    def shard_numel(self, chunk: ChunkSpec) -> int:
        r"""A chunk of $C$ elements is split over the $N_d$ data-parallel ranks
        into equal shards of $S = C / N_d$ elements; rank $r$ keeps elements
        $[rS, (r+1)S)$."""
        return chunk.chunk_numel // self.world_size

    def group_numel(self, group: int) -> int:
        """Elements of a group's chunks when gathered: the memory its gather costs."""
        return sum(c.chunk_numel for c in self.chunks_of_group(group))

    def _select(self, trainable: bool | None) -> list[ChunkSpec]:
        return [c for c in self.chunks if trainable is None or c.trainable == trainable]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_chunks(
    params: Sequence[ParamSpec], chunk_numel: int, world_size: int, *, align: int = 1
) -> ChunkLayout:
    r"""
    ## Pack parameters into chunks

    * `params` in execution order; their `group`s must not decrease.
    * `chunk_numel` is the wanted chunk size; it is rounded up to a multiple of
      $N_d \cdot$ `align` so that every shard has the same, aligned size.
    * `align` is the element alignment of each parameter's offset.

    Parameters are packed in the order they are given, which should be execution
    order (the order of the layers, then the order of parameters inside a layer):
    a chunk that holds the parameters used together is gathered once and used
    whole.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be at least 1, got {chunk_numel}")
    if align < 1:
        raise ValueError(f"align must be at least 1, got {align}")
    # The granule of chunk sizes: a chunk splits into $N_d$ equal shards, each a
    # multiple of `align`, so vectorised kernels see aligned views.
    unit = world_size * align
    chunk_numel = round_up(chunk_numel, unit)

    chunks: list[ChunkSpec] = []
    by_group: dict[int, list[int]] = {}

    def close(group: int, trainable: bool, slots: list[ParamSlot], size: int) -> None:
        if not slots:
            return
        by_group.setdefault(group, []).append(len(chunks))
        chunks.append(ChunkSpec(len(chunks), group, trainable, tuple(slots), size))

    # Trainable and frozen parameters go into different chunks: a trainable chunk
    # carries a gradient, an fp32 master copy and Adam moments; a frozen chunk
    # only its half-precision shard. Mixing them would give frozen parameters optimizer
    # state. So there is one open chunk per kind inside the current group:
    # `open_slots[kind]` are its parameters and `fill[kind]` its first free element.
    open_slots: dict[bool, list[ParamSlot]] = {True: [], False: []}
    fill = {True: 0, False: 0}
    current_group = None
    for index, spec in enumerate(params):
        if current_group is not None and spec.group < current_group:
            raise ValueError(
                f"parameter {spec.name!r} is in group {spec.group} after group "
                f"{current_group}: parameters must come in execution order"
            )
        if spec.group != current_group:
            # Chunks never span groups, so releasing a layer releases exactly its
            # chunks: close both open chunks of the last group. Each is the last of
            # its kind in the group and is *trimmed* to what it holds (rounded to
            # the granule); every other chunk has the one common size. Without the
            # trim a group whose trainable part is tiny (the biases of a layer, in
            # bias-only fine-tuning) would carry a whole chunk of trainable
            # padding, at the full per-element cost of a trainable parameter.
            for kind in (True, False):
                close(current_group, kind, open_slots[kind], round_up(fill[kind], unit))
                open_slots[kind], fill[kind] = [], 0
            current_group = spec.group

        kind = spec.trainable
        if spec.numel > chunk_numel:
            # An oversized parameter (a vocabulary embedding, say) gets a chunk of
            # its own, sized to fit (ColossalAI does the same); the open chunk of
            # its kind stays open for the next ones.
            size = round_up(spec.numel, unit)
            close(spec.group, kind, [ParamSlot(index, 0, spec.numel)], size)
            continue
        # Each parameter starts at a multiple of `align`; the skipped elements are
        # padding too. A parameter never straddles two chunks (it must be one view
        # into one buffer): when it does not fit in the open chunk, the chunk is
        # closed at the full size and its tail is padding.
        offset = round_up(fill[kind], align)
        if offset + spec.numel > chunk_numel:
            close(spec.group, kind, open_slots[kind], chunk_numel)
            open_slots[kind], offset = [], 0
        open_slots[kind].append(ParamSlot(index, offset, spec.numel))
        fill[kind] = offset + spec.numel

    for kind in (True, False):
        close(current_group, kind, open_slots[kind], round_up(fill[kind], unit))
    # Sort each group's chunks into execution order of their first parameter,
    # so trainable and frozen chunks interleave the way the layer uses them.
    chunks.sort(key=lambda c: (c.group, c.slots[0].param_index))
    chunks = [
        ChunkSpec(i, c.group, c.trainable, c.slots, c.chunk_numel)
        for i, c in enumerate(chunks)
    ]
    by_group = {}
    for c in chunks:
        by_group.setdefault(c.group, []).append(c.index)
    return ChunkLayout(
        chunk_numel,
        world_size,
        align,
        tuple(chunks),
        tuple(params),
        {g: tuple(ix) for g, ix in by_group.items()},
    )
