r"""
---
title: Sharding with the searched chunk size
summary: The engine's shard_model and zero3_layers with the chunk size left to
  the planner's search, and the range that search is given.
---

# Sharding with the searched chunk size

The engine [takes a chunk size](../zero3/unit_chunks.html); choosing one is
policy. `shard_model` and `zero3_layers` here are [the
engine's](../zero3/sharded_model.html) with `choose_chunk_numel` passed in: a
config that leaves `chunk_numel` open (`None`) gets the size [the
search](chunk_search.html) picks over every unit's parameters at once, so all
chunks share one size $C$.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from labml_zero.planner.chunk_search import ChunkSearchConfig, search_chunk_size
from labml_zero.zero3 import sharded_model
from labml_zero.zero3.chunk_layout import ParamSpec
from labml_zero.zero3.config import ZeroConfig

__all__ = ["hidden_size", "choose_chunk_numel", "shard_model", "zero3_layers"]


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
    """
    ## The engine's chunk size, searched

    The configured chunk size, or the one [the search](chunk_search.html)
    picks over a range set from the model's own shapes.
    """
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
    # A group as large as a big vocabulary's embedding stretches the range past the
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


def shard_model(model: nn.Module, layers: Sequence[nn.Module], *,
                device: torch.device | str, config: ZeroConfig | None = None,
                group: dist.ProcessGroup | None = None) -> sharded_model.ShardedModel:
    """
    ## Shard any model, the chunk size searched

    [The engine's `shard_model`](../zero3/sharded_model.html), its size from
    `choose_chunk_numel` when the config leaves it open.
    """
    return sharded_model.shard_model(model, layers, device=device, config=config,
                                     group=group,
                                     choose_chunk_numel=choose_chunk_numel)


def zero3_layers(modules: Sequence[nn.Module], *, device: torch.device | str,
                 config: ZeroConfig | None = None,
                 group: dist.ProcessGroup | None = None,
                 init: Callable[[nn.Module], None] | None = None,
                 init_param: Callable[[str, torch.Tensor], None] | None = None,
                 ) -> list[sharded_model.Zero3Layer]:
    """
    ## Shard a list of layers, the chunk size searched

    [The engine's `zero3_layers`](../zero3/sharded_model.html), its size from
    `choose_chunk_numel` when the config leaves it open.
    """
    return sharded_model.zero3_layers(modules, device=device, config=config,
                                      group=group, init=init, init_param=init_param,
                                      choose_chunk_numel=choose_chunk_numel)
