r"""
---
title: The update inside a captured step
summary: What AdamFP16 reads from device tensors instead of Python numbers while
  its step is recorded as a CUDA graph, and the bookkeeping each replay does on
  the host.
---

# The update inside a captured step

This page deepens [AdamFP16](adam_fp16.html) for [the step as one CUDA
graph](graphed_step.html). A replay runs the captured kernels on the same
memory, with every Python-number argument frozen at its capture value, yet the
step count $t$ of each shard (in the bias corrections $1 - \beta_1^t$ and
$1 - \beta_2^t$) and the learning rate $\alpha$ (a schedule's) change from step
to step. So the update reads both from device tensors the host refills before
every replay; with $t_c$ a shard's step count during the capture and $r$ the
replays done before this one, replay $r$ uses

$$t = t_c + r.$$
"""

from __future__ import annotations

import torch

from .early_update import EarlyUpdates

# the hyperparameters a graph freezes at its capture: $\beta_1$, $\beta_2$,
# $\epsilon$ and the weight decay; `before_replay` refuses a change of them
FROZEN = ("betas", "eps", "weight_decay")


class CapturedUpdates:
    """
    ## The optimizer's side of a captured step

    `param_groups` are the optimizer's; `device` the shards'. Made by
    [`GraphedStep`](graphed_step.html) just before its capture and
    installed as `AdamFP16.capture`; everything here is read or refilled
    around each replay, never inside it. Only device homes and the fused
    kernel: a host home's update runs on a host thread, and the `foreach` path
    computes the bias corrections on the host.
    """

    def __init__(self, param_groups: list[dict], device: torch.device):
        self.device = device
        # $\alpha$ of each group, refilled from `group["lr"]` before each
        # replay, in the precision each fused kernel computes with: the host's
        # in fp64, the GPU's in fp32, so that a replay rounds as an eager step
        lr_dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.lrs = [torch.full((), float(g["lr"]), device=device, dtype=lr_dtype)
                    for g in param_groups]
        # $r$, the replays done before the one about to run
        self.replays = torch.zeros((), device=device)
        self.done = 0
        # $t_c$ of each shard updated in the capture
        self.capture_steps: dict[torch.Tensor, int] = {}
        # $t_c + r$ per (stream, $t_c$), made once during the capture
        self.step_tensors: dict[tuple, torch.Tensor] = {}
        # (shards, their flags on the device) of the captured early updates,
        # with the pinned buffer each replay copies them into
        self.flags: list[tuple[list, torch.Tensor]] = []
        self.host_flags: list[torch.Tensor] = []
        self.frozen = [{k: g[k] for k in FROZEN} for g in param_groups]
        # True while the capture records; False while a CPU twin re-runs it
        self.recording = True

    ### During the capture

    def step_of(self, param: torch.Tensor, state: dict) -> int:
        r"""
        #### $t_c$ of `param`'s update

        Recording, the count goes up as in an eager step and is remembered; a
        re-run (the CPU twin of a replay) reads the remembered one, and
        `replayed` sets the count.
        """
        if self.recording:
            state["step"] += 1
            self.capture_steps[param] = state["step"]
        return self.capture_steps[param]

    def step_tensor(self, stream, step: int) -> torch.Tensor:
        r"""$t_c + r$ on the device, for the fused kernel (one per stream and
        $t_c$; every shard updated there reads the same one)."""
        key = (stream, step)
        tensor = self.step_tensors.get(key)
        if tensor is None or not self.recording:
            tensor = self.step_tensors[key] = self.replays + step
        return tensor

    def lr(self, group_index: int) -> torch.Tensor:
        r"""$\alpha$ of a group, as a device tensor the kernel reads."""
        return self.lrs[group_index]

    def hold_flags(self, params: list, flags: torch.Tensor) -> None:
        """The early updates' flags of the captured step, copied down after
        each replay instead of inside it. The non-finite flags of the updates
        during the backward pass (see Note: a non-finite gradient in an early
        update) are device tensors of the graph; after each replay one copy
        brings them to a pinned host buffer, read after the next replay is
        queued, as the eager step reads them at the next `step()`."""
        self.flags.append((params, flags))

    def end_recording(self) -> None:
        """The capture is over: the pinned buffers of the flags' copies."""
        self.recording = False
        self.host_flags = [torch.empty(f.shape, dtype=f.dtype, pin_memory=True)
                           for _, f in self.flags]

    ### Around each replay

    def before_replay(self, param_groups: list[dict]) -> None:
        r"""
        #### Refill $\alpha$ and $r$

        Two small fills on the current stream, which the graph's first kernels
        follow. A frozen hyperparameter that changed is refused: the graph
        would keep using the old one.
        """
        for index, (group, frozen) in enumerate(zip(param_groups, self.frozen)):
            changed = [k for k in FROZEN if group[k] != frozen[k]]
            if changed:
                raise ValueError(
                    f"param group {index}'s {changed[0]} changed from "
                    f"{frozen[changed[0]]} to {group[changed[0]]} after the step "
                    "was captured as a CUDA graph, which keeps the old value: "
                    "make a new GraphedStep")
            self.lrs[index].fill_(float(group["lr"]))
        self.replays.fill_(float(self.done))

    def replayed(self, state: dict, early_updates: EarlyUpdates) -> None:
        r"""
        #### The host's bookkeeping of one replay

        Each updated shard's count becomes $t_c + r$: the host's copy, which
        checkpoints save, follows the device's formula, one owner (the
        optimizer's `state`) and one formula. The last replay's flags
        are read (the host waits for that replay, while this one runs on the
        device), then this replay's are queued for the next call.
        """
        for param, step in self.capture_steps.items():
            state[param]["step"] = step + self.done
        self.done += 1
        early_updates.raise_if_skipped(state)
        for (params, flags), host in zip(self.flags, self.host_flags):
            if flags.device.type == "cuda":
                host.copy_(flags, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                early_updates.unread_flags.append((params, host, event))
