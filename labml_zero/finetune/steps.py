r"""
---
title: A training step
summary: The job's step: micro-batches, the loss summed over tokens, the backward
  pass, the optimizer's step, and the part a CUDA graph records.
---

# A training step

One step of [the job](job.html) on one rank: each micro-batch's summed
cross-entropy $\sum_t -\log p(x_{t+1} \mid x_{\le t})$ and its count of
tokens, the backward pass that [the engine's hooks](../zero3/hooks.html)
reduce as it goes, and the optimizer's step. The sums of all ranks arrive in
one all-reduce (`Totals`), so the loss the job reports is the mean over every
token of the step, whatever the ranks' shares. `device_step` is the part with
no host synchronisation, which [a CUDA graph](../optimizers/graphed_step.html)
can record.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labml_zero.finetune.config import FinetuneConfig
from labml_zero.finetune.dataset import RankSampler, TextDataset
from labml_zero.launch import DistContext
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.optimizers.clip_grad import clip_grad_norm_
from labml_zero.optimizers.grad_scaler import LossScaler
from labml_zero.optimizers.graphed_step import GraphedStep
from labml_zero.zero3.sharded_model import Zero3Sequential



class Totals(NamedTuple):
    """Sums over all ranks' tokens, from one all-reduce."""

    loss_sum: float
    correct: float
    tokens: float
    grad_squares: float = math.nan
    r"""$\lVert g \rVert_2^2$ of the step; NaN where no gradient was taken."""

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens

    @property
    def grad_norm(self) -> float:
        return math.sqrt(self.grad_squares)


def micro_batch(dataset: TextDataset, indices: list[int],
                device: torch.device) -> torch.Tensor:
    """`[2, B, T]` int64 on `device`: the inputs, then the targets."""
    batch = dataset.batch(indices)
    return torch.stack([batch.inputs, batch.targets]).to(device)


def forward_loss(model: Zero3Sequential, dataset: TextDataset, indices: list[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """
    #### Mean cross-entropy of one micro-batch, and `[loss_sum, correct, tokens]`
    """
    return batch_loss(model, micro_batch(dataset, indices, device))


def batch_loss(model: Zero3Sequential, batch: torch.Tensor, *,
               fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """
    #### The loss of `batch` `[2, B, T]`, and `[loss_sum, correct, tokens]`

    With the fused loss (`fused`) the readout computes the loss from the
    targets without ever holding the logits, so no token's prediction is known
    and `correct` is NaN (no training accuracy); the validation, under
    `no_grad`, reads the logits either way. Nothing here waits on the host,
    so a CUDA graph can record it.
    """
    inputs, targets = batch[0], batch[1]  # [B, T] int64 each
    n = targets.numel()
    if fused:
        loss = model(inputs, targets)  # [] fp32, the readout's chunked loss
        correct = loss.new_full((), math.nan, dtype=torch.float64)
    else:
        logits = model(inputs)  # [B, T, V] param dtype
        # fp32 softmax: log(Σ exp) over the whole vocabulary, summed in bf16,
        # would lose the small terms.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        with torch.no_grad():
            correct = (logits.argmax(dim=-1) == targets).sum().double()
    with torch.no_grad():
        # [3] fp64, so sums over many tokens and ranks stay exact; `new_full`
        # fills on the device (a host tensor copied in would not record)
        stats = torch.stack([loss.detach().double() * n, correct,
                             loss.new_full((), n, dtype=torch.float64)])
    return loss, stats


def all_reduce_totals(stats: torch.Tensor) -> Totals:
    dist.all_reduce(stats)
    # host sync: .tolist(), once per step, for the tracker
    return Totals(*stats.tolist())


def validation_micro_batches(config: FinetuneConfig, samples: int,
                             world_size: int) -> tuple[int, str | None]:
    """
    ### The micro-batches one evaluation runs, and a line if fewer were asked

    `valid_batches` steps' worth, $A$ micro-batches each, or the whole
    validation split of `samples` where it holds fewer: the run then says so
    once, rather than validating on less than its flag asked in silence.
    """
    held = len(RankSampler(samples, batch_size=config.batch_size, rank=0,
                           world_size=world_size, shuffle=False))
    asked = config.valid_batches * config.grad_accum
    if asked <= held:
        return asked, None
    return held, (f"validation: the split holds {held} micro-batches of "
                  f"{config.batch_size} x {world_size}, fewer than --valid-batches "
                  f"{config.valid_batches} x --grad-accum {config.grad_accum}; "
                  f"each evaluation uses all of it")


@torch.no_grad()
def evaluate(model: Zero3Sequential, dataset: TextDataset, config: FinetuneConfig,
             ctx: DistContext) -> Totals:
    """
    ### Loss and accuracy on the first `valid_batches` steps' worth of samples

    Unshuffled, so each evaluation sees the same samples: $B A N_d$ a step,
    which do not depend on the layout, in micro-batches of $B N_d$. Every rank
    runs the same number of forwards (the engine's all-gathers must match),
    each on its own block of each micro-batch.
    """
    sampler = RankSampler(len(dataset), batch_size=config.batch_size,
                          rank=ctx.rank, world_size=ctx.world_size, shuffle=False)
    stats = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    micro_batches, _ = validation_micro_batches(config, len(dataset),
                                                ctx.world_size)
    for micro in range(micro_batches):
        indices = sampler.step_batches(0, micro)[0]
        stats += forward_loss(model, dataset, indices, ctx.device)[1]
    return all_reduce_totals(stats)


class Training(NamedTuple):
    """What a step updates."""

    model: Zero3Sequential
    optimizer: AdamFP16
    scaler: LossScaler | None
    """fp16 only: the dynamic loss scale, agreed by all ranks."""
    fused_loss: bool = False
    """The readout computes the loss (the `loss` kernel): no training accuracy."""
    graphed: GraphedStep | None = None
    """With `cuda_graph`: the device part of the step (`device_step`),
    recorded after `GRAPH_WARMUP` eager steps and replayed."""


# eager steps before the step is recorded as a CUDA graph: the optimizer's
# state, NCCL's communicators and the prefetch order exist by then
GRAPH_WARMUP = 2


def train_step(training: Training, batches: list[list[int]],
               dataset: TextDataset, config: FinetuneConfig) -> Totals:
    """
    ### One optimizer step over the `grad_accum` micro-batches `batches`

    After the backward passes, in order: with fp16, the [loss
    scaler](../optimizers/grad_scaler.html) unscales the shard gradients and
    checks them for overflow (one all-reduce of the squared norm, which every rank
    sees alike, so all skip a bad step together); with `clip_grad`, the [global
    norm](../optimizers/clip_grad.html) is clipped, reusing that norm; then
    AdamFP16 steps. Without either (bf16 or fp32, no `clip_grad`), no gradient
    changes after its chunk is reduced, so each shard is updated right then,
    during the rest of the backward pass
    ([`update_during_backward`](../optimizers/adam_fp16.html)), and its
    gradient is freed (`free_grads`): the fp32 gradients of all the shards
    never exist at once, as [the planner's budget](../planner/memory_budget.html)
    counts. The gradient norm is then summed by the updates themselves, as
    each consumes its gradient. The schedule has set the rate before the step,
    so an update during the backward pass uses it too. Tracking costs one more
    all-reduce, of four numbers (loss sum, correct tokens, tokens and, when
    nothing reduced it yet, the squared gradient norm), and one host sync per
    step.
    """
    device = training.model.runtime.comm.device
    # [A, 2, B, T] int64: every micro-batch's inputs and targets
    batch = torch.stack([micro_batch(dataset, indices, device)
                         for indices in batches])
    if training.graphed is not None:
        return all_reduce_totals(training.graphed(batch))
    return all_reduce_totals(device_step(training, batch, config))


def device_step(training: Training, batch: torch.Tensor,
                config: FinetuneConfig) -> torch.Tensor:
    """
    #### The step's work on the device: `[loss_sum, correct, tokens, ‖g‖²]` fp64

    Without a loss scaler or clipping nothing in it waits on the host, so
    `GraphedStep` can record it whole (`cuda_graph`); the totals' all-reduce
    and the host's read of them stay outside.
    """
    model, optimizer, scaler = training.model, training.optimizer, training.scaler
    comm = model.runtime.comm
    stats = torch.zeros(4, dtype=torch.float64, device=comm.device)
    for micro in range(len(batch)):
        # The first $A - 1$ backward passes run inside `model.no_sync()`, so
        # gradients stay in the chunks' full-size buffers and one reduce-scatter
        # per chunk, after the last micro-batch, serves the whole step.
        last = micro == len(batch) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss, micro_stats = batch_loss(model, batch[micro],
                                           fused=training.fused_loss)
            loss = loss / len(batch)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        stats[:3] += micro_stats
    shards = model.get_trainable_chunk()
    # The scaler's overflow check is the gradient norm's all-reduce; clipping
    # reuses that norm instead of a second collective.
    norm = scaler.unscale_(shards) if scaler is not None else None
    if config.clip_grad is not None:
        norm = clip_grad_norm_(shards, config.clip_grad, comm, norm=norm)
    if scaler is not None:
        scaler.step(optimizer)
    else:
        optimizer.step()
    world = dist.get_world_size()
    if norm is not None:
        # the same on every rank: the all-reduce's sum of N_d copies is ‖g‖²
        stats[3] = norm.double().square() / world
    else:
        # the updates freed the gradients and summed their squares as they
        # consumed them (`ConsumedGradSquares`). With hybrid sharding each
        # shard is held by N_d / K ranks, whose squares the all-reduce adds
        # N_d / K times: divided here, so the sum is ‖g‖² once.
        replicas = world // (config.shard_group_size or world)
        squares = optimizer.consumed_squares.take(comm.device)
        stats[3] = squares / replicas
    optimizer.zero_grad()
    return stats
