r"""
---
title: Global gradient-norm clipping over shards
summary: The norm of the whole model's gradient from its shards, with one all-reduce.
---

# Global gradient-norm clipping over shards

Clipping rescales the gradient $\mathbf{g}$ so that its norm is at most $c$:

$$\mathbf{g} \leftarrow \mathbf{g} \cdot \min\left(1, \frac{c}{\lVert \mathbf{g} \rVert_2 + 10^{-6}}\right)$$
(tested: tests/optimizers/test_clip_grad.py::test_clipping_is_the_formula_of_the_page)

exactly as `torch.nn.utils.clip_grad_norm_` does on an unsharded model
(tested: tests/optimizers/test_clip_grad.py::test_clipping_is_torchs_on_one_rank).
The norm is over *all* parameters, while each rank holds a shard of each.

The same sum of squares also reports the norm where nothing is clipped: an
update during the backward pass that frees each gradient adds the gradient's
squares as it consumes it (`ConsumedGradSquares`), since after `backward()`
there is nothing left to read.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from labml_zero.zero3.communication import Communicator
from labml_zero.zero3.shard import LocalShard, shard_grad


def shard_grads(shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of the shards that have one (a shard's fp32 `grad`, or an
    ordinary parameter's `.grad`): the tensors themselves, scaled in place, the
    very tensors `AdamFP16` consumes ([`LocalShard.grad`](../zero3/shard.html)).
    (labml-nn clipped the module's parameters, whose gradients the engine had
    already moved away: the clipping did nothing.)"""
    grads = [shard_grad(s) for s in shards]
    return [g for g in grads if g is not None]


def sum_of_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    r"""$\sum_i g_i^2$ over `grads`, a 0-dim fp64 tensor on their device; no
    host sync. Each tensor's norm is taken in fp32 whatever its dtype (a bf16
    gradient's norm in bf16 would keep 8 bits), then squared and summed in
    fp64."""
    norms = torch._foreach_norm(list(grads), 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


class ConsumedGradSquares:
    r"""
    ### The squares of the gradients an optimizer consumed

    `AdamFP16(free_grads=True)` frees each gradient as its update consumes it,
    so the step's $\lVert \mathbf{g} \rVert_2^2$ is summed where the update
    reads the gradient: `add` runs beside the update, on the update's stream
    or host thread, into one fp64 accumulator per device; `take`, after
    `step()` has waited for every update, returns the sum on one device and
    starts the next step's at zero. The accumulators are made once and kept,
    so a recorded step (a CUDA graph) adds into the same memory on every
    replay. A lock orders the host worker's adds against the main thread's
    (on a CPU both add into the CPU's accumulator).
    """

    def __init__(self):
        self.sums: dict[torch.device, torch.Tensor] = {}
        self.lock = threading.Lock()

    def add(self, grads: Sequence[torch.Tensor]) -> None:
        """Add the squares of `grads` (one device) to that device's sum."""
        if not grads:
            return
        squares = sum_of_squares(grads)
        with self.lock:
            total = self.sums.get(squares.device)
            if total is None:
                self.sums[squares.device] = squares.clone()
            else:
                total.add_(squares)

    def take(self, device: torch.device) -> torch.Tensor:
        """The sum of every `add` since the last `take`, 0-dim fp64 on
        `device`; the sums start again at zero."""
        out = torch.zeros((), dtype=torch.float64, device=device)
        with self.lock:
            for total in self.sums.values():
                out += total.to(device)
                total.zero_()
        return out


def check_readable(shards: Sequence[torch.Tensor], reader: str) -> None:
    """Refuse to read gradients that an update during the backward pass takes
    and frees (`AdamFP16(free_grads=True)`): after `backward()` most of them are
    gone, so a norm would count some shards and clipping would scale nothing."""
    if any((shard := LocalShard.of(s)) is not None and shard.grad_taken
           for s in shards):
        raise ValueError(f"{reader} reads the gradients after backward(), but "
                         "AdamFP16(free_grads=True) frees them during it: use "
                         "free_grads=False to clip or scale the loss")


def global_grad_norm(
    shards: Sequence[torch.Tensor], comm: Communicator
) -> torch.Tensor:
    r"""
    ### $\lVert \mathbf{g} \rVert_2$ over every rank's shards

    Each rank holds a disjoint shard of every trainable chunk, so the squared
    norm is a sum over ranks of the local sums of squares,

    $$\lVert \mathbf{g} \rVert_2^2 = \sum_{r=1}^{N_d} \sum_{i \in \text{shard}_r} g_i^2,$$

    one all-reduce of one scalar; padding is zero, so it adds nothing. A
    non-finite gradient makes the sum non-finite, so the same all-reduce also
    tells every rank whether any rank overflowed: the
    [loss scaler](grad_scaler.html) uses it instead of a collective of its own.
    A 0-dim fp32 tensor on the device; no host sync.
    """
    check_readable(shards, "the gradient norm (clipping, the loss scaler)")
    grads = shard_grads(shards)
    if grads:
        # Σ_i g_i² on this rank
        local = sum_of_squares(grads).float()
    else:
        local = torch.zeros((), dtype=torch.float32, device=comm.device)
    comm.all_reduce(local)
    return local.sqrt()


def clip_grad_norm_(
    shards: Sequence[torch.Tensor],
    max_norm: float,
    comm: Communicator,
    *,
    norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    ### Clip the shards' gradients to a global norm of `max_norm`

    Returns the norm before clipping. `norm` skips the all-reduce when the caller
    has already computed it (the loss scaler does).
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    check_readable(shards, "clipping")
    if norm is None:
        norm = global_grad_norm(shards, comm)
    # min(1, c / (‖g‖ + 1e-6)) on the device: no host sync
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = shard_grads(shards)
    if grads:
        torch._foreach_mul_(grads, coefficient)
    return norm
