r"""
---
title: Memory budget of a fine-tune
summary: Every byte a rank holds and moves for one fine-tune of any model
  family, from the memory model, the chunk layout, the family's activation
  count and the placement of the states; what the memory model page's
  calculator computes.
---

# Memory budget of a fine-tune

The [memory model](memory_model.html) counts each kind of byte alone;
this page adds them up for one fine-tune of this engine, the sum the
calculator on the memory model's page computes in the reader's browser. A
rank's device memory peaks in the last backward pass of a step, at the
loss's peak, when every activation is alive, or later, when the layers'
gradients come beside what is left of them; or at the optimizer step, when
every gradient shard is:

$$M_{\text{peak}} = \max\left(M_{\text{dev}},\;
  M_{\text{dev}} - g\,S_t + G + \max(A,\; A_g + B')\right)$$

with $A$ every activation at the loss's peak and $A_g$ what the layers keep
while their gradients $B'$ are made (the symbols are those of the budget's
parts below).

The model is asked of its [family](../family.html), given as an object: its
layers built on the meta device, its fine-tuner, its LoRA targets, its kernels
and its activation count $A$. This page imports no model package, so the same
sum sizes GPT-NeoX and Llama.

## Limitations

* A tied embedding (Llama-3.2, Qwen2.5-0.5B) is laid out once, in the
  embedding's unit, and stays gathered for the whole step; $G$ counts it
  only while its unit is in the window.
* $A$ is the family's count: GPT-NeoX's is checked tensor by tensor, Llama's
  is an estimate (its FLOPs page says what it leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from labml_zero.planner.grad_buffers import (
    accumulated_grad_buffers,
    early_update_grads,
    held_grads,
    largest_grad_buffer,
)
from labml_zero.planner.hybrid_memory import hybrid_step_comm, hybrid_wire_bytes
from labml_zero.planner.memory_model import GRAD_BYTES, gathered_memory, ring_wire_bytes
from labml_zero.planner.placement import (Placement, ShardSpec, StaticPlacement,
                                          auto_placement, device_optimizer_bytes,
                                          offload_order, offload_traffic,
                                          resident_bytes)
from labml_zero.planner.sharding import choose_chunk_numel
from labml_zero.zero3.chunk_layout import plan_chunks
from labml_zero.zero3.config import ZeroConfig
from labml_zero.zero3.float8_gather import gathered_bytes
from labml_zero.zero3.state_layout import state_layout
from labml_zero.zero3.unit_chunks import param_specs

__all__ = ["DTYPE_BYTES", "H200_BYTES", "BudgetInputs", "Budget", "budget",
           "activations_of", "example"]

# bytes per element of the dtypes the engine takes
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# An H200's memory as PyTorch sees it, `torch.cuda.get_device_properties(0)
# .total_memory`: the memory `nvidia-smi` lists less what the driver keeps. The
# engine's own capacity (`placement.cuda_capacity`) is this less the CUDA
# context, and its automatic {{see: offload}} keeps a margin besides.
H200_BYTES = 150_109_880_320


@dataclass(frozen=True)
class BudgetInputs:
    """
    ## One job

    Each field is a knob of the calculator, with the symbol of the notes.
    """

    model: Any
    """The model's shape: a config of `family` (one of its presets, or a
    snapshot's `config.json`)."""
    family: Any = field(kw_only=True, hash=False, repr=False)
    """The model's [family](../family.html) (`ModelFamily`), by keyword: its
    `build`, `finetuner`, `finetuners`, `lora_targets`, `resolve_kernels` and
    `activation_memory` are all this page asks of it."""
    world_size: int = 8
    """$N_d$, the data-parallel ranks."""
    shard_group_size: int | None = None
    """$N_s$, the ranks one copy of the model states is sharded over ([hybrid
    sharding](../zero3/hybrid.html)); `None` is all of them."""
    param_dtype: str = "bf16"
    """The chunk dtype: $p$ = 2 for `bf16`, `fp16`, 4 for `fp32`."""
    reduce_dtype: str = "fp32"
    """The dtype of the gradient buffers and the reduction, $g_r$."""
    states: str = "fp32"
    """The optimizer's [state layout](../zero3/state_layout.html), its $K$:
    `fp32` (master and moments), `bf16-moments`, `8bit-moments`, or
    `bf16-stochastic` and `bf16-kahan` (no master: an offloaded shard's host
    keeps a copy of the weight besides, `host_bytes_per_element`)."""
    finetune: str = "all"
    """What trains: one of the family's fine-tuners (`all` and `lora` in
    every family; GPT-NeoX's `biases` and `ffn`)."""
    lora_rank: int = 8
    """$r$, for `lora`."""
    lora_targets: tuple[str, ...] | None = None
    """The adapted projections, for `lora`; `None` is every one the family
    has."""
    chunk_numel: int | None = None
    """The chunk size in elements; `None` takes the search's choice."""
    prefetch_depth: int = 1
    """$D$, units gathered ahead of the running one."""
    checkpointing: bool = False
    """Activation checkpointing (recomputation) of every unit."""
    compiled: bool = False
    """The layers run under `torch.compile`: what they keep is the
    partitioner's choice, which the family's count knows for its fused kernels
    and fp8 products."""
    kernels: Any = None
    r"""The family's fused kernels (its `resolve_kernels` result); `None` is
    none (`'none'`). GPT-NeoX's chunked `loss` holds no logits, its fused
    `norms` one mean and $1/\sigma$ for both norms."""
    batch: int = 1
    """Sequences per micro-batch and rank."""
    seq: int = 2048
    """$T$, tokens per sequence."""
    micro_batches: int = 1
    """Micro-batches accumulated per step (`no_sync`)."""
    update_during_backward: bool = False
    """`AdamFP16(update_during_backward=True, free_grads=True)`, as the
    benchmark and the fine-tune job run without clipping or a loss scale:
    each shard is updated as soon as it is reduced and its gradient freed, so
    the gradient shards are never all alive and the optimizer step is no peak
    of its own."""
    offload_fraction: float | None = 0.0
    """The least fraction of the trainable elements whose optimizer state is on
    the host (the {{see: offload}}, `StaticPlacement`), whole chunks from the
    output end; `None` fits the device: the fewest chunks, largest first, that
    bring the peak under `device_bytes` (`auto_placement`)."""
    offloaded_chunks: int | None = None
    """An offload already chosen, in place of `offload_fraction`: the first
    this many chunks of `offload_order`, the count a run that chose its own
    offload reports. The fraction's chunks from the output end differ from
    these where the last chunk is a smaller one."""
    device_bytes: int = H200_BYTES
    """The device memory the peak must fit in."""

    def __post_init__(self) -> None:
        family = self.family
        if self.model is None or not isinstance(self.model, family.config_type):
            raise ValueError(f"model must be a {family.config_type.__name__} of "
                             f"the {family.name} family, got "
                             f"{type(self.model).__name__}")
        if self.finetune not in family.finetuners:
            raise ValueError(f"finetune must be one of "
                             f"{', '.join(family.finetuners)} for the "
                             f"{family.name} family, got {self.finetune!r}")
        # the family's defaults, resolved once: every target, no fused kernel
        if self.lora_targets is None:
            object.__setattr__(self, "lora_targets", tuple(family.lora_targets))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        unknown = [t for t in self.lora_targets if t not in family.lora_targets]
        if unknown:
            raise ValueError(f"lora_targets: {unknown[0]!r} is not a projection "
                             f"of the {family.name} family; expected some of "
                             f"{', '.join(family.lora_targets)}")
        if self.kernels is None:
            object.__setattr__(self, "kernels", family.resolve_kernels("none", "cpu"))
        state_layout(self.states)  # one line naming the choices
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, "
                                 f"got {getattr(self, name)!r}")
        for name, least in (("world_size", 1), ("prefetch_depth", 0), ("batch", 1),
                            ("seq", 1), ("micro_batches", 1), ("lora_rank", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, "
                                 f"got {getattr(self, name)}")
        if self.offloaded_chunks is not None and self.offloaded_chunks < 0:
            raise ValueError(f"offloaded_chunks must be >= 0, "
                             f"got {self.offloaded_chunks}")
        if self.offload_fraction is not None and not 0 <= self.offload_fraction <= 1:
            raise ValueError(f"offload_fraction must be in [0, 1], "
                             f"got {self.offload_fraction}")
        if self.seq > self.model.max_position:
            raise ValueError(f"seq {self.seq} exceeds the model's max_position "
                             f"{self.model.max_position}")

    @property
    def group_size(self) -> int:
        """The ranks a chunk is sharded over: $N_s$, else $N_d$."""
        return self.shard_group_size or self.world_size


@dataclass(frozen=True)
class Budget:
    """
    ## Bytes per rank, and per step

    Model states per rank (`params` … `optimizer_host`), the peak's other parts
    (`gathered` … `activations`), then the peak and the traffic.
    """

    psi_trainable: int
    psi_frozen: int
    chunk_numel: int
    chunks: int
    padding: int
    params: int
    r"""$p \sum_c S_c$, the parameter shards."""
    grad_shards: int
    r"""$g\,S_t$, the fp32 gradient shards."""
    optimizer_device: int
    optimizer_host: int
    """The optimizer states on the host (without a master, the weight's copy
    too), with their pinned staging buffers as the host's allocator rounds
    them (`pinned_bytes`)."""
    gathered: int
    grad_buffer: int
    r"""$B$, the largest chunk's gradient buffer beside the gradients held for it
    (`largest_grad_buffer`); on one rank with an fp32 reduction, which needs no
    buffer, the held gradients alone."""
    accumulation: int
    r"""Every trainable chunk's buffer under accumulation, $g_r \sum_k C_k$; in
    the peak one chunk's held gradients come on top."""
    early_grads: int
    """$E$, the gradients the early updates in flight hold
    (`update_during_backward`)."""
    activations: int
    """$A$, with LoRA's adapters at their rank and targets."""
    activations_beside_grads: int
    """$A_g$, the activations alive while the layers' gradients are made."""
    link_grads: int
    r"""$Q_h\,g\,S_{\max}$, the offloaded gradients waiting for the link; 0
    with nothing offloaded."""
    offloaded_fraction: float
    peak: int
    fits: bool
    """The peak is at most `device_bytes`."""
    all_gather: int
    """Full-size bytes of the step's all-gathers (forward and backward)."""
    reduce_scatter: int
    all_reduce: int
    """Bytes of the gradient shards all-reduced across shard groups."""
    wire_inside: int
    wire_across: int
    host_down: int
    host_up: int

    @property
    def device_states(self) -> int:
        return self.params + self.grad_shards + self.optimizer_device


# The layouts computed so far: a layout means building the preset's layers on
# meta and searching its chunk size, the planner and the calculator's checks
# weigh the same layout many times, and a layout is immutable. Keyed by the family's name, as a family (a table of functions and
# presets) is not hashable; past `LAYOUT_CACHE_SIZE` layouts the oldest goes.
_LAYOUTS: dict[tuple, tuple] = {}
LAYOUT_CACHE_SIZE = 256


def _layout(inputs: BudgetInputs):
    """The engine's layout: the family's fine-tuner marks its layers on meta,
    the chunk size is the config's or the search's, as `zero3_layers` does it."""
    key = (inputs.family.name, inputs.model, inputs.finetune, inputs.lora_rank,
           inputs.lora_targets, inputs.group_size, inputs.param_dtype,
           inputs.reduce_dtype, inputs.chunk_numel, inputs.prefetch_depth,
           fp8_gathers(inputs) and inputs.kernels)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= LAYOUT_CACHE_SIZE:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))  # the oldest
        _LAYOUTS[key] = _new_layout(inputs)
    return _LAYOUTS[key]


def fp8_gathers(inputs: BudgetInputs) -> bool:
    """Whether some weights are [gathered in fp8](../zero3/float8_gather.html):
    fp8 products on several ranks."""
    return bool(getattr(inputs.kernels, "fp8", False)) and inputs.group_size > 1


def _new_layout(inputs: BudgetInputs):
    family = inputs.family
    # with fp8 products the layers are built with them, whose weights are
    # marked for the fp8 gather; the layout is the same
    kernels = {"kernels": inputs.kernels} if fp8_gathers(inputs) else {}
    layers = family.build(inputs.model, device="meta", **kernels)
    options = ({"rank": inputs.lora_rank, "targets": inputs.lora_targets}
               if inputs.finetune == "lora" else {})
    counts = family.finetuner(inputs.finetune, **options)(layers)
    specs, params = param_specs([layer.named_parameters() for layer in layers])
    config = ZeroConfig(dtype=TORCH_DTYPES[inputs.param_dtype],
                        reduce_dtype=TORCH_DTYPES[inputs.reduce_dtype],
                        chunk_numel=inputs.chunk_numel,
                        prefetch_depth=inputs.prefetch_depth)
    chunk_numel = choose_chunk_numel(specs, inputs.group_size, config)
    layout = plan_chunks(specs, chunk_numel, inputs.group_size, align=config.align)
    # each chunk's gather: its bytes and its buffers' (`gathered_bytes`)
    itemsize = DTYPE_BYTES[inputs.param_dtype]
    gathers = [gathered_bytes(c, [params[s.param_index] for s in c.slots],
                              inputs.group_size, itemsize) for c in layout.chunks]
    return counts, layout, gathers


def activations_of(inputs: BudgetInputs, *, beside_gradients: bool = False) -> int:
    """$A$: the family's count, LoRA's rank and targets given where it trains
    adapters; with `beside_gradients`, $A_g$: those alive while the layers'
    gradients are made, after the loss's peak."""
    lora = ({"lora_rank": inputs.lora_rank, "lora_targets": inputs.lora_targets}
            if inputs.finetune == "lora" else {})
    return inputs.family.activation_memory(
        inputs.model, batch=inputs.batch, seq=inputs.seq, finetune=inputs.finetune,
        checkpointing=inputs.checkpointing, kernels=inputs.kernels,
        compiled=inputs.compiled, beside_gradients=beside_gradients, **lora)


# An offloaded shard's fp32 gradient stays on the device until its copy down
# has run: the copies queue on one stream behind the backward pass. Measured
# on one H100 with Pythia-6.9B at four sequences, recomputed, a third of the
# chunks offloaded: the backward pass held 1.6 GiB beyond $A_g + B' + E$,
# about two of its chunks' gradients
# (tested: tests/test_bench_predictions.py::test_an_offloaded_run_holds_gradients_on_the_link).
LINK_QUEUE_CHUNKS = 2
"""$Q_h$: the offloaded chunks whose gradients wait for the link to the host."""


def budget(inputs: BudgetInputs) -> Budget:
    r"""
    ## Every part of the budget of one job

    Each part is the function of its own page; only the sum is new.
    $M_{\text{dev}}$ is the model states on the device (the parameter shards,
    the fp32 gradient shards $g\,S_t$, the optimizer state not on the host), $G$
    the gathered chunks of the widest window (none with one rank; with
    weights [gathered in fp8](../zero3/float8_gather.html), the buffers of
    one chunk's codes beside them, `gathered_bytes`), $A$ the
    activations (LoRA's with each target's input and each adapter's $A x$) and
    $B'$ the gradient buffers with the gradients held for them: the largest
    chunk's (`largest_grad_buffer`), or under accumulation all the buffers and
    one chunk's held gradients. The gradient shards are made by the reduction,
    while the activations are being freed, so the backward term leaves them out;
    with `update_during_backward` the first term drops out and $E$, the freed
    gradients that the queued updates still hold, joins $B'$. No gradient
    exists at the loss's peak ($A$); the gradients come beside $A_g$, what
    the layers keep then (and with recomputation the layer recomputed). With
    any chunk offloaded, $Q_h$ of the largest chunk's gradients wait for the
    link beside those.

    What it leaves out: what its parts leave out (eager activations, no
    allocator fragmentation, no temporaries of the optimizer step, ring
    traffic); a root unit (the fine-tune's `Zero3Sequential` puts every
    parameter in a unit); the engine's measured probe step, which
    `offload_fraction=None` predicts from the formula instead, keeping no chunk
    resident.
    """
    if inputs.world_size % inputs.group_size:
        raise ValueError(f"shard_group_size {inputs.group_size} does not divide "
                         f"the world size {inputs.world_size}")
    p = DTYPE_BYTES[inputs.param_dtype]
    g_r = DTYPE_BYTES[inputs.reduce_dtype]
    counts, layout, gathers = _layout(inputs)
    shards = [ShardSpec(layout.shard_numel(c), c.trainable) for c in layout.chunks]
    trainable = sum(s.numel for s in shards if s.trainable)
    states = state_layout(inputs.states)
    k_device = device_optimizer_bytes(p, states)
    gathered = gathered_memory(layout, inputs.prefetch_depth, p)
    # weights gathered in fp8 ([gathering in fp8](../zero3/float8_gather.html)):
    # fewer bytes on the wire, and while a chunk is gathered its codes'
    # buffers (the chunks are gathered one after another)
    gathered += max(transient for _, transient in gathers)
    replicas = inputs.world_size // inputs.group_size
    # One rank and an fp32 reduction: the gradients are cast straight into the
    # shard, no buffer and no collective (the chunk's `reduce`).
    alone = inputs.group_size == 1 and replicas == 1 and g_r == 4
    # The held gradients are alive either way: beside the buffer they are
    # copied into, or, alone, while they are cast into the shard.
    held = held_grads(layout, p)
    buffer = largest_grad_buffer(layout, g_r, p) if not alone else held
    accumulation = (accumulated_grad_buffers(layout, g_r)
                    if inputs.micro_batches > 1 else 0)
    # The freed gradients the queued updates hold: in the parameter dtype on
    # one rank alone (the shard's Note: one rank keeps the parameter dtype).
    queued = p if alone and inputs.micro_batches == 1 else GRAD_BYTES
    early = (early_update_grads(layout, queued)
             if inputs.update_during_backward else 0)
    activations = activations_of(inputs)
    beside = activations_of(inputs, beside_gradients=True)

    # The peak less the optimizer state on the device, which offload moves.
    nothing = resident_bytes(StaticPlacement().place(shards), shards, param_bytes=p,
                             states=states)
    grads = GRAD_BYTES * trainable
    without_optimizer = nothing.device - k_device * trainable
    # the loss's peak comes before any gradient; the gradients come beside
    # the layers' activations
    with_grads = beside + max(buffer, accumulation + held) + early
    # with any chunk offloaded, the largest's (the first offloaded) gradients
    # queued for the link, beside the others
    largest = max((s.numel for s in shards if s.trainable), default=0)
    link = LINK_QUEUE_CHUNKS * GRAD_BYTES * largest
    others = [without_optimizer - grads + gathered + max(activations, with_grads + q)
              for q in (0, link)]
    if not inputs.update_during_backward:
        others = [max(without_optimizer, b) for b in others]
    other, offloading = others
    if inputs.offloaded_chunks is not None:
        placement = Placement(frozenset(offload_order(shards)[:inputs.offloaded_chunks]))
    elif inputs.offload_fraction is None and offloading <= inputs.device_bytes:
        placement = auto_placement(shards, device_capacity=inputs.device_bytes,
                                   measured_peak_other=offloading,
                                   param_bytes=p, states=states).placement
    else:
        # a fixed fraction; or, when even all of it offloaded does not fit, all
        fraction = 1.0 if inputs.offload_fraction is None else inputs.offload_fraction
        placement = StaticPlacement(fraction).place(shards)
    # a GPU rank's: its staging buffers are page-locked
    split = resident_bytes(placement, shards, param_bytes=p, states=states,
                           pinned=True)
    offloaded = sum(shards[i].numel for i in placement.optimizer_on_host)
    if not offloaded:
        link = 0
    peak = (offloading if offloaded else other) + k_device * (trainable - offloaded)
    traffic = offload_traffic(placement, shards, param_bytes=p)

    # A unit is gathered again for backward when its output needs a gradient
    # (the hooks' `expects_backward`): from the first unit that trains on.
    first = min((c.group for c in layout.chunks if c.trainable), default=None)
    backward = [g for g in layout.by_group if first is not None and g >= first]
    comm = hybrid_step_comm(layout, replicas=replicas, param_bytes=p, grad_bytes=g_r,
                            backward_groups=backward)
    inside, across = hybrid_wire_bytes(comm, inputs.group_size, replicas)
    # the all-gathers counted at p bytes an element, less what fp8 saves, once
    # forward and once more for each chunk gathered again backward
    fp8_saved = sum((p * c.chunk_numel - moved) * (1 + (c.group in backward))
                    for c, (moved, _) in zip(layout.chunks, gathers))
    inside -= ring_wire_bytes(fp8_saved, inputs.group_size)
    return Budget(
        psi_trainable=counts.trainable,
        psi_frozen=counts.total - counts.trainable,
        chunk_numel=layout.chunk_numel, chunks=len(layout.chunks),
        padding=layout.padding(),
        params=p * sum(s.numel for s in shards),
        grad_shards=grads,
        optimizer_device=k_device * (trainable - offloaded),
        optimizer_host=split.host,
        gathered=gathered, grad_buffer=buffer, accumulation=accumulation,
        early_grads=early,
        activations=activations, activations_beside_grads=beside, link_grads=link,
        offloaded_fraction=offloaded / trainable if trainable else 0.0,
        peak=peak,
        fits=peak <= inputs.device_bytes,
        # one rank: its full buffers are its shards, nothing is gathered
        all_gather=0 if inputs.group_size == 1 else (
            comm.intra.forward_all_gather.nbytes
            + comm.intra.backward_all_gather.nbytes - fp8_saved),
        reduce_scatter=0 if alone else comm.intra.reduce_scatter.nbytes,
        all_reduce=comm.inter.nbytes,
        wire_inside=inside, wire_across=across,
        host_down=traffic.down, host_up=traffic.up,
    )


def example(family, model) -> Budget:
    r"""
    ## Worked example

    The calculator's default, computed by
    `budget(BudgetInputs(model, family=family))` when the site is built:
    GPT-NeoX's Pythia-1.4B trained whole on $N_d$ =
    {{py: memory_budget.BudgetInputs(neox_model.pythia_1_4b(),
    family=families.NEOX).world_size}} ranks, bf16 chunks, an fp32 reduction, the searched chunk size ($C$ =
    {{py: memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).chunk_numel}} elements), one sequence of
    {{py: memory_budget.BudgetInputs(
    neox_model.pythia_1_4b(), family=families.NEOX).seq}} tokens a micro-batch, no
    accumulation, nothing on the host. Per rank, in GiB:

    | part | symbol | GiB |
    | --- | --- | --- |
    | parameter shards | $p \sum_k S_k$ | {{py:
    memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).params / 2**30 | .3f}} |
    | gradient shards | $g\,S_t$ | {{py:
    memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).grad_shards / 2**30 | .3f}} |
    | master and moments | $K S_t$ | {{py:
    memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).optimizer_device / 2**30 | .3f}} |
    | gathered chunks | $G$ | {{py:
    memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).gathered / 2**30 | .3f}} |
    | activations | $A$ | {{py:
    memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).activations / 2**30 | .3f}} |
    | largest gradient buffer, with its held gradients | $B$ | {{py:
    memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).grad_buffer / 2**30 | .3f}} |
    | peak | $M_{\text{peak}}$ | {{py:
    memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).peak / 2**30 | .3f}} |

    The peak is the second term, $M_{\text{dev}} - g\,S_t + G + \max(A,
    A_g + B)$: the activations of a whole sequence outweigh the gradient
    shards. A step moves
    {{py: memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).all_gather / 2**30 | .2f}} GiB of all-gathers
    and {{py: memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).reduce_scatter / 2**30 | .2f}} GiB of
    reduce-scatters (full sizes), and each rank sends
    {{py: memory_budget.example(families.NEOX,
    neox_model.pythia_1_4b()).wire_inside / 2**30 | .2f}} GiB of them.
    """
    return budget(BudgetInputs(model, family=family))


def with_inputs(inputs: BudgetInputs, **changes) -> BudgetInputs:
    """`dataclasses.replace`, for the figures the notes compute."""
    return replace(inputs, **changes)
