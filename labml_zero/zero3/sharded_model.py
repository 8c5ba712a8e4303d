r"""
---
title: Sharding a model
summary: Zero3Layer, Zero3Sequential and shard_model, the public ways into the
  engine, and how a model larger than one GPU is built without any rank holding it.
---

# Sharding a model

Three ways to put a model under ZeRO-3, all built from the same pieces (a
[layout](chunk_layout.html), [chunks](chunk.html) and the
[runtime's hooks](hooks.html)), each beside its code below:
`Zero3Layer` shards one layer and `Zero3Sequential` runs a chain of them, as in
labml-nn; `zero3_layers` builds those layers with one chunk size (the config's, or a
chooser's: [the planner's](../planner/sharding.html) passes [the
search](../planner/chunk_search.html)); `shard_model` wraps
any `nn.Module`. Either way the model has one layout, `model.layout`, with a
group per unit, and a model larger than one GPU is built without any rank
holding it (Lazy initialisation, beside `zero3_layers`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .chunk import Chunk
from .chunk_layout import ChunkLayout, plan_chunks
from .communication import Communicator
from .config import ZeroConfig
from .hooks import Zero3Runtime
from .transport import Transports
from .unit_chunks import (ChunkChooser, build_chunks, chain_layouts, chunk_numel_of,
                          move_buffers, one_chunk_per_kind, param_specs)


def set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register `param` as `module`'s parameter `name` (a dotted path)."""
    owner_name, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner_name), leaf, param)


def check_rank(rank: int, world_size: int, comm: Communicator) -> None:
    """labml-nn's `rank, world_size` must agree with the process group, which
    decides the slices each rank keeps."""
    if (rank, world_size) != (comm.rank, comm.world_size):
        raise ValueError(f"rank {rank} of world size {world_size} does not match the "
                         f"process group (rank {comm.rank} of {comm.world_size})")


def layer_config(config: ZeroConfig | None, *, dtype: torch.dtype,
                 chunk_numel: int | None) -> ZeroConfig:
    """
    #### A `Zero3Layer`'s config from its arguments and `config`

    The positional `dtype` and the keyword `chunk_numel` fill in the config;
    where the config already says something else, that is an error, not a
    silent override.
    """
    if config is None:
        return ZeroConfig(dtype=dtype, chunk_numel=chunk_numel)
    if config.dtype != dtype:
        raise ValueError(f"Zero3Layer: dtype {dtype} differs from config.dtype "
                         f"{config.dtype}")
    if chunk_numel is None or config.chunk_numel == chunk_numel:
        return config
    if config.chunk_numel is not None:
        raise ValueError(f"Zero3Layer: chunk_numel={chunk_numel} differs from "
                         f"config.chunk_numel={config.chunk_numel}")
    return replace(config, chunk_numel=chunk_numel)


class Zero3Layer(nn.Module):
    r"""
    ## A sharded layer

    labml-nn's signature, with the new capabilities as keyword arguments:

    * `module` is the layer; its parameters are sharded in place.
    * `rank`, `world_size` must match the process group (`group`, default the
      global one; with no process group, `0, 1`).
    * `device`, `dtype`: where and in which dtype the shards and gathered chunks live.
    * `chunk_numel`: the chunk size. By default the config's; if the config
      leaves it to a search (`None`), one chunk for the trainable and one for
      the frozen parameters, as labml-nn does. Given both, they must agree.
    * `config`: the other knobs (`ZeroConfig`, explained in
      [its page](config.html)); its `dtype` must be `dtype`.
    * `transports`: the [transports](transport.html) to share with other
      layers (`zero3_layers` gives all its layers one), else made from `comm`
      (or a communicator of its own) and `config`.
    * `borrowed`: `{name: parameter}` of an earlier layer that this one reads
      too (a tied readout's weight); registered on `module` under `name`, not
      laid out in this layer's chunks (see Note: a parameter of two layers).
    * `held`: this layer owns such a parameter, so its chunks stay gathered
      from its forward to the end of the backward pass.

    ### Sharding a layer

    The steps, which every way in shares, are on
    [their own page](unit_chunks.html):

    1. List its parameters in execution order as `ParamSpec`s; frozen ones
       (`requires_grad=False`) get frozen chunks.
    2. Plan the chunks for the chunk size.
    3. Build each chunk: copy this rank's slice of every parameter into the shard, and
       turn the parameters into views of the chunk's (storage-less) full buffer.
    4. Move the module's buffers to the device; parameters are already there.

    After this the module holds $\frac{1}{N_d}$ of its parameters on this rank, and
    the rest only while a hook has them gathered.
    Buffers (such as rotary tables) are not sharded: every rank keeps them whole.

    ### Memory per rank

    With $\Psi_t$ trainable and $\Psi_f$ frozen elements ({{see: padding}} included),
    parameter dtype of $p$ bytes, gradient shards of 4 bytes and
    $K$ = {{py: memory_model.OPTIMIZER_BYTES}} bytes of optimizer state (`AdamFP16`):

    $$\frac{(p + 4 + K)\,\Psi_t + p\,\Psi_f}{N_d}$$
    (tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)

    of model states, plus what a step holds beside them (counted by the
    [memory model](../planner/memory_model.html)): the gathered chunks of at most
    $1 + \text{prefetch\_depth}$ units, the root unit's and the held layers'
    for the whole step, and
    the full-size gradient buffers of the chunks being reduced; under `no_sync`
    every trainable chunk's buffer at once, about $g_r \Psi_t$ bytes, not divided
    by $N_d$.
    """

    def __init__(
        self,
        module: nn.Module,
        rank: int,
        world_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        chunk_numel: int | None = None,
        config: ZeroConfig | None = None,
        group: dist.ProcessGroup | None = None,
        comm: Communicator | None = None,
        transports: Transports | None = None,
        name_prefix: str = "",
        borrowed: dict[str, nn.Parameter] | None = None,
        held: bool = False,
    ):
        super().__init__()
        device = torch.device(device)
        config = layer_config(config, dtype=dtype, chunk_numel=chunk_numel)
        if transports is None:
            comm = comm or Communicator.for_config(device, config, group=group)
            transports = Transports.for_config(comm, config)
        elif comm is not None and comm is not transports.comm:
            raise ValueError("Zero3Layer: comm is not transports.comm")
        comm = transports.comm
        check_rank(rank, world_size, comm)
        self.module = module
        self.comm, self.transports = comm, transports
        self.config = config
        # A parameter an earlier layer owns (see Note: a parameter of two
        # layers): registered here under its name, laid out there.
        self.borrowed = dict(borrowed or {})
        for name, param in self.borrowed.items():
            set_parameter(module, name, param)
        lent = {id(p) for p in self.borrowed.values()}
        self.held = held
        specs, params = param_specs([[(n, p) for n, p in module.named_parameters()
                                      if id(p) not in lent]])
        chunk_numel = config.chunk_numel or one_chunk_per_kind(specs, config.align)
        self.layout = plan_chunks(specs, chunk_numel, world_size, align=config.align)
        self.chunks: list[Chunk] = build_chunks(
            self.layout, params, transports, config, prefixes={0: name_prefix}
        ).get(0, [])
        self._swap_in_replaced_parameters()
        move_buffers(module, device)
        # Set when the layer joins a `Zero3Sequential`; a layer used alone makes
        # its own runtime at its first forward.
        self.runtime: Zero3Runtime | None = None
        self._owns_runtime = False

    def _swap_in_replaced_parameters(self) -> None:
        """Register on the module the chunk views that replaced its meta parameters."""
        for chunk in self.chunks:
            for position, new in chunk.replaced:
                name = self.layout.params[chunk.spec.slots[position].param_index].name
                set_parameter(self.module, name, new)
        if on_meta(self.module):
            raise ValueError(
                "a meta parameter is registered twice (tied weights), which lazy "
                "initialisation does not support"
            )

    def materialize(self, init: Callable[[str, torch.Tensor], None]) -> None:
        """
        ### Initialise a layer built on the meta device, chunk by chunk

        `init(name, param)` writes a parameter's initial values in place; `name`
        is its name in the layer. See `Chunk.materialize`.
        """
        for chunk in self.chunks:
            chunk.materialize(init, names=[self.layout.params[slot.param_index].name
                                           for slot in chunk.spec.slots])

    def join(self, runtime: Zero3Runtime) -> None:
        if self.runtime is not None:
            raise ValueError("this Zero3Layer already belongs to a model")
        self.runtime = runtime
        runtime.add_unit(self.module, self.chunks, held=self.held)

    def forward(self, *args, **kwargs):
        if self.runtime is None:
            self.join(Zero3Runtime(self.comm, prefetch_depth=0))
            self._owns_runtime = True
        if not self._owns_runtime:
            return self.module(*args, **kwargs)
        self.runtime.begin_forward()
        output = self.module(*args, **kwargs)
        return self.runtime.end_forward(output)

    def get_trainable_chunk(self) -> list[nn.Parameter]:
        """The shards the optimizer updates (labml-nn's name)."""
        return [c.shard for c in self.chunks if c.trainable]

    def load_sharded(self, state: dict[str, torch.Tensor]) -> None:
        """
        ### Load the layer's weights into the shards

        `state` maps parameter names (as in `module.state_dict()`) to full
        tensors, typically on CPU; each rank copies only its slices. Every
        parameter must be present.
        """
        for chunk in self.chunks:
            for position, slot in enumerate(chunk.spec.slots):
                name = self.layout.params[slot.param_index].name
                if name not in state:
                    raise KeyError(f"no tensor for parameter {name!r} in the "
                                   "state given")
                chunk.load_param(position, state[name])


class ShardedRoot(nn.Module):
    """
    ## What a whole sharded model offers

    `Zero3Sequential` and `ShardedModel` share these; `runtime` is their
    [runtime](hooks.html), `config` their [`ZeroConfig`](config.html) and
    `layout` one {{see: chunk layout}} (explained in
    [its page](chunk_layout.html)) for the whole model, one group
    per unit, which the [memory model](../planner/memory_model.html) reads, and
    `transports` the ways its chunks are gathered and reduced, chosen once
    from the config ([transports](transport.html)).
    """

    runtime: Zero3Runtime
    config: ZeroConfig
    layout: ChunkLayout
    transports: Transports

    @property
    def chunks(self) -> list[Chunk]:
        return self.runtime.all_chunks()

    def get_trainable_chunk(self) -> list[nn.Parameter]:
        """The shards the optimizer updates (labml-nn's name)."""
        return [c.shard for c in self.chunks if c.trainable]

    def no_sync(self):
        """Accumulate gradients locally (see `Zero3Runtime.no_sync`)."""
        return self.runtime.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk in self.chunks:
            chunk.zero_grad()


class Zero3Sequential(ShardedRoot):
    """
    ## A chain of sharded layers

    `modules` run one after the other, each taking the previous one's output.
    Prefetch follows the chain. The layers share one config (as `zero3_layers`
    builds them), which decides for the chain too: `prefetch_depth`, when given,
    replaces its `prefetch_depth`. The layout is the layers' layouts chained,
    layer $i$ its group $i$ (`chain_layouts`), the held layers its `held`
    groups.
    """

    def __init__(self, modules: list[Zero3Layer], *, prefetch_depth: int | None = None):
        super().__init__()
        if not modules:
            raise ValueError("Zero3Sequential needs at least one Zero3Layer")
        self.layers = nn.ModuleList(modules)
        config = modules[0].config
        for i, layer in enumerate(modules):
            if layer.config != config:
                differ = [f for f, v in vars(config).items()
                          if getattr(layer.config, f) != v]
                raise ValueError(f"Zero3Sequential: layer {i}'s config differs "
                                 f"from layer 0's in {', '.join(differ)}")
        if prefetch_depth is not None:
            # validated by the config, the one place that checks it
            config = replace(config, prefetch_depth=prefetch_depth)
        self.config = config
        self.layout = chain_layouts([layer.layout for layer in modules],
                                    held=[i for i, layer in enumerate(modules)
                                          if layer.held])
        # the first layer's, whose communicator the runtime takes too;
        # `zero3_layers` gives every layer the same ones
        self.transports = modules[0].transports
        self.runtime = Zero3Runtime(modules[0].comm,
                                    prefetch_depth=config.prefetch_depth,
                                    reshard_after_forward=config.reshard_after_forward)
        for layer in modules:
            layer.join(self.runtime)

    def forward(self, x: Any, *last_args: Any) -> Any:
        self.runtime.begin_forward()
        recompute = self.config.activation_checkpointing and torch.is_grad_enabled()
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # the last layer also takes `last_args` (a loss head's targets)
            args = (x, *last_args) if i == last else (x,)
            # Recomputation frees what a layer saves for the time between its
            # forward and its backward, while the layers after it run. A last
            # layer given `last_args` is a loss head: its output is the loss,
            # so its backward is the first thing the backward pass runs and
            # nothing is allocated between the two. Recomputing it would lower
            # no peak and only run its forward twice (for a head that computes
            # its gradients in the forward pass, as the fused readout loss
            # does, every one of its matrix products twice).
            head = i == last and bool(last_args)
            if recompute and not head:
                x = checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        return self.runtime.end_forward(x)


def materialize_on(module: nn.Module, device: torch.device) -> None:
    """
    #### Give a meta-device layer real, initialised weights on `device`

    `to_empty` allocates the layer (uninitialised) and its own
    `reset_parameters()` initialises it; every rank must draw the same values,
    so seed the RNG identically on all ranks before sharding.
    """
    module.to_empty(device=device)
    if not hasattr(module, "reset_parameters"):
        raise ValueError(
            f"{type(module).__name__} is on the meta device and has no "
            "reset_parameters(): pass init= to initialise it"
        )
    with torch.no_grad():
        module.reset_parameters()


def on_meta(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


def zero3_layers(
    modules: Sequence[nn.Module],
    *,
    device: torch.device | str,
    config: ZeroConfig | None = None,
    group: dist.ProcessGroup | None = None,
    init: Callable[[nn.Module], None] | None = None,
    init_param: Callable[[str, torch.Tensor], None] | None = None,
    choose_chunk_numel: ChunkChooser | None = None,
) -> list[Zero3Layer]:
    """
    ## Shard a list of layers with one chunk size

    The chunk size is the config's, or `choose_chunk_numel`'s over all the
    layers' parameters together (their shapes suffice: the layers may be on the
    meta device), so the chunks of every layer have the same size. The
    [planner's `zero3_layers`](../planner/sharding.html) passes its search.

    ### Lazy initialisation

    A model larger than one GPU is built without any rank holding it: its layers
    are made on the meta device (shapes, no memory), the chunk size is chosen
    from the shapes alone, and each layer is given weights and sharded one at a
    time, or even one chunk at a time. Two ways to give them weights:

    * `init_param(name, param)`, a per-parameter initialiser: the layer is sharded
      while still on meta, then initialised **one chunk at a time** (see
      `Chunk.materialize`): a rank never holds more than one chunk beyond its
      shards. For random initialisation of large models.
    * otherwise each layer is materialised *one at a time*, just before being
      sharded: allocated on `device`, initialised (by `init(module)` if given,
      which may load pretrained weights, else by the layer's
      `reset_parameters()`), sharded, and freed before the next one: at most one
      whole layer beyond the shards.

    ### Note: a parameter of two layers

    A parameter registered in layers $i < j$ (a readout tied to the
    embedding) is laid out once, in layer $i$, its *owner*: layer $j$
    borrows it (`Zero3Layer`'s `borrowed`) and lays out only the rest, which
    may be nothing (a tied readout then has no chunks). Layer $j$ reads the
    parameter long after layer $i$'s forward, and in the backward pass before
    layer $i$'s, so the owner is *held*: gathered from its forward until the
    end of the backward pass, as `shard_model`'s root unit is; $V d$ elements
    gathered for the whole step for a tied embedding, instead of the second
    matrix of an untied model. Its gradient needs nothing more: the one
    parameter has one gradient accumulator node in the autograd graph, whose
    inputs from both uses are summed before it runs, so its gradient hook
    (4 in [the runtime](hooks.html)) fires once a backward pass, after layer
    $i$'s backward, with the sum, and the chunk is reduced once.
    """
    config = config or ZeroConfig()
    device = torch.device(device)
    comm = Communicator.for_config(device, config, group=group)
    transports = Transports.for_config(comm, config)
    # each parameter of two layers goes to its first, which is held (see
    # Note: a parameter of two layers)
    owners = parameter_owners(modules)
    held = {owner for owner, _ in owners.values()}
    # `param_specs` lays a parameter out in the first group that has it
    specs, _ = param_specs([m.named_parameters() for m in modules])
    # one chunk size for every layer, in the config each layer gets
    config = replace(config, chunk_numel=chunk_numel_of(specs, comm.world_size,
                                                        config, choose_chunk_numel))
    layers: list[Zero3Layer] = []
    for i, module in enumerate(modules):
        # names here of the parameters an earlier layer owns, and the owner's
        # parameter now (a meta one was replaced when the owner was sharded)
        lent = {name: owners[id(p)] for name, p in module.named_parameters()
                if id(p) in owners and owners[id(p)][0] != i}

        def shard(module=module, i=i, lent=lent) -> Zero3Layer:
            borrowed = {name: layers[owner].module.get_parameter(owner_name)
                        for name, (owner, owner_name) in lent.items()}
            return Zero3Layer(module, comm.rank, comm.world_size, device,
                              config.dtype, config=config,
                              transports=transports, name_prefix=f"{i}.",
                              borrowed=borrowed, held=i in held)

        if on_meta(module) and init_param is not None:
            layer = shard()
            layer.materialize(init_param)
            layers.append(layer)
            continue
        if on_meta(module):
            # A borrowed parameter gets a throwaway tensor here, replaced by
            # the owner's when the layer is sharded.
            if init is None:
                materialize_on(module, device)
            else:
                module.to_empty(device=device)
                with torch.no_grad():
                    init(module)
        layers.append(shard())
    return layers


def parameter_owners(modules: Sequence[nn.Module]) -> dict[int, tuple[int, str]]:
    """
    #### The owner of each parameter of two modules

    `{id(parameter): (index of the first module that has it, its name
    there)}`, for the parameters met in more than one of `modules`.
    """
    first: dict[int, tuple[int, str]] = {}
    shared: dict[int, tuple[int, str]] = {}
    for i, module in enumerate(modules):
        for name, param in module.named_parameters():
            owner = first.setdefault(id(param), (i, name))
            if owner[0] != i:
                shared[id(param)] = owner
    return shared


class ShardedModel(ShardedRoot):
    """
    ## Any model, with chosen submodules as units

    Built by `shard_model`. `forward` is the model's own, between the runtime's
    begin and end of forward.
    """

    def __init__(self, model: nn.Module, runtime: Zero3Runtime, layout: ChunkLayout,
                 config: ZeroConfig, transports: Transports):
        super().__init__()
        self.model, self.runtime, self.layout, self.config = (model, runtime, layout,
                                                              config)
        self.transports = transports

    def forward(self, *args, **kwargs):
        self.runtime.begin_forward()
        output = self.model(*args, **kwargs)
        return self.runtime.end_forward(output)


def shard_model(
    model: nn.Module,
    layers: Sequence[nn.Module],
    *,
    device: torch.device | str,
    config: ZeroConfig | None = None,
    group: dist.ProcessGroup | None = None,
    choose_chunk_numel: ChunkChooser | None = None,
) -> ShardedModel:
    """
    ## Shard any model

    * `layers` are the submodules that become units, in execution order (e.g.
      `model.transformer.h` of a GPT-2). Everything else is the root unit.
    * `choose_chunk_numel` picks the chunk size when the config leaves it open,
      as `zero3_layers`' does ([the planner's](../planner/sharding.html) passes
      its search).

    A parameter of two wrapped layers (or of a layer and the rest of the model)
    goes to the root unit, which stays gathered for the whole step;
    `zero3_layers`, having no root, leaves it to the first layer that has it,
    held gathered for the step (see Note: a parameter of two layers).
    """
    config = config or ZeroConfig()
    device = torch.device(device)
    comm = Communicator.for_config(device, config, group=group)
    transports = Transports.for_config(comm, config)
    qualified = {id(m): name for name, m in model.named_modules()}
    # A parameter shared by two layers, or by a layer and a module outside
    # every layer (a readout tied to a layer's matrix), goes to the root unit:
    # gathered for the whole step, it is there whoever reads it.
    owners: dict[int, set[int]] = {}
    for i, layer in enumerate(layers):
        for param in layer.parameters():
            owners.setdefault(id(param), set()).add(i)
    # every path to a module, shared ones too: `head` may be a layer's `up`
    paths = list(model.named_modules(remove_duplicate=False))
    layer_ids = {id(layer) for layer in layers}
    layer_paths = tuple(name + "." for name, m in paths if id(m) in layer_ids)
    outside = {id(p) for name, m in paths
               if id(m) not in layer_ids and not (name + ".").startswith(layer_paths)
               for p in m.parameters(recurse=False)}
    alone = {key for key, owner in owners.items()
             if len(owner) == 1 and key not in outside}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in alone]

    # Group 0 is the root; layer i is group i + 1.
    specs, params = param_specs([root, *(layer.named_parameters() for layer in layers)])
    # the chunk size chosen, in the config the model keeps (as `zero3_layers` does)
    config = replace(config, chunk_numel=chunk_numel_of(specs, comm.world_size,
                                                        config, choose_chunk_numel))
    layout = plan_chunks(specs, config.chunk_numel, comm.world_size,
                         align=config.align)
    prefixes = {i + 1: qualified[id(layer)] + "." for i, layer in enumerate(layers)}
    chunks = build_chunks(layout, params, transports, config, prefixes=prefixes)
    move_buffers(model, device)

    runtime = Zero3Runtime(comm, prefetch_depth=config.prefetch_depth,
                           reshard_after_forward=config.reshard_after_forward)
    runtime.add_unit(None, chunks.get(0, []))
    for index, layer in enumerate(layers):
        runtime.add_unit(layer, chunks.get(index + 1, []))
    return ShardedModel(model, runtime, layout, config, transports)
