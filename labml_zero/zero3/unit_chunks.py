r"""
---
title: A model's parameters as chunks
summary: The steps every way into the engine shares, from a model's named parameters
  to its units' chunks, the chunk size chosen on the way.
---

# A model's parameters as chunks

The building blocks behind [sharding a model](sharded_model.html): `Zero3Layer`,
`zero3_layers` and `shard_model` all list the parameters of their units as
`ParamSpec`s (`param_specs`, unit $i$ its group $i$), choose one chunk size for
them (`chunk_numel_of`: the config's, or a chooser's such as [the
planner's search](../planner/sharding.html); `one_chunk_per_kind`, labml-nn's), plan the
[layout](chunk_layout.html) and turn it into [chunks](chunk.html)
(`build_chunks`). A chunk of $C$ elements holds $\frac{C}{N_d}$ of them on each
rank; the parameters become views of its full buffer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from .chunk import Chunk
from .chunk_layout import ChunkLayout, ChunkSpec, ParamSpec, round_up
from .config import ZeroConfig
from .transport import Transports

ChunkChooser = Callable[[Sequence[ParamSpec], int, ZeroConfig], int]
"""`(specs, world size, config) -> chunk size`: the policy that picks a size when
the config leaves it open (`None`)."""


def param_specs(
    groups: Sequence[Iterable[tuple[str, nn.Parameter]]],
) -> tuple[list[ParamSpec], list[nn.Parameter]]:
    """
    #### Named parameters, group by group, as layout specs

    `groups[i]` yields the parameters of unit $i$ (`module.named_parameters()`).
    A parameter met twice (tied) belongs to the group where it was met first.
    """
    seen: set[int] = set()
    specs, params = [], []
    for group, named in enumerate(groups):
        for name, param in named:
            if id(param) in seen:
                continue
            seen.add(id(param))
            specs.append(
                ParamSpec(name, tuple(param.shape), param.requires_grad, group)
            )
            params.append(param)
    return specs, params


def one_chunk_per_kind(specs: Sequence[ParamSpec], align: int) -> int:
    """labml-nn's layout: one chunk for the trainable, one for the frozen parameters."""
    totals = {True: 0, False: 0}
    for spec in specs:
        totals[spec.trainable] = round_up(totals[spec.trainable], align) + spec.numel
    return max(max(totals.values()), 1)


def chunk_numel_of(specs: Sequence[ParamSpec], world_size: int, config: ZeroConfig,
                   choose: ChunkChooser | None) -> int:
    """
    #### The chunk size: the config's, else the chooser's

    The engine takes the size; choosing one is policy, the
    [planner's](../planner/sharding.html), passed in as `choose`. With
    neither, one line says so: no silent default.
    """
    if config.chunk_numel is not None:
        return config.chunk_numel
    if choose is None:
        raise ValueError("no chunk size: set ZeroConfig(chunk_numel=...) or shard "
                         "with labml_zero.planner.sharding's shard_model or "
                         "zero3_layers, which search it")
    return choose(specs, world_size, config)


def build_chunks(
    layout: ChunkLayout,
    params: Sequence[nn.Parameter],
    transports: Transports,
    config: ZeroConfig,
    *,
    prefixes: dict[int, str] | None = None,
) -> dict[int, list[Chunk]]:
    """
    Build the chunks of a layout, grouped by unit. `prefixes[group]` turns the
    parameter names of a group into names in the whole model.
    """
    prefixes = prefixes or {}
    by_group: dict[int, list[Chunk]] = {}
    specs = layout.params
    for spec in layout.chunks:
        prefix = prefixes.get(spec.group, "")
        chunk = Chunk(spec, [params[slot.param_index] for slot in spec.slots],
                      transports, dtype=config.dtype, reduce_dtype=config.reduce_dtype,
                      names=[prefix + specs[slot.param_index].name
                             for slot in spec.slots])
        by_group.setdefault(spec.group, []).append(chunk)
    return by_group


def chain_layouts(layouts: Sequence[ChunkLayout], *,
                  held: Iterable[int] = ()) -> ChunkLayout:
    """
    #### The layouts of a chain of layers as one layout, layer $i$ its group $i$

    `held` are the layers gathered for the whole step (the layout's `held`).
    The layout `plan_chunks` gives all the layers' parameters at once, group by
    group: chunks never span groups, so planning the groups one at a time gives
    the same chunks. Its `chunk_numel` is the largest of the layers' (labml-nn's
    layers each size theirs to fit, one chunk per kind).
    """
    chunks: list[ChunkSpec] = []
    params: list[ParamSpec] = []
    by_group: dict[int, tuple[int, ...]] = {}
    for group, layout in enumerate(layouts):
        base, start = len(params), len(chunks)
        params.extend(replace(spec, group=group) for spec in layout.params)
        by_group[group] = tuple(range(start, start + len(layout.chunks)))
        chunks.extend([ChunkSpec(
            start + i, group, c.trainable,
            tuple(replace(s, param_index=s.param_index + base) for s in c.slots),
            c.chunk_numel) for i, c in enumerate(layout.chunks)])
    first = layouts[0]
    return ChunkLayout(max(layout.chunk_numel for layout in layouts),
                       first.world_size, first.align, tuple(chunks), tuple(params),
                       {g: ix for g, ix in by_group.items() if ix},
                       frozenset(held))


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers are not sharded; move them (parameters are views on `device` already)."""
    for sub in module.modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer.device != device and buffer.device.type != "meta":
                setattr(sub, name, buffer.to(device))
