r"""
---
title: Gradient buffers
summary: The gradients a rank holds beside its model states during the backward
  pass: held until their chunk's copy, the full-size buffers, under
  accumulation, and behind the early updates.
---

# Gradient buffers

This page deepens [the memory model](memory_model.html) with the gradients
that are not model states: alive for part of each backward pass, they are
what the chunk size changes most. With $C_k$ the size of chunk $k$, $p$ the
parameter's bytes and $g_r$ the {{see: reduce dtype}}'s, the largest of them
without accumulation is

$$B = (p + g_r) \cdot \max_{k \text{ trainable}} C_k.$$
"""

from __future__ import annotations

from labml_zero.optimizers.early_update import EARLY_UPDATES_IN_FLIGHT
from labml_zero.planner.memory_model import _check_at_least
from labml_zero.zero3.chunk_layout import ChunkLayout

__all__ = ["held_grads", "largest_grad_buffer", "accumulated_grad_buffers",
           "early_update_grads"]


def held_grads(layout: ChunkLayout, param_bytes: int) -> int:
    r"""
    ## Gradients held until their chunk's copy

    A trainable chunk keeps each parameter's gradient as autograd made it, in
    the parameter dtype, until the chunk's last one arrives and all of them are
    copied into its buffer in one call (explained on [the chunk-gradient
    page](../zero3/chunk_grads.html)); the copy runs on a side stream, which holds
    them until it is done. The largest chunk's, at most

    $$H = p \cdot \max_{k \text{ trainable}} C_k$$

    bytes ($p$ = `param_bytes`; padding has no gradient, so this bounds them),
    are alive at the moment its buffer is written, and on one rank, which
    needs no buffer, while they are cast into the gradient shard.
    """
    _check_at_least("param_bytes", param_bytes, 1)
    sizes = [chunk.chunk_numel for chunk in layout.chunks if chunk.trainable]
    return max(sizes, default=0) * param_bytes


def largest_grad_buffer(layout: ChunkLayout, grad_bytes: int, param_bytes: int) -> int:
    r"""
    ## Largest full-size gradient buffer, with the gradients copied into it

    During backward a trainable chunk holds each parameter's gradient until the
    last one arrives, copies them all into a full-size buffer of $C_k$ elements
    in the reduce dtype (fp32 by default), reduce-scatters it and frees it. At
    the copy both are alive, the held gradients ($H$ of `held_grads`) and the
    buffer, so the largest chunk adds

    $$B = (p + g_r) \cdot \max_{k \text{ trainable}} C_k$$

    at some moment of every backward pass ($g_r$, the argument `grad_bytes`, the
    reduce dtype's bytes; $p$ = `param_bytes`; oversized chunks count: an
    embedding's buffer is as real as any); zero when nothing trains. Unlike the gathered
    peak it grows with the chunk size even when a group is gathered whole,
    because one chunk per layer holds the whole layer's gradient at once.

    The model counts model states, gathered parameters and gradient buffers only:
    activations, temporary buffers and the allocator's fragmentation are not
    counted, nor, without accumulation, a second gradient buffer live beside the
    largest (a chunk waiting for its reduce-scatter while the next one fills).
    """
    _check_at_least("grad_bytes", grad_bytes, 1)
    sizes = [chunk.chunk_numel for chunk in layout.chunks if chunk.trainable]
    return held_grads(layout, param_bytes) + max(sizes, default=0) * grad_bytes


def accumulated_grad_buffers(layout: ChunkLayout, grad_bytes: int) -> int:
    r"""
    ## Gradient buffers held under accumulation

    Inside `no_sync` no chunk reduces: each trainable chunk keeps its full-size
    buffer from one micro-batch to the next, all at once,
    $g_r \sum_{k \text{ trainable}} C_k$ bytes per rank, about $g_r \Psi_t$: not
    divided by $N_d$. From $N_d > (p + g + K) / g_r$ ranks on, that is more than
    the model states themselves. The shard gradient then receives one reduction
    per step. A chunk's held gradients are alive beside all of these buffers
    until its copy, so the backward pass holds $g_r \sum_k C_k + H$.
    """
    _check_at_least("grad_bytes", grad_bytes, 1)
    return layout.total_numel(trainable=True) * grad_bytes


def early_update_grads(layout: ChunkLayout, grad_bytes: int) -> int:
    r"""
    ## Gradients held by the early updates in flight

    With every shard updated during the backward pass and its gradient freed
    then, the gradient shards are never all alive; but a freed gradient is
    held until its update, queued on a side stream, has run. The engine lets
    at most $Q$ = `EARLY_UPDATES_IN_FLIGHT` of them queue (see [the early
    update](../optimizers/early_update.html), Note: why the early updates in
    flight are capped), so they hold at most

    $$E = Q\,g_e \max_{k \text{ trainable}} S_k$$

    bytes, $S_k$ the shard of chunk $k$ and $g_e$ = `grad_bytes` its gradient's
    bytes: fp32's 4, or the parameter dtype's on one rank (see Note: one rank
    keeps the parameter dtype). Zero when nothing trains. The largest is
    taken over every trainable shard, offloaded ones too (whose gradient waits
    for its copy down instead, not capped): a bound.
    """
    _check_at_least("grad_bytes", grad_bytes, 1)
    sizes = [layout.shard_numel(c) for c in layout.chunks if c.trainable]
    return EARLY_UPDATES_IN_FLIGHT * grad_bytes * max(sizes, default=0)
