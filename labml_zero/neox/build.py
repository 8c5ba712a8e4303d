r"""
---
title: Building GPT-NeoX for training
summary: The one function that builds a sharded GPT-NeoX with its optimizer, its
  fused kernels chosen for the device, used by the fine-tune job and the
  benchmark alike, so that the benchmark measures what the job runs.
---

# Building GPT-NeoX for training

The fine-tune job and the benchmark's labml_zero engine build the model through
`build_neox`, so a figure the benchmark measures is the speed of the model the
job trains. Its [fused kernels](kernels.html) are resolved for the device,
`'auto'` being

$$K(\text{device}) = \begin{cases} \text{every fusion} &
\text{on CUDA} \\ \text{none} & \text{elsewhere} \end{cases}$$

every fusion being those that match their plain twin in the tests
(tested: tests/neox/test_kernels.py::test_model_with_every_kernel_is_the_plain_model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from labml_zero.assembly import Assembled, AutoLimits, Recipe, assemble
from labml_zero.layers.float8 import check_fp8
from labml_zero.neox.kernels import ModelKernels, resolve_auto
from labml_zero.neox.model import NeoXConfig, TransformerLayer, build_layers
from labml_zero.planner.placement import ShardSpec
from labml_zero.zero3.sharded_model import Zero3Layer, Zero3Sequential

__all__ = ["AUTO", "resolve_kernels", "NeoXBuild", "build_neox"]

AUTO = "auto"
"""The kernel choice that follows the device (see the introduction)."""


def resolve_kernels(spec: str, device: torch.device | str) -> ModelKernels:
    """
    ## `'auto'`, `'none'` or fusion names, to `ModelKernels` for `device`

    An unknown name is a `ValueError` naming it (`ModelKernels.from_names`). On
    a CPU the fused functions would run as their twins anyway, so `'auto'`
    builds the plain model there. `'auto'` follows the device's type, not its
    speed: on a GPU where a fused kernel is slower than its twin (a small model
    whose step the host sets the pace of), name the kernels instead.
    `'auto,fp8'` adds the [fp8 products](../layers/float8.html), which `auto`
    never turns on (a change of precision, not a fusion with an exact twin);
    whether they can run on the device is `check_fp8`'s, before the start.
    """
    return resolve_auto(ModelKernels, spec, device)


@dataclass(frozen=True)
class NeoXBuild:
    """
    ## What model to build
    """

    model: NeoXConfig
    """The shape."""
    kernels: ModelKernels = ModelKernels()
    """The fused kernels, already resolved (`resolve_kernels`)."""
    compile: bool = False
    """Compile each transformer layer's forward ([compiled
    layers](../zero3/compiled.html)); the engine's hooks stay eager."""
    filter_layers: Sequence[int] | None = None
    """Keep only these transformer layers; `None` keeps all."""


def build_neox(build: NeoXBuild, recipe: Recipe, *, device: torch.device,
               init_param: Callable[[str, torch.Tensor], None] | None = None,
               load: Callable[[list[Zero3Layer]], None] | None = None,
               probe: Callable[[Zero3Sequential], None] | None = None,
               auto_limits: Callable[[list[ShardSpec]], AutoLimits] | None = None,
               ) -> Assembled:
    """
    ## Build on meta with the kernels, then assemble

    The layers are built on the meta device with the resolved kernels (no
    memory), then [`assemble`](../assembly.html)d: marked, sharded, compiled if
    asked, placed, given their optimizer, wired. What differs between the job
    and the benchmark (the recipe's learning rate, clipping, the initialiser,
    pretrained weights, the probe of the automatic offload) is the caller's:
    the callbacks are `assemble`'s, passed through. `recipe.compile_types` is
    set here from `build.compile`, so no caller compiles another set of layers.
    """
    check_fp8(build.kernels, device)
    layers = build_layers(build.model, filter_layers=build.filter_layers,
                          device="meta", kernels=build.kernels)
    compiled = (TransformerLayer,) if build.compile else ()
    return assemble(layers, replace(recipe, compile_types=compiled), device=device,
                    init_param=init_param, load=load, probe=probe,
                    auto_limits=auto_limits)
