r"""
---
title: The step's scalars on the device
summary: The step count and the one-pass kernels' coefficients as device
  tensors, made once a step for every shard on a device and stream, or read
  from a captured step's tensors.
---

# The step's scalars on the device

This page deepens [AdamFP16](adam_fp16.html). The fused and one-pass kernels
read the step count $t$ and, for the one-pass kernels, the coefficients of
`rounded_update.step_coefficients` (from $t$, $\alpha$, $\beta_1$, $\beta_2$
and the weight decay) from device tensors rather than Python numbers, so that
[a captured step](captured_update.html) can refill them between replays. Every
shard of one step on one device reads the same values, so each is made once a
step, not once a shard: with $S$ shards a step fills one tensor where it would
fill $S$.
"""

from __future__ import annotations

import torch

from labml_zero.zero3.communication import current_cuda_stream

from . import rounded_update
from .captured_update import CapturedUpdates

__all__ = ["StepScalars", "stream_of"]


def stream_of(device: torch.device):
    """The stream a device tensor made now is written on (`None` on CPU): the
    tensors are kept per stream, which reads what it wrote."""
    return current_cuda_stream(device.index) if device.type == "cuda" else None


class StepScalars:
    """
    ## The scalars of the current step, per device and stream

    The only owner of both caches; `capture`, when given, is the captured
    step whose tensors stand in for them (its replays refill those).
    """

    def __init__(self):
        # (step, 0-dim step tensor) per (device, stream)
        self._steps: dict[tuple, tuple[int, torch.Tensor]] = {}
        # (step and hyperparameters, `[3]` coefficients) per (device, stream,
        # group)
        self._coefficients: dict[tuple, tuple[tuple, torch.Tensor]] = {}

    def step(self, device: torch.device, step: int,
             capture: CapturedUpdates | None) -> torch.Tensor:
        """$t$ as a 0-dim tensor; the kernels only read it, so the shards of a
        step share it."""
        stream = stream_of(device)
        if capture is not None:
            return capture.step_tensor(stream, step)
        held = self._steps.get((device, stream))
        if held is None or held[0] != step:
            held = (step, torch.full((), float(step), device=device))
            self._steps[(device, stream)] = held
        return held[1]

    def coefficients(self, device: torch.device, group_index: int, group: dict,
                     step: int, capture: CapturedUpdates | None) -> torch.Tensor:
        r"""
        `rounded_update.step_coefficients` of this step's $t$ and $\alpha$ for
        param group `group_index`, computed once per step, group and stream;
        in a captured step at every call, from the tensors the graph reads.
        A change of the group's learning rate or hyperparameters within a step
        makes them again.
        """
        beta1, beta2 = group["betas"]
        hyper = dict(beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])
        steps = self.step(device, step, capture)
        if capture is not None:
            return rounded_update.step_coefficients(
                steps, capture.lr(group_index), **hyper)
        stream = stream_of(device)
        key = (step, group["lr"], *hyper.values())
        held = self._coefficients.get((device, stream, group_index))
        if held is None or held[0] != key:
            # $\alpha$ as each fused kernel reads it (`CapturedUpdates.lrs`):
            # fp32 on a GPU, fp64 on a CPU
            dtype = torch.float32 if device.type == "cuda" else torch.float64
            lr = torch.full((), float(group["lr"]), device=device, dtype=dtype)
            held = (key, rounded_update.step_coefficients(steps, lr, **hyper))
            self._coefficients[(device, stream, group_index)] = held
        return held[1]
