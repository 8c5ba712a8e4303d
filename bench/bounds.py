r"""
---
title: How fast any engine could be
summary: Two reference steps on one device, the model alone and the model with the
  cheapest update of its optimizer states, that bound every engine's step.
---

# How fast any engine could be

An engine's step is the model's forward and backward passes plus what the engine
adds: gathers, gradient copies, the optimizer's update. On one device nothing
needs gathering, so the step of any engine that keeps AdamW's fp32 master weights
and moments is at least

$$t_\text{engine} \ge t_\text{model} + t_\text{update}, \qquad
  t_\text{update} \ge \frac{b\,\Psi_t}{\beta},$$

with $\Psi_t$ the trainable parameters, $\beta$ the memory bandwidth and $b$
the bytes the update must move per parameter. This page builds two reference
"engines" for the benchmark that measure both terms, so that an engine's line
can be put beside the best it could do on the same device, in the same command:

* **`model_only`**: the model in bf16, forward and backward, the gradients
  dropped: $t_\text{model}$, the step of an engine that adds nothing and
  trains nothing. Its distance to an engine's step is everything the engine
  adds.
* **`update_floor`**: the same step, then AdamW's update of every trainable
  parameter in [one pass](../labml_zero/optimizers/rounded_update.html) that
  reads autograd's bf16 gradient where autograd left it (no copy, no
  non-finite check) and writes the fp32 master and moments and the bf16
  weight: 28 bytes a parameter (`one_pass_bytes(2, 2)`), the least an update
  of fp32 states can move. Its step is the floor of any engine with
  [AdamFP16's](../labml_zero/optimizers/adam_fp16.html) numerics.

`--optimizer-states` gives `update_floor` labml_zero's layout: the floor keeps
that [layout's](../labml_zero/zero3/state_layout.html) states and takes its
one pass, $2K + 2 + 2$ bytes an element
(`one_pass_bytes(2, 2, layout)`):
{{py: rounded_update.one_pass_bytes(2, 2, state_layout.BF16_MOMENTS)}} with
bf16 moments, {{py: rounded_update.one_pass_bytes(2, 2,
state_layout.EIGHT_BIT_MOMENTS) | .4g}} with 8-bit ones
([their pass](../labml_zero/optimizers/blockwise_moments.html)). A layout
without a master (`bf16-stochastic`, `bf16-kahan`) has no one pass (AdamFP16
runs its twin on widened slices), so the floor skips it and says why; there
is no floor to set beside such a line. `model_only` has no optimizer: its
line says `fp32`, as the peers' do.

Both run on one device only (`--world-size 1`), with every state on it (a
workload that offloads is skipped), eagerly (skipped with `--compile`, eager
with `--cuda-graph` as the peers are), and with the workload's recomputation
and fused kernels, as the engines run them. They are not
engines: they share no gradients between ranks, clip nothing and skip nothing,
and `update_floor` launches one kernel per parameter, so on a step that the
host bounds it is no floor; on a step that the GPU bounds it is.
"""

from __future__ import annotations

import torch
from torch import nn

from labml_zero.launch import DistContext
from labml_zero.neox.finetuners import finetuner
from labml_zero.layers.layer_list import LayerChain
from labml_zero.optimizers import blockwise_moments
from labml_zero.optimizers.rounded_update import (
    Betas,
    adamw_rounded_,
    one_pass,
    step_coefficients,
)
from labml_zero.planner.memory_model import zero_model_states
from labml_zero.zero3.state_layout import FP32_STATES, StateLayout, state_layout

from .baselines import with_recompute
from .engine import LEARNING_RATE, WEIGHT_DECAY, Engine, InitialWeights, lm_loss
from .workloads import Workload, model_layers

BOUNDS = ("model_only", "update_floor")
"""The reference steps `bench.run --engines` accepts beside the engines."""

PARAM_BYTES = 2
"""bf16 weights, and autograd's bf16 gradients."""
STATE_BYTES = FP32_STATES.bytes_per_element()
"""fp32 master, first and second moment: $K$ of the default layout."""


def unavailable(name: str, workload: Workload) -> str | None:
    """Why bound `name` cannot run `workload`; `None` if it can."""
    if workload.offload is not None:
        return (f"{name} keeps every state on the device; workload "
                f"{workload.name} offloads")
    if (name == "update_floor"
            and state_layout(workload.optimizer_states).master is None):
        return (f"update_floor has no one-pass update of "
                f"{workload.optimizer_states} states (no master: AdamFP16 "
                f"runs their twin)")
    return None


def bare_model(ctx: DistContext, workload: Workload) -> tuple[nn.Module, int, int]:
    r"""
    ## The model in bf16 on the device, marked by the workload's fine-tuner

    Built as DDP's is (on the device, every engine's initial weights), in the
    dtype labml_zero and FSDP2 compute in, each transformer layer recomputed if
    the workload says.
    Returns the model, $\Psi_t$ and $\Psi_f$.
    """
    layers = model_layers(workload, device=ctx.device, dtype=torch.bfloat16)
    count = finetuner(workload.finetune)(layers)
    # every engine's initial weights, rounded to bf16 as ours are
    InitialWeights(workload, seed=torch.initial_seed(),
                   device=ctx.device).copy_into(layers)
    model = LayerChain(*with_recompute(layers, workload))
    return model, count.trainable, count.total - count.trainable


class FloorUpdate:
    r"""
    ## AdamW of each parameter in one pass, from its own gradient

    Holds each trainable parameter's states in `states`' layout, in its
    order: the fp32 master (its initial value) and zero moments; with fp32
    states `STATE_BYTES`, {{py: state_layout.FP32_STATES.bytes_per_element()}}
    bytes a parameter. `step()` updates every parameter that has a gradient
    and drops the gradient, as `zero_grad(set_to_none=True)` would. The
    arithmetic is AdamFP16's one pass (8-bit moments: theirs); on a CPU the
    function runs as written, on a GPU compiled.
    """

    def __init__(self, params: list[nn.Parameter], *, lr: float,
                 weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, states: StateLayout = FP32_STATES):
        if states.master is None:
            raise ValueError(f"FloorUpdate: {states.name} states have no "
                             f"master, and no one-pass update")
        self.params, self.layout = params, states
        device = params[0].device
        # each state of the layout, [numel] (a per-block one: [blocks]), per
        # parameter; zeros but the master
        self.states = [tuple(p.detach().float().view(-1) if t.master else
                             torch.zeros(t.numel(p.numel()), dtype=t.dtype,
                                         device=p.device)
                             for t in states.tensors) for p in params]
        self.betas = Betas(betas[0], betas[1], eps)
        self.weight_decay = weight_decay
        self.lr = torch.tensor(lr, device=device)
        self.step_count = torch.zeros((), device=device)

    @torch.no_grad()
    def step(self) -> None:
        self.step_count.add_(1)
        coefficients = step_coefficients(
            self.step_count, self.lr, beta1=self.betas.beta1,
            beta2=self.betas.beta2, weight_decay=self.weight_decay)
        for param, state in zip(self.params, self.states):
            if param.grad is None:
                continue
            if self.layout.blockwise:
                # master, then codes and scales of each moment
                master, *moments = state
                blockwise_moments.one_pass(
                    master, param.grad.view(-1), tuple(moments), param.view(-1),
                    coefficients, None, self.betas)
            else:
                update = one_pass if param.is_cuda else adamw_rounded_
                update(param.view(-1), state, param.grad.view(-1), coefficients,
                       None, self.betas)
            param.grad = None


def build_bound(name: str, ctx: DistContext, workload: Workload) -> Engine:
    """
    ## `model_only` or `update_floor` as a benchmark engine

    Its memory model counts bf16 weights and gradients, and for
    `update_floor` the states of the workload's layout beside them, $K$
    bytes an element.
    """
    model, psi_t, psi_f = bare_model(ctx, workload)
    trainable = [p for p in model.parameters() if p.requires_grad]
    layout = state_layout(workload.optimizer_states)
    update = (FloorUpdate(trainable, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                          states=layout)
              if name == "update_floor" else None)

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model, batch)
        loss.backward()
        if update is not None:
            update.step()
        for param in trainable:
            param.grad = None
        return loss.detach()

    state_bytes = layout.bytes_per_element() if update is not None else 0
    kept = f" ({layout.name} states)" if update is not None else ""
    return Engine(
        step=step,
        memory_model={"zero_states": zero_model_states(
            psi_t, psi_f, 1, param_bytes=PARAM_BYTES, grad_bytes=PARAM_BYTES,
            optimizer_bytes=state_bytes)},
        memory_formula=f"(2+2+K)·Ψt + 2·Ψf on one device with K = "
        f"{state_bytes:g}{kept}",
        psi_trainable=psi_t,
        psi_frozen=psi_f,
    )
