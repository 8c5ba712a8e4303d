r"""
---
title: An engine under test, and ours
summary: What every engine hands the benchmark (a step function and its memory model),
  and labml_zero built layer by layer so that no rank ever holds the whole model.
---

# An engine under test

The benchmark treats every engine the same way: a builder takes the process's
`DistContext` and a workload and returns an `Engine`, whose `step(batch)` runs
one whole training step (forward, loss, backward, optimizer step, zeroing the
gradients) and returns the loss. The builders differ only in how they put the
model on the GPUs and which optimizer they use; the model (GPT-NeoX layers), the
loss and the data are shared and defined here.

## The loss and the data

Random token ids, `[B, T + 1]` per rank and step, different on every rank; the
model reads the first $T$ and predicts the last $T$. The loss is the mean
cross-entropy computed in fp32 from the model's bf16 logits, the same for every
engine. On random tokens it starts near $\ln n_{vocab} \approx 10.8$.

## labml_zero, built layer by layer

GPT-NeoX-20B is 82 GB in fp32: building it on one GPU and then sharding it would
need that much free memory on every rank, and building it on the CPU takes
minutes. The build is [`assemble`](../labml_zero/assembly.html), the fine-tune's
path too, and the memory predictions count with the [memory
model](../labml_zero/planner/memory_model.html)'s byte constants. The layers are
first built on the **meta device** (shapes, no memory), the fine-tuner marks
them, the chunk size is searched over all their shapes, and then, one layer at a
time:

1. `to_empty` gives the layer fp32 storage on the GPU, `reset_parameters`
   initialises it;
2. `Zero3Layer` copies this rank's slice of each parameter into its bf16 shard
   (and, for trainable chunks, into the fp32 copy that becomes `AdamFP16`'s
   master) and turns the parameters into views of the chunk's storage-less
   buffer;
3. nothing references the fp32 storage any more, so it goes back to the caching
   allocator, which hands the same block to the next layer.

The peak during the build is one fp32 layer plus the shards built so far.

The optimizer is `AdamFP16` on the trainable shards: AdamW with fp32 master
weights and moments, gradients reduce-scattered in fp32. `--optimizer-states`
(`workload.optimizer_states`) gives it another of the fine-tune's [state
layouts](../labml_zero/zero3/state_layout.html), and the memory model counts
that layout's $K$ bytes an element where fp32 states count
{{py: state_layout.FP32_STATES.bytes_per_element()}}:

$$M = \frac{(2 + 4 + K)\,\Psi_t + 2\,\Psi_f}{N},$$

so `bf16-moments` ($K$ = {{py: state_layout.BF16_MOMENTS.bytes_per_element()}})
holds {{py: state_layout.FP32_STATES.bytes_per_element() -
state_layout.BF16_MOMENTS.bytes_per_element()}} bytes an element of
$\Psi_t/N$ less than `fp32`
(tested: tests/test_bench_states.py::test_each_choice_runs_with_its_own_k).
An offloaded chunk moves $K$ off the device and puts the layout's $K_h$
(with the weight's copy for a layout without a master) and the staging
buffer on the host ([placement](../labml_zero/planner/placement.html)).

## Offload (W5)

With `workload.offload == "auto"` (or `workload.resident`, W3R) the
optimizer is built only after a probe:
one forward and backward on a batch of its own, measured, then
[`first_step_placement`](../labml_zero/planner/placement_probe.html) puts the
optimizer states of as few chunks as needed in host memory, from the output
end. Offloaded gradients start their copy to the host as their chunk is
reduced (the runtime's `grad_ready` hook), their host update starts then too
(`update_during_backward`: the benchmark neither clips nor scales the loss),
and each rank's host Adam runs on
$\lfloor \text{cores} / N \rfloor$ threads ([launch](../labml_zero/launch/spawn.html)
sets them), so the ranks of one host do not fight over the cores. The probe is
part of the build time (`init_s`). Rank 0 prints the decision (chunks and
fraction offloaded, host-link bytes, predicted peaks) when it is made, and the
measured peaks after the timed steps; the line's `predicted_peak` is the
placement's, which counts the layout's $K$ too.

A fraction as `workload.offload` (the planner's, `bench.run --auto`) is
static: no probe, at least that share of the trainable elements' optimizer
state on the host from the output end, as the fine-tune's
`--offload-optimizer` places it; the predicted peak counts the device's share
of the model states (`device_states`).

With `workload.resident` the same decision also keeps frozen chunks gathered
in the device memory left over ([keeping chunks
resident](../labml_zero/planner/placement.html)): on W3R, GPT-NeoX-20B's frozen
weights, whole on each GPU, are gathered once, in the first step.

On CPU (the smoke test) there are no allocator statistics: the probe's "peak"
is the model states without optimizer state (the layout's shards, fp32
gradients and `master_init` copies) and the "device" holds half of the
optimizer state more, so at least half of it is offloaded and the offloaded
path runs (plus, for a resident workload, room for every frozen chunk
gathered).

## Compiled layers (`--compile`)

With `workload.compile`, each transformer layer's `forward` is compiled after
sharding, by [`compile_layers`](../labml_zero/zero3/compiled.html), which
explains why the forward and not the call (the runtime's hooks stay eager), why
one compilation serves all layers and steps, and the backends (Inductor on the
GPUs, `aot_eager` on CPU).

## Limitations

* The CPU smoke test never runs Inductor's code (see Compiled layers).
* Every rank initialises each whole layer with the same seed and keeps its
  slice: the initialisation work is not sharded, only the memory.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from labml_zero.assembly import AutoLimits, Recipe, assemble
from labml_zero.neox import build as neox_build
from labml_zero.launch import DistContext
from labml_zero.neox.finetuners import finetuner
from labml_zero.llama.config import LlamaConfig
from labml_zero.families import family_for_config
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.communication import CommCounter
from labml_zero.optimizers.graphed_step import GraphedStep
from labml_zero.planner.placement import (
    AutoPlacement,
    Placement,
    ShardSpec,
    device_optimizer_bytes,
    resident_bytes,
    shard_specs,
)
from labml_zero.planner.placement_report import measured_lines
from labml_zero.planner.grad_buffers import early_update_grads
from labml_zero.planner.memory_model import (
    GRAD_BYTES,
    MASTER_INIT_BYTES,
    PARAM_BYTES,
    gathered_memory,
    layout_model_states,
    zero_model_states,
)
from labml_zero.zero3.state_layout import state_layout

from .workloads import DECODER_LAYERS, GRAPH_WARMUP, Workload, model_layers

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01


@dataclass
class Engine:
    r"""
    ## What a builder returns

    * `step(batch)` runs one training step on `batch` `[B, T + 1]` (long) and
      returns the loss, a 0-dim tensor still on the device.
    * `memory_model`: analytic bytes per rank, by name, to print beside the
      measured peak; `memory_formula` says which formula.
    * `psi_trainable`, `psi_frozen`: parameter counts $\Psi_t$, $\Psi_f$.
    * `counter`: the engine's collective counter, if it has one (ours).
    * `uncounted_device_bytes`: device memory the engine holds outside the
      caching allocator, added to the measured peaks (our peer memory).
    * `measured_report(steps)`: with the automatic offload, the lines that put
      the measured device and host peaks after `steps` steps beside the
      predicted ones ([the placement's
      report](../labml_zero/planner/placement_report.html)).
    """

    step: Callable[[torch.Tensor], torch.Tensor]
    memory_model: dict[str, int]
    memory_formula: str
    psi_trainable: int
    psi_frozen: int
    counter: CommCounter | None = None
    info: dict = field(default_factory=dict)
    uncounted_device_bytes: int = 0
    measured_report: Callable[[int], list[str]] | None = None


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """
    Mean next-token cross-entropy in fp32 of `batch` `[B, T + 1]`: the model's
    readout computes it from the targets (a `LayerChain`'s `(ids, targets)`),
    by the workload's loss kernel.
    """
    return model(batch[:, :-1], batch[:, 1:])


def random_batches(
    workload: Workload, ctx: DistContext, *, count: int, seed: int
) -> list[torch.Tensor]:
    """`count` batches of random ids `[B, T + 1]` long, different on every rank."""
    generator = torch.Generator(device="cpu").manual_seed(seed + 1000 * ctx.rank)
    shape = (workload.batch, workload.seq + 1)
    return [
        torch.randint(0, workload.model.n_vocab, shape, generator=generator).to(
            ctx.device
        )
        for _ in range(count)
    ]


# ## The same start for every engine


class InitialWeights:
    r"""
    ## Every engine's initial weights, drawn once per layer

    Left to themselves the engines draw differently (DDP builds on the
    device, FSDP2 draws each rank's shards of a DTensor, ours a layer at a
    time), so one seed would give three models and the loss column three
    different runs. Here layer $i$ is built alone in fp32 on `device` and initialised by
    its own `reset_parameters()` inside a forked RNG seeded with
    $(\text{seed}, i)$: its values depend neither on the engine, nor on how
    it shards or casts them, nor on the layers drawn before it. Each engine
    then copies them into its own parameters, cast to their dtype. With the
    batches (`random_batches`, the same seed) the first step's loss is one
    number up to the engines' roundings
    (tested: tests/test_bench_start.py::test_engines_start_alike).

    One whole layer in fp32 is on the device at a time, beside what the
    engine holds; the last one drawn is kept for the next parameter asked.
    """

    def __init__(self, workload: Workload, *, seed: int, device: torch.device):
        # the engines' layers on meta, marked as theirs (LoRA adds adapters)
        self.layers = model_layers(workload, device="meta")
        finetuner(workload.finetune)(self.layers)
        self.seed, self.device = seed, device
        self.drawn: tuple[int, dict[str, torch.Tensor]] | None = None

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s parameters by name, fp32 on the device."""
        if self.drawn is not None and self.drawn[0] == index:
            return self.drawn[1]
        self.drawn = None  # free the last layer before drawing the next
        module = copy.deepcopy(self.layers[index]).to_empty(device=self.device)
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            # distinct for every (seed, index) below $2^{20}$ layers; a seed
            # torch chose itself may fill 64 bits, so it is folded to 43 of
            # them to keep the sum a seed `manual_seed` accepts
            torch.manual_seed((self.seed % 2**43) * 2**20 + index)
            module.reset_parameters()
        self.drawn = (index, dict(module.named_parameters()))
        return self.drawn[1]

    @torch.no_grad()
    def copy_into(self, layers: list[nn.Module]) -> None:
        """Into plain or FSDP2 layers, in the same order as `self.layers`; a
        DTensor parameter takes this rank's slice, as it shards."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for index, layer in enumerate(layers):
            values = self.layer(index)
            for name, param in layer.named_parameters():
                value = values[name]
                if isinstance(param, DTensor):
                    # each rank holds the full value: no communication
                    value = distribute_tensor(value, param.device_mesh,
                                              param.placements,
                                              src_data_rank=None).to_local()
                    param = param.to_local()
                param.copy_(value)
        self.drawn = None

    def load_sharded(self, sharded: list) -> None:
        """Into labml_zero's `Zero3Layer`s: each rank copies its slices."""
        for index, layer in enumerate(sharded):
            layer.load_sharded(self.layer(index))
        self.drawn = None


def meta_layers(workload: Workload) -> tuple[list[nn.Module], int, int]:
    r"""
    ### The model on the meta device, marked by the workload's fine-tuner

    Returns the layers, $\Psi_t$ and $\Psi_f$.
    """
    layers = model_layers(workload, device="meta")
    count = finetuner(workload.finetune)(layers)
    return layers, count.trainable, count.total - count.trainable


def zero_step(model: nn.Module, optimizer: torch.optim.Optimizer):
    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def build_labml_zero(ctx: DistContext, workload: Workload) -> Engine:
    """
    ## labml_zero: `Zero3Sequential` of `Zero3Layer`s and `AdamFP16`

    Every layer (embedding, transformer layers, final norm, readout) is a unit;
    the chunk size is searched once over all of them. The model is built by
    [`build_neox`](../labml_zero/neox/build.html), the fine-tune job's path too,
    so the figures here are the job's.
    """
    config = ZeroConfig(
        dtype=torch.bfloat16, reduce_dtype=torch.float32,
        chunk_numel=workload.chunk_numel,
        prefetch_depth=workload.prefetch_depth,
        activation_checkpointing=workload.activation_checkpointing,
        # LABML_ZERO_SIDE_STREAMS=0: collectives on the compute stream, the
        # oracle for the overlapped schedule (same losses expected, slower)
        side_streams=os.environ.get("LABML_ZERO_SIDE_STREAMS", "1") != "0",
        peer_gather=workload.peer_gather,
        peer_reduce=workload.peer_reduce,
    )
    automatic = workload.offload == "auto" or workload.resident
    recipe = Recipe(
        zero=config, finetune=finetuner(workload.finetune),
        offload_optimizer="auto" if automatic else (workload.offload or 0.0),
        resident=workload.resident, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
        # no clipping or loss scaling here, so every shard can be updated
        # during the backward pass, as soon as its chunk is reduced, and its
        # fp32 gradient freed then (fewer optimizer states to offload)
        update_during_backward=True, free_grads=True,
        states=workload.optimizer_states)
    # zero3_layers materialises, initialises and shards one layer at a time
    # (steps 1 to 3 above), with one chunk size searched over all of them.
    # the run's seed, which `bench.run` set just before building
    weights = InitialWeights(workload, seed=torch.initial_seed(),
                             device=ctx.device)
    callbacks = dict(load=weights.load_sharded, probe=probe_step(ctx, workload),
                     auto_limits=None if ctx.device.type == "cuda"
                     else simulated_limits(ctx, workload))
    if isinstance(workload.model, LlamaConfig):
        # `build_neox`'s steps for Llama's layers: on meta with the kernels,
        # then the same assembly, the decoder layers compiled if asked
        compiled = DECODER_LAYERS if workload.compile else ()
        built = assemble(model_layers(workload, device="meta"),
                         replace(recipe, compile_types=compiled),
                         device=ctx.device, **callbacks)
    else:
        build = neox_build.NeoXBuild(workload.model, kernels=workload.kernels,
                                     compile=workload.compile)
        built = neox_build.build_neox(build, recipe, device=ctx.device,
                                      **callbacks)
    model = built.model
    psi_t = built.counts.trainable
    psi_f = built.counts.total - psi_t
    # the layout the optimizer was built with, and its $K_d$, its bytes an
    # element on the device (a bf16 shard is never its own master: all of $K$)
    states = built.optimizer.layout
    k = device_optimizer_bytes(PARAM_BYTES, states)
    sizes = dict(param_bytes=PARAM_BYTES, grad_bytes=GRAD_BYTES,
                 optimizer_bytes=k)
    # the model's one layout, a group per layer: a group is a unit
    layout = model.layout
    model_states = layout_model_states(layout, **sizes)
    memory = {
        "zero_states": zero_model_states(psi_t, psi_f, ctx.world_size, **sizes),
        "layout_states": model_states,
        # the fp32 shard gradients exist from their reduce-scatter to zero_grad
        # (to their early update with free_grads): at most all of them at once
        "shard_grads": model_states - layout_model_states(
            layout, **{**sizes, "grad_bytes": 0}),
        "gathered_peak": gathered_memory(layout, config.prefetch_depth, PARAM_BYTES),
        # the freed gradients the queued early updates hold: bf16 on one rank
        # (the shard's Note: one rank keeps the parameter dtype)
        "early_update_grads": early_update_grads(
            layout, PARAM_BYTES if ctx.world_size == 1 else GRAD_BYTES),
    }
    info = {"chunk_numel": layout.chunk_numel,
            "chunks": len(model.chunks)}
    if getattr(workload.kernels, "fp8", False):
        # how many linears the per-linear choice ran in fp8 (none on a
        # small model): the line says which setting it measured
        info["float8_linears"] = sum(type(m).__name__ == "Float8Linear"
                                     for m in model.modules())
    measured = None
    shards = shard_specs(model)
    if built.placement is not None:
        # the model states a placement leaves on the device and puts on the
        # host: $K_d$ moved off the device, $K_h$ and the staging buffer on
        # the host, for each offloaded element (pinned beside a GPU)
        split = resident_bytes(built.placement, shards, states=states,
                               pinned=ctx.device.type == "cuda")
        memory["device_states"], memory["host_states"] = split.device, split.host
    memory.update(predicted_peak(workload, memory))
    if built.decided is not None:
        report_placement(built.decided, shards, info)
        # One source of truth: the placement's prediction stands on a measured
        # probe, which the analytic formula cannot match once states are on
        # the host (its activations and gathered buffers are estimates).
        memory["predicted_peak"] = built.decided.predicted_peak
        decided = built.decided

        def measured(steps: int) -> list[str]:
            return measured_lines(decided, shards, device=ctx.device, steps=steps)

    # peer memory's device bytes that the allocator's peaks may miss
    peers = model.transports.peer_memory
    step = zero_step(model, built.optimizer)
    if workload.cuda_graph:
        step = GraphedStep(step, built.optimizer, warmup=GRAPH_WARMUP,
                           counter=model.runtime.comm.counter)
    return Engine(
        step=step,
        memory_model=memory,
        memory_formula=f"(2+4+K)·Ψt/N + 2·Ψf/N with K = {k:g} "
        f"({states.name} states); layout = same with padding; "
        "device_states, host_states = the placement's split (K_h on the host); "
        "gathered_peak = bf16 chunks of 1 + prefetch_depth units and of the held "
        "units (none with one rank); "
        "predicted_peak = device states - shard grads + gathered_peak "
        "+ max(activations, activations_beside_grads + early_update_grads) "
        "(of the line's kernels), or the automatic placement's own prediction",
        psi_trainable=psi_t,
        psi_frozen=psi_f,
        counter=model.runtime.comm.counter,
        info=info,
        uncounted_device_bytes=0 if peers is None else peers.bytes_uncounted,
        measured_report=measured,
    )


def predicted_peak(workload: Workload, memory: dict) -> dict[str, int]:
    r"""
    ### The peak the notes predict: states, gathered chunks, activations

    $M_\text{states} - 4\Psi_t/N + G + \max(A, A_g + E)$, in the backward pass:
    the model states on the device (from the layout) but the fp32 shard
    gradients, which exist only
    from their chunk's reduce-scatter on, the gathered chunks of $1 +$
    prefetch units (none with one rank, whose full buffers are its shards),
    and the activations alive then (the family's `activation_memory`, e.g.
    GPT-NeoX's [activation memory](../labml_zero/neox/activation_memory.html):
    every layer's saved tensors plus the readout's and the loss's peak, for
    the kernels the workload runs: the chunked loss holds no logits), and the freed gradients
    the early updates still queued hold ($E$, `early_update_grads`: at most
    `EARLY_UPDATES_IN_FLIGHT` of them), which come after the loss's peak,
    beside what the layers keep then ($A_g$, `beside_gradients`). Compiled layers keep what the
    family's count says of them (with fp8 products, not their inputs). With the automatic offload the
    builder replaces it by the placement's own prediction, which stands on the
    probe's measured peak.
    """
    activations, beside = (family_for_config(workload.model).activation_memory(
        workload.model, batch=workload.batch, seq=workload.seq,
        finetune=workload.finetune, checkpointing=workload.activation_checkpointing,
        kernels=workload.kernels, compiled=workload.compile,
        beside_gradients=phase) for phase in (False, True))
    states = memory.get("device_states", memory["layout_states"])
    return {"activations": activations, "activations_beside_grads": beside,
            "predicted_peak": states - memory["shard_grads"]
            + memory["gathered_peak"]
            + max(activations, beside + memory["early_update_grads"])}


def probe_step(ctx: DistContext, workload: Workload
               ) -> Callable[[Zero3Sequential], None]:
    """
    ### The automatic offload's probe: one forward and backward

    On a batch of its own (seed -1), so the timed steps see the usual data.
    """
    probe = random_batches(workload, ctx, count=1, seed=-1)[0]

    def forward_backward(model: Zero3Sequential) -> None:
        lm_loss(model, probe).backward()

    return forward_backward


def simulated_limits(ctx: DistContext, workload: Workload
                     ) -> Callable[[list[ShardSpec]], AutoLimits]:
    """
    ### A simulated device for the CPU smoke test (see Offload)

    The probe's "peak" is the states without optimizer, and the device holds
    half of the optimizer state more (and, for a resident workload, room for
    the frozen chunks gathered); the optimizer state is the workload's
    layout's, $K_d$ bytes an element.
    """
    states = state_layout(workload.optimizer_states)

    def limits(shards: list[ShardSpec]) -> AutoLimits:
        split = resident_bytes(Placement(), shards, states=states)
        trainable = sum(s.numel for s in shards if s.trainable)
        optimizer_bytes = int(device_optimizer_bytes(PARAM_BYTES, states)
                              * trainable)
        without = int(split.device) - optimizer_bytes

        def measure_peak(run) -> int:
            run()
            # the fp32 `master_init` copies are on the device during the probe
            return without + MASTER_INIT_BYTES * trainable

        frozen_bytes = PARAM_BYTES * sum(s.numel for s in shards if not s.trainable)
        room = ctx.world_size * frozen_bytes if workload.resident else 0
        return AutoLimits(measure_peak=measure_peak, margin=0,
                          device_capacity=int(split.device) - optimizer_bytes // 2
                          + room)

    return limits


def report_placement(decided: AutoPlacement, shards: list[ShardSpec],
                     info: dict) -> None:
    """
    ### What the automatic offload decided

    Adds the decision to `info`; the device/host split of the model states
    is the memory model's, from the same placement.
    """
    trainable = sum(s.numel for s in shards if s.trainable)
    offloaded = sum(shards[i].numel for i in decided.placement.optimizer_on_host)
    info.update(
        offloaded_chunks=len(decided.placement.optimizer_on_host),
        offloaded_fraction=offloaded / max(trainable, 1),
        predicted_peak=decided.predicted_peak,
        host_link_bytes={"down": decided.traffic.down, "up": decided.traffic.up},
        resident_chunks=len(decided.placement.resident),
    )
    # launch gave each rank its share of the host's cores
    info["host_threads"] = torch.get_num_threads()
