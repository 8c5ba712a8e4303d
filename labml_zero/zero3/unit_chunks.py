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
them (`choose_chunk_numel`, the config's or the
[search's](chunk_search.html); `one_chunk_per_kind`, labml-nn's), plan the
[layout](chunk_layout.html) and turn it into [chunks](chunk.html)
(`build_chunks`). A chunk of $C$ elements holds $\frac{C}{N_d}$ of them on each
rank; the parameters become views of its full buffer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

import torch
from torch import nn

from .chunk import Chunk
from .chunk_layout import ChunkLayout, ChunkSpec, ParamSpec, round_up
from .chunk_search import ChunkSearchConfig, search_chunk_size
from .config import ZeroConfig
from .transport import Transports


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


def hidden_size(specs: Sequence[ParamSpec]) -> int:
    """
    #### The model's hidden size, the step of the chunk-size search

    The most common last dimension of the matrices: in a transformer every
    projection has $d$ columns or rows, so candidate sizes in steps of $d$ line up
    with whole rows.
    """
    counts: dict[int, int] = {}
    for spec in specs:
        if len(spec.shape) >= 2:
            counts[spec.shape[-1]] = counts.get(spec.shape[-1], 0) + 1
    return max(counts, key=lambda d: (counts[d], d)) if counts else 1024


def choose_chunk_numel(
    specs: Sequence[ParamSpec], world_size: int, config: ZeroConfig
) -> int:
    """The configured chunk size, or the one the search picks."""
    if config.chunk_numel is not None:
        return config.chunk_numel
    hidden_dim = hidden_size(specs)
    # ColossalAI's default range, `ChunkSearchConfig`'s too, is
    # {{py: chunk_search.ChunkSearchConfig().search_range_m | .0f}} × $2^{20}$ elements. In
    # steps of a small model's hidden size that is hundreds of thousands of
    # candidates, most of them far beyond any layer, so it is capped at 4096 steps;
    # and it is stretched to the largest layer, so that one chunk per layer is
    # always a candidate
    # (tested: tests/zero3/test_sharded_model.py::test_the_search_range_of_the_engine).
    # A layer of Pythia-1.4B is {{py: neox_model.count_parameters(
    # neox_model.build_layers(neox_model.pythia_1_4b(), device="meta")[1:2]) / 2**20
    # | .0f}} × $2^{20}$ elements, beyond the cap at its hidden size,
    # {{py: 4096 * neox_model.pythia_1_4b().d_model / 2**20 | .0f}} × $2^{20}$.
    largest_group: dict[int, int] = {}
    for spec in specs:
        largest_group[spec.group] = largest_group.get(spec.group, 0) + spec.numel
    search_range_m = max(
        min(32.0, hidden_dim * 4096 / 2**20), max(largest_group.values()) / 2**20
    )
    # A group as large as Llama 3's embedding stretches the range past the
    # search's cap on candidates (`max_candidates`); the step then grows by
    # whole multiples of $d$, so candidates still end on whole rows
    # (tested: tests/zero3/test_sharded_model.py::test_a_huge_group_coarsens_the_steps).
    cap = ChunkSearchConfig().max_candidates
    rows_per_step = -(-(round(search_range_m * 2**20) // hidden_dim + 1) // cap)
    search = ChunkSearchConfig(
        hidden_dim=hidden_dim * rows_per_step,
        search_range_m=search_range_m,
        prefetch_depth=config.prefetch_depth,
        align=config.align,
        param_bytes=torch.tensor([], dtype=config.dtype).element_size(),
        grad_bytes=torch.tensor([], dtype=config.reduce_dtype).element_size(),
    )
    return search_chunk_size(specs, world_size, config=search).chunk_numel


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
