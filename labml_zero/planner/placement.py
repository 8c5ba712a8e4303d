r"""
---
title: Placement of model states in device and host memory
summary: Which chunks keep their optimizer state (and parameter shard) in host
  memory, and which stay gathered, chosen by fixed fractions or to fit a measured
  step; bytes moved per step.
---

# Placement of model states in device and host memory

A ZeRO-3 rank holds, per element of a trainable shard, $p$ bytes of bf16 (or
fp16) parameter, $4$ of fp32 gradient (`LocalShard.grad`) and
$K$ = {{py: memory_model.OPTIMIZER_BYTES}} of optimizer state (fp32 master and two
moments; the optimizer's [state layout](../zero3/state_layout.html) declares $K$). For GPT-NeoX-20B on $N_d = 2$ ranks, with
$S = \Psi / 2 = 10.3 \cdot 10^9$
(tested: tests/zero3/test_placement.py::test_gpt_neox_20b_memory_figures_of_the_page)
elements per rank, that is

$$(2 + 4 + 12)\,S = 185 \text{ GB per rank}$$
(tested: tests/zero3/test_placement.py::test_gpt_neox_20b_memory_figures_of_the_page)

more than an H200 holds, before any gathered chunk or activation.
The optimizer state is the largest part, and the step touches it once, in the
update alone; ColossalAI's Gemini and ZeRO-Offload keep part of it in host memory
and run the update there. This page is the *policy*: which chunks go to the
host, and, when memory is plentiful, which frozen chunks stay gathered instead.
The mechanisms are [AdamFP16](../optimizers/adam_fp16.html)'s `offload=` and the
[chunk](../zero3/chunk.html)'s `offload_shard` and `keep_resident`.

Everything here is a pure function of sizes and bytes; measuring a built
model for the automatic placement, and applying a placement to it, are [the
next page](placement_probe.html).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

# bytes per element: the memory model is their one home, the optimizer's
# $K$ its state layout
from labml_zero.planner.memory_model import (GRAD_BYTES, PARAM_BYTES, STAGING_BYTES,
                                            pinned_bytes)
from labml_zero.zero3.state_layout import FP32_STATES, StateLayout

__all__ = [
    "ShardSpec",
    "Placement",
    "StaticPlacement",
    "OffloadTraffic",
    "MemorySplit",
    "AutoPlacement",
    "offload_traffic",
    "resident_bytes",
    "auto_placement",
    "shard_specs",
]

GIB = 1024**3


def device_optimizer_bytes(param_bytes: int,
                           states: StateLayout = FP32_STATES) -> int:
    r"""$K_d$, optimizer bytes per element on the device: the layout's $K$,
    less the master's where the shard is its own master (fp32)."""
    return states.bytes_per_element(
        shard_is_master=states.shard_is_master(param_bytes))


class ShardSpec(NamedTuple):
    """
    ## One chunk, as this rank sees it

    * `numel`: $S$, the elements of this rank's shard, padding included.
    * `trainable`: whether it has a gradient and optimizer state.

    A list of them, one per entry of `model.chunks`, in that (execution) order.
    """

    numel: int
    trainable: bool


def check_shards(shards: Sequence[ShardSpec]) -> None:
    for i, shard in enumerate(shards):
        if shard.numel < 0:
            raise ValueError(f"shard {i} has numel {shard.numel}, must be >= 0")


@dataclass(frozen=True)
class Placement:
    """
    ## Where each chunk's states live

    * `optimizer_on_host`: positions in `model.chunks` of the trainable chunks
      whose master and moments are in host memory.
    * `param_on_host`: positions of the chunks whose parameter shard is in host
      memory ([`apply_placement`](placement_probe.html) moves them).
    * `resident`: positions of frozen chunks kept gathered between steps
      (`Chunk.keep_resident`), the opposite of offloading.
    """

    optimizer_on_host: frozenset[int] = frozenset()
    param_on_host: frozenset[int] = frozenset()
    resident: frozenset[int] = frozenset()

    def check(self, shards: Sequence[ShardSpec]) -> None:
        """Every position names a chunk; only trainable ones have optimizer state;
        only frozen ones stay resident."""
        for kind, positions in (("optimizer_on_host", self.optimizer_on_host),
                                ("param_on_host", self.param_on_host),
                                ("resident", self.resident)):
            for i in sorted(positions):
                if not 0 <= i < len(shards):
                    raise ValueError(f"{kind} names chunk {i}, but there are "
                                     f"{len(shards)}")
        for i in sorted(self.optimizer_on_host):
            if not shards[i].trainable:
                raise ValueError(f"optimizer_on_host names chunk {i}, which is "
                                 "frozen and has no optimizer state")
        for i in sorted(self.param_on_host):
            if shards[i].trainable and i not in self.optimizer_on_host:
                raise ValueError(f"param_on_host names trainable chunk {i}, whose "
                                 "optimizer state is not on the host")
        for i in sorted(self.resident):
            if shards[i].trainable:
                raise ValueError(f"resident names trainable chunk {i}; only frozen "
                                 "chunks stay gathered")
            if i in self.param_on_host:
                raise ValueError(f"chunk {i} is both resident and on the host")

    def optimizer_offload(self, shards: Sequence[ShardSpec]) -> frozenset[int]:
        """
        ### The `offload=` of `AdamFP16(model.get_trainable_chunk(), ...)`

        Positions among the *trainable* chunks, which is how the optimizer
        numbers its shards.
        """
        self.check(shards)
        trainable = [i for i, s in enumerate(shards) if s.trainable]
        return frozenset(k for k, i in enumerate(trainable)
                         if i in self.optimizer_on_host)


def from_output_end(numels: Sequence[int], positions: Sequence[int],
                    fraction: float) -> frozenset[int]:
    """
    #### The fewest chunks, last first, holding at least `fraction` of the elements

    Rounding up: a fraction set to make a model fit must not be undershot.

    Both policies offload from the **output end** of the model (the last chunks in
    execution order) first:

    * in backward the last chunks' gradients are final first, so their copy down has
      the rest of the backward pass to hide behind;
    * in the next forward their parameters are needed last, so the upload of the
      updated masters has the most time to land before their all-gather.
    """
    target = fraction * sum(numels[i] for i in positions)
    chosen, moved = [], 0
    for i in reversed(positions):
        if moved >= target:
            break
        chosen.append(i)
        moved += numels[i]
    return frozenset(chosen)


@dataclass(frozen=True)
class StaticPlacement:
    """
    ## Fixed fractions, like ColossalAI's `offload_optim_frac`/`offload_param_frac`

    * `optimizer_cpu_fraction`: the least fraction of the trainable elements
      whose optimizer state goes to the host, whole chunks from the output end.
    * `param_cpu_fraction`: the same for parameter shards over all chunks; as in
      ColossalAI it needs `optimizer_cpu_fraction == 1` (a parameter on the host
      is updated there).
    """

    optimizer_cpu_fraction: float = 0.0
    param_cpu_fraction: float = 0.0

    def __post_init__(self):
        for name in ("optimizer_cpu_fraction", "param_cpu_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.param_cpu_fraction > 0 and self.optimizer_cpu_fraction < 1:
            raise ValueError("param_cpu_fraction > 0 needs optimizer_cpu_fraction "
                             f"= 1, got {self.optimizer_cpu_fraction}")

    def place(self, shards: Sequence[ShardSpec]) -> Placement:
        """### Choose the chunks for `model.chunks` described by `shards`"""
        check_shards(shards)
        numels = [s.numel for s in shards]
        trainable = [i for i, s in enumerate(shards) if s.trainable]
        return Placement(
            from_output_end(numels, trainable, self.optimizer_cpu_fraction),
            from_output_end(numels, range(len(shards)), self.param_cpu_fraction),
        )


class OffloadTraffic(NamedTuple):
    """
    ## Host-link bytes per step and rank

    * `down`: device to host, the fp32 gradients ($4$ bytes per offloaded element).
    * `up`: host to device, rounded masters ($p$) or parameter shards ($2p$).
    """

    down: int
    up: int

    def seconds(self, bandwidth: float) -> float:
        """Time on a link of `bandwidth` bytes/s per direction; both run at once."""
        if bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
        return max(self.down, self.up) / bandwidth


def offload_traffic(placement: Placement, shards: Sequence[ShardSpec], *,
                    param_bytes: int = PARAM_BYTES) -> OffloadTraffic:
    r"""
    ### Bytes a step moves over the host link under `placement`

    Per offloaded element: $4$ down and $p$ up for optimizer state; a parameter
    shard on the host instead goes up twice (forward and backward gathers).

    #### Bytes moved, bytes saved

    Offloading a trainable shard's optimizer state moves, per element and step,

    * **down** the fp32 gradient, $4$ bytes (device to host), and
    * **up** the updated master, rounded on the host to the shard dtype, $p$ bytes,

    so $F$ offloaded elements cost $4F$ bytes down and $pF$ up per step, and save
    $K_d F$ bytes of device memory: $K_d = K$, or $K - 4$ for an fp32 shard (its
    master was the shard itself; `device_optimizer_bytes`). The host then holds
    $(K_h + 4)F$ bytes: $K_h F$ of state and $4F$ of pinned staging buffer,
    which carries the gradient down and the rounded master up. $K_h = K$ with
    a master; a layout without one (`bf16-stochastic`, `bf16-kahan`) updates
    the weight, so the host keeps a copy of it, $K_h = K + p$, and sends that
    up instead of a master's rounding: the same traffic.

    A parameter shard on the host (`Chunk.offload_shard`, applied by
    [`apply_placement`](placement_probe.html)) saves $p$ more bytes per element
    and costs two uploads of $p$ bytes per step, one before each all-gather
    (forward and backward); its updated master needs no upload of its own. As
    in ColossalAI, it needs the whole optimizer state on the host.

    #### When the link becomes the bottleneck

    Let the host link move $\beta$ bytes/s each way, both ways at once (on an
    H200, PCIe Gen5 x16), and a GPU compute at $\Phi$ FLOP/s. With a fraction $x$
    of a rank's $S$ trainable elements offloaded, $F = xS$, a step's copy down
    takes $4F/\beta$ and its copy up $pF/\beta$, at the same time. For GPT-NeoX-20B
    on two ranks, bf16, with half of the optimizer state offloaded,
    $F = 5.1 \cdot 10^9$
    (tested: tests/zero3/test_placement.py::test_gpt_neox_20b_traffic_of_the_page)
    elements per rank go $4F = 20.6 \text{ GB}$
    (tested: tests/zero3/test_placement.py::test_gpt_neox_20b_traffic_of_the_page)
    down and $2F = 10.3 \text{ GB}$
    (tested: tests/zero3/test_placement.py::test_gpt_neox_20b_traffic_of_the_page)
    up each step.

    A step of $T$ tokens over all ranks costs $6\Psi T$ FLOP, a third of it
    forward and two thirds backward, so the backward pass takes
    $4\Psi T / (N_d \Phi)$ on each rank. The copy down hides behind it (see
    `prefetch_grad`) as long as

    $$\frac{4F}{\beta} \le \frac{4\Psi T}{N_d \Phi}, \quad\text{that is}\quad
      T \ge x\,\frac{\Phi}{\beta}$$
    (tested: tests/zero3/test_placement.py::test_gpt_neox_20b_traffic_of_the_page)

    (with $\Psi = N_d S$): the link is the bottleneck only for steps of fewer
    tokens than the FLOPs a GPU does while the link moves one byte, times the
    offloaded fraction. With hundreds of TFLOP/s against tens of GB/s, those are
    short steps of a few thousand tokens.

    The host update reads the fp32 master, gradient and moments and writes the
    master, the moments and the rounded copy, several times the bytes that cross
    the link, and the ranks of a machine share its memory bandwidth. It is
    memory-bound: a fused AdamW on the host runs at about the host's memory
    bandwidth over those bytes, and more threads help little. It runs during the
    backward pass ([`update_during_backward`](../optimizers/adam_fp16.html)); what
    of it does not fit in the backward pass adds to the step, and with many
    offloaded elements per rank it, not PCIe, is the first bottleneck.

    Parameter shards on the host are copied up synchronously with their gather (on
    the gather stream, so the prefetch hides it behind the previous unit's
    computation, but a chunk's copy and all-gather do not overlap each other), and
    every gather copies again; keeping a device copy between the forward and the
    backward pass would halve the traffic. Parameter offload has not been measured
    on GPUs.
    """
    placement.check(shards)
    down = up = 0
    for i, shard in enumerate(shards):
        if i in placement.optimizer_on_host:
            down += 4 * shard.numel
        if i in placement.param_on_host:
            up += 2 * param_bytes * shard.numel
        elif i in placement.optimizer_on_host:
            up += param_bytes * shard.numel
    return OffloadTraffic(down, up)


class MemorySplit(NamedTuple):
    """Model-state bytes of one rank: `device` and `host`."""

    device: int
    host: int


def resident_bytes(placement: Placement, shards: Sequence[ShardSpec], *,
                   param_bytes: int = PARAM_BYTES,
                   states: StateLayout = FP32_STATES,
                   pinned: bool = False) -> MemorySplit:
    r"""
    ### Model-state bytes per rank on the device and on the host

    Per element of a trainable chunk: $p + 4 + K_d$ on the device; an offloaded
    optimizer state moves $K_d$ off it and puts $K_h + 4$ (state and staging) on
    the host, $K_h$ the layout's `host_bytes_per_element`: $K$, and for a
    layout without a master $K + p$, the host's copy of the weight it
    updates; a parameter shard on the host moves $p$. Frozen chunks hold $p$.
    Gathered chunks and activations are not model states (see the
    [memory model](memory_model.html)). $K$ is the `states` layout's
    ([the optimizer's state layout](../zero3/state_layout.html)).

    #### Memory for the GPT-NeoX-20B example

    For GPT-NeoX-20B on two ranks, offloading a fraction $x$ of the optimizer
    state leaves per rank $62$ GB
    (tested:
    tests/zero3/test_placement.py::test_gpt_neox_20b_memory_figures_of_the_page)
    on the device plus $1 - x$ times $123$ GB
    (tested:
    tests/zero3/test_placement.py::test_gpt_neox_20b_memory_figures_of_the_page)
    of optimizer state (gathered chunks and activations come on top), and puts
    $(K + 4)\,x S$ bytes, $x$ times $165$ GB
    (tested:
    tests/zero3/test_placement.py::test_gpt_neox_20b_memory_figures_of_the_page),
    on the host, whose memory the ranks of a machine share. The smallest $x$ is set
    by the room the device must keep for gathered chunks and activations, the
    largest by the host memory the ranks can pin. `resident_bytes` computes the
    split for any placement; `auto_placement` chooses the chunks from a measured
    step instead of a fixed $x$.

    With `pinned` (the gradients are on a GPU, so each staging buffer is
    page-locked) a shard's staging buffer takes the block PyTorch's host
    caching allocator gives it, $4S$ rounded up to a power of two
    (`pinned_bytes`). Counted so, the planner's host memory for
    GPT-NeoX-20B's full fine-tune on one H200, with a quarter and with two
    fifths of the state offloaded, came within 1% of what the machine used
    (tested: tests/planner/test_memory_budget.py::test_the_20b_runs_host_memory_is_the_budgets).
    """
    placement.check(shards)
    k_device = device_optimizer_bytes(param_bytes, states)
    # all $K$ (a host master never aliases the shard), and without a master
    # the host's copy of the weight
    k_host = states.host_bytes_per_element(param_bytes)
    device = host = 0
    for i, shard in enumerate(shards):
        n = shard.numel
        if i in placement.param_on_host:
            host += param_bytes * n
        else:
            device += param_bytes * n
        if not shard.trainable:
            continue
        device += GRAD_BYTES * n
        if i in placement.optimizer_on_host:
            staging = STAGING_BYTES * n
            host += k_host * n + (pinned_bytes(staging) if pinned else staging)
        else:
            device += k_device * n
    return MemorySplit(device, host)


class AutoPlacement(NamedTuple):
    """
    ## What `auto_placement` decided

    * `placement`: the chunks whose optimizer state goes to the host.
    * `predicted_peak`: device bytes at the step's peak under it.
    * `traffic`: host-link bytes per step.
    * `states`: the state layout it was decided for, whose $K_d$ and $K_h$
      its report counts the split with.
    """

    placement: Placement
    predicted_peak: int
    traffic: OffloadTraffic
    states: StateLayout = FP32_STATES


def offload_order(shards: Sequence[ShardSpec]) -> list[int]:
    """
    #### The order in which the automatic placement offloads

    The trainable chunks largest first, so that the fewest chunks move; among
    equal sizes the later chunk first, for the reasons of `from_output_end`.
    A run that reports how many chunks it offloaded has offloaded the first
    that many of this list.
    """
    trainable = [i for i, s in enumerate(shards) if s.trainable]
    return sorted(trainable, key=lambda i: (-shards[i].numel, -i))


def auto_placement(
    shards: Sequence[ShardSpec],
    *,
    device_capacity: int,
    measured_peak_other: int,
    margin: int = 0,
    param_bytes: int = PARAM_BYTES,
    resident_world_size: int | None = None,
    states: StateLayout = FP32_STATES,
) -> AutoPlacement:
    r"""
    ## Offload the fewest optimizer states that make the step fit

    The optimizer creates its state at its first step, so the first forward and
    backward run without it. Their peak, measured (`reset_peak_memory_stats()`
    before the forward, `max_memory_allocated()` before `optimizer.step()`) and
    less the `master_init` bytes still held (they become masters, counted
    below), is `measured_peak_other`: shards, gradients, gathered chunks,
    activations. From then on the state is resident, so

    $$\text{peak} = \text{measured\_peak\_other} + K_d \sum_{c \text{ on device}} S_c
    \le \text{device\_capacity} - \text{margin}.$$

    * `shards`: `model.chunks` as `ShardSpec`s.
    * `device_capacity`: the device's usable bytes.
    * `margin`: bytes kept free (fragmentation, variation between steps).
    * `states`: the optimizer's state layout, whose $K_d$ each offload saves.

    Chunks are offloaded in `offload_order`: largest first (fewest chunks),
    equal sizes from the output end. Raises `ValueError` when even
    everything offloaded does not fit.

    With `resident_world_size` ($N_d$), memory left over then keeps frozen
    chunks resident (see Keeping chunks resident), largest first, each adding
    its gathered buffer, $N_d S p$ bytes, to the peak while it fits. (A chunk
    gathered at the measured peak is then counted twice: the estimate errs on
    the safe side.)

    #### Keeping chunks resident

    The opposite case: when device memory is plentiful, a chunk need not be
    gathered again at all. A frozen chunk never changes, so once gathered it can
    stay (`Chunk.keep_resident`): each resident chunk keeps its full buffer,
    $N_d S p = C p$ bytes, on the device beside its shard (nothing more on one
    rank, where the full buffer is the shard, though the estimate above still
    counts it). It saves the chunk's all-gathers, each $(N_d - 1) S p$ bytes a
    rank receives in a ring: up to $2 (N_d - 1) S p$ bytes of traffic per step
    and rank, the forward's gather and the backward's (a unit that the
    [hooks](../zero3/hooks.html) do not gather again in the backward pass saves
    only the first). For bias-only fine-tuning of
    GPT-NeoX-20B on 2 ranks, the frozen model is {{py: 2 * neox_model.count_parameters(
    neox_model.build_layers(neox_model.gpt_neox_20b(), device="meta")) / 1e9
    | .0f}} GB in bf16 and fits an H200
    whole: every step then gathers only the bias chunks. A trainable chunk cannot
    stay: its gathered copy is stale after every optimizer step.

    `auto_placement(..., resident_world_size=N_d)` (and
    [`first_step_placement`](placement_probe.html), by default) make frozen
    chunks resident, largest first, in the memory left
    after the offload decision.
    """
    check_shards(shards)
    for name, value in (("device_capacity", device_capacity),
                        ("measured_peak_other", measured_peak_other),
                        ("margin", margin)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    k_device = device_optimizer_bytes(param_bytes, states)
    saving = {i: k_device * s.numel for i, s in enumerate(shards) if s.trainable}
    budget = device_capacity - margin
    peak = measured_peak_other + sum(saving.values())
    if measured_peak_other > budget:
        raise ValueError(
            f"does not fit even with every optimizer state on the host: "
            f"{measured_peak_other / GIB:.2f} GiB without them, "
            f"{budget / GIB:.2f} GiB usable, short by "
            f"{(measured_peak_other - budget) / GIB:.2f} GiB"
        )
    chosen = []
    for i in offload_order(shards):
        if peak <= budget:
            break
        chosen.append(i)
        peak -= saving[i]
    resident = []
    if resident_world_size is not None:
        frozen = [i for i, s in enumerate(shards) if not s.trainable]
        for i in sorted(frozen, key=lambda i: (-shards[i].numel, i)):
            gathered = resident_world_size * shards[i].numel * param_bytes
            if peak + gathered <= budget:
                resident.append(i)
                peak += gathered
    placement = Placement(optimizer_on_host=frozenset(chosen),
                          resident=frozenset(resident))
    return AutoPlacement(placement, peak,
                         offload_traffic(placement, shards, param_bytes=param_bytes),
                         states)


def shard_specs(model) -> list[ShardSpec]:
    """`model.chunks` of a `Zero3Sequential` (or any `ShardedRoot`) as `ShardSpec`s."""
    return [ShardSpec(c.shard_numel, c.trainable) for c in model.chunks]
