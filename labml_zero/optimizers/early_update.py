r"""
---
title: Updating during the backward pass
summary: AdamFP16's update of each shard as soon as its gradient is final, on a
  side stream or the host worker, and how a non-finite gradient is caught there.
---

# Updating during the backward pass

This page deepens [AdamFP16](adam_fp16.html): with
`AdamFP16(update_during_backward=True)` a shard is updated as soon as its
chunk is reduced, while the backward pass goes on with the layers below, and
`step()` only waits for those updates. An early update cannot be undone, so a
gradient must not change after its update began (see Note: updating during
the backward pass).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from labml_zero.zero3.communication import OnStream, current_cuda_stream

from .host_offload import GradVersion
from .shard_home import ShardHome

# $Q$: the early updates (`AdamFP16(update_during_backward=True,
# free_grads=True)`) a rank lets queue on its update stream; `EarlyUpdates`
# waits for the oldest before queueing another, and [the gradient
# buffers](../planner/grad_buffers.html) count $Q$ gradients.
EARLY_UPDATES_IN_FLIGHT = 2


def _capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class NonFiniteGradient(RuntimeError):
    """An early update met a non-finite gradient (see Note: a non-finite
    gradient in an early update); a job may turn it into its own message."""


@dataclass
class EarlyUpdate:
    """
    ## An update run during the backward pass

    * `home`: the shard's [home](shard_home.html).
    * `grad`: the gradient it used, at its version then.
    * `done`: the host worker's future (offloaded shards), else `None`.
    * `found_inf`: 0-dim fp32 flag, 1 if the gradient was not finite and the
      update was skipped (a device tensor: reading it is a host sync).
    """

    home: ShardHome
    grad: GradVersion
    done: Future | None = None
    found_inf: torch.Tensor | None = None

    def flag_non_finite(self, grad: torch.Tensor) -> torch.Tensor:
        """
        #### `found_inf` of `grad`, as its home gives it

        Computed now on the device (`non_finite_flag`), or, for an offloaded
        shard, the flag that came down with the gradient.
        """
        self.found_inf = self.home.found_inf(grad)
        return self.found_inf


# `AdamFP16._apply`: one AdamW step of a list of homes, with `early` when it
# runs during the backward pass
Apply = Callable[..., None]


class _Passed:
    """The event of an update that ran at once (on the CPU): passed already."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        pass


PASSED = _Passed()


class UpdatesInFlight:
    r"""
    ## At most $Q$ early updates queued on the side stream

    #### Note: why the early updates in flight are capped

    With `free_grads` a shard's gradient is freed as soon as its update is
    queued on the side stream, but `record_stream` keeps the caching allocator
    from handing its block out again until that stream has run the update. The
    host queues the backward pass layer after layer, well ahead of the GPU, so
    without a bound the freed gradients still waiting for their update grow
    with how far the host runs ahead: a matter of timing, not of tensor sizes,
    which no memory model can count. So before queueing another update the host
    waits for the oldest one (a host sync) when $Q$ = `EARLY_UPDATES_IN_FLIGHT`
    are queued: at most $Q$ freed gradients wait at any moment, and the [memory
    model](../planner/grad_buffers.html) counts $Q$ of the largest
    (`early_update_grads`). With $Q = 2$ the host waits for the update of
    the chunk before the last one reduced, which the GPU has mostly run while
    the host queued the backward since, so the GPU's queue does not run dry.

    `make_room()` before an update is queued, `issued(event)` after its
    gradient was freed, with `event` recorded on the side stream behind it
    (`PASSED` for an update that ran at once, on the CPU); `clear()` once the
    compute stream has waited for the side stream. An event is anything with
    `query()` and `synchronize()`, so the tests drive the cap on a CPU with a
    stream that lags behind.

    While a step is captured as a CUDA graph the host cannot wait for an
    event, so the cap does not hold there; the graph's memory pool keeps every
    freed gradient until the capture ends instead.
    """

    def __init__(self, cap: int = EARLY_UPDATES_IN_FLIGHT):
        if cap < 1:
            raise ValueError(f"cap must be at least 1, got {cap}")
        self.cap = cap
        # events behind the queued updates, oldest first; events on one
        # stream pass in order
        self.events: collections.deque = collections.deque()

    def make_room(self) -> None:
        """Wait until fewer than `cap` updates are queued."""
        events = self.events
        while events and events[0].query():
            events.popleft()
        while len(events) >= self.cap:
            # host sync: the oldest queued update, and its freed gradient
            events.popleft().synchronize()

    def issued(self, event) -> None:
        self.events.append(event)

    def clear(self) -> None:
        self.events.clear()


class EarlyUpdates:
    """
    ## The early updates of one optimizer

    The update itself is `AdamFP16._apply`, the same path and operands as in
    `step()`; this class owns the bookkeeping around it, and the optimizer
    holds one and asks it: the updates in flight, the side stream they run on,
    the skip flags of gradients that were not finite, and the refusal of a
    gradient changed after its update began. Where an update runs is its
    shard's [home](shard_home.html)'s answer: on the host worker for a host
    home, else on the side stream (GPU) or at once (CPU).

    * `apply`: the optimizer's `_apply`, the one path every update takes.
    * `free_grads`: free each shard's gradient once its early update has
      consumed it (see `free_grad`).

    Lifecycle of one step: `start` for each shard as its gradient is final;
    at `step()`, `raise_if_skipped` (last step's flags), `check`, then
    `finish`, which ends the step's updates and empties `pending`.
    """

    def __init__(self, apply: Apply, *, free_grads: bool):
        self.apply = apply
        self.free_grads = free_grads
        # the updates run during this backward pass
        self.pending: dict[torch.Tensor, EarlyUpdate] = {}
        # (shards, their skip flags on the host, the flags' copy event) of the
        # last step's early updates on a GPU, read at the next `step()`
        self.unread_flags: list[tuple[list, torch.Tensor, object]] = []
        # the side stream of the device's early updates, made at the first one
        self.update_stream: torch.cuda.Stream | None = None
        # with `free_grads`, the device updates queued and not yet passed
        self.in_flight = UpdatesInFlight()

    def started(self, param: torch.Tensor) -> bool:
        """Whether `param`'s update already began in this backward pass."""
        return param in self.pending

    def start(self, home: ShardHome, grad: torch.Tensor, *, after=None) -> None:
        """
        ### Update one shard while the backward pass goes on

        A host home: on its worker. On a GPU: on a side stream that waits for
        `after` (the reduce-scatter); `step()` makes the compute stream wait for
        it. On CPU: here, the same kernel on the same operands as in `step()`.

        #### Note: updating during the backward pass

        A shard's gradient is final as soon as its chunk is reduced, and the output-end
        chunks are reduced first. The engine announces each final gradient
        (`grad_ready`, registered with `runtime.on_grad_ready`). With
        `update_during_backward=True` the shard is updated then: on a GPU on a side
        stream that waits for the reduce-scatter, so that the backward kernels of the
        layers below never queue behind it (the GPU runs its blocks where theirs leave
        room, and a GPU at its power limit lowers its clock for both); an offloaded
        shard on the host worker
        of [`HostOffload`](host_offload.html). `step()` only waits for them and updates
        the shards not updated yet. The update is the same, with the same operands, so:

        * it needs the final gradient at `grad_ready` time: clipping and loss-scale
          unscaling change the gradient in place afterwards. Each early update records
          its gradient's version (`GradVersion`), and `step()` raises if a gradient
          changed after its update, before updating anything;
        * it reads `lr` and the other hyperparameters when it runs: change them
          between `step()` and the next backward, as schedulers do.
        """
        param = home.param
        early = self.pending[param] = EarlyUpdate(home, GradVersion(grad))
        # A device update that frees its gradient is capped, on the CPU too
        # (trivially: it ran at once); not in a captured graph, whose events
        # the host cannot wait for.
        capped = (self.free_grads and home.worker is None
                  and not _capturing(param.device))
        if capped:
            # host sync while Q are queued: at most Q freed gradients wait
            # (see Note: why the early updates in flight are capped)
            self.in_flight.make_room()
        stream = None
        if home.worker is not None:
            early.done = home.worker.submit(
                lambda: self.apply([home], early=early))
        elif param.device.type != "cuda":
            self.apply([home], early=early)
        else:
            if self.update_stream is None:
                self.update_stream = torch.cuda.Stream(param.device)
            stream = self.update_stream
            # update stream waits: `after` wrote the gradient
            stream.wait_stream(after or current_cuda_stream(param.device.index))
            with OnStream(stream):
                self.apply([home], early=early)
            # the compute stream frees the gradient (at `zero_grad`, or below)
            grad.record_stream(stream)
        if self.free_grads:
            # see `free_grad`; a host home's copy down was queued in
            # `grad_ready`, before this
            self.free_grad(home)
        if capped:
            # recorded behind the update and the free of its gradient
            self.in_flight.issued(
                PASSED if stream is None else stream.record_event())

    @staticmethod
    def free_grad(home: ShardHome) -> None:
        r"""
        #### Free a gradient after its early update (`free_grads=True`)

        With `free_grads=True` (and `update_during_backward=True`) a shard's fp32
        gradient is let go as soon as its early update has consumed it: on the
        device once the update is queued on the side stream (`record_stream` keeps
        the allocator from reusing the block until that stream has read it), for an
        offloaded shard once its copy down is queued (the copy stream's
        `record_stream`; the host update then reads the staging buffer, which the
        copy down filled). The $4S$ bytes of fp32 gradient of all the shards,
        $4\Psi_t/N_d$, then never exist at once: only the chunks whose update is in
        flight hold one, at most $Q$ (see Note: why the early updates in flight
        are capped). The update and its operands are the same, so the losses are
        bit for bit those without it. The price: after `backward()` the gradients
        are gone, so nothing may read them before `step()`: no clipping and no
        loss scaler (they refuse, as their norm would count only the shards not
        yet freed), no gradient accumulation (a
        second backward makes new gradients, which `step()` refuses as for a changed
        one).
        """
        home.free_grad()

    ### At `step()`

    def check(self, state: dict) -> None:
        """
        #### Refuse an early update that used a gradient changed since

        Clipping, unscaling or a second backward pass changed the gradient after
        its update during the backward pass began; `state` as in `finish`.
        """
        for early in self.pending.values():
            grad = early.home.gradient()
            if grad is not None and not early.grad.matches(grad):
                self.finish(state, check_finite=False)
                raise RuntimeError(
                    "a shard's gradient changed after its update began, during "
                    "the backward pass (clipping, unscaling or a second "
                    "backward before step()?): use update_during_backward=False "
                    "with them")

    def finish(self, state: dict, *, check_finite: bool = True,
               capture=None) -> None:
        """
        #### Wait for the updates started during the backward pass

        `state` is the optimizer's, whose step counts a skipped update takes
        back. Then, see Note: a non-finite gradient in an early update. The
        step's updates are over: `pending` is empty after. While a step is
        captured as a CUDA graph, `capture` (the optimizer's
        [`CapturedUpdates`](captured_update.html)) keeps a GPU's flags: their
        copy to the host is queued after each replay, not recorded in it.
        """
        pending, self.pending = self.pending, {}
        for early in pending.values():
            if early.done is not None:
                # host sync: the worker's update and its upload are queued
                early.done.result()
        if self.update_stream is not None and pending:
            # compute stream waits: the next all-gather reads the new shards
            current_cuda_stream(self.update_stream.device_index).wait_stream(
                self.update_stream)
        self.in_flight.clear()
        flagged = [(p, e.found_inf) for p, e in pending.items()
                   if e.found_inf is not None]
        if not (check_finite and flagged):
            return
        # One small copy per device of all its flags, read at the next `step()`
        # or `shard_state()` instead of now: waiting for them here would stall
        # the host until the GPU finished the backward pass, and the next step's
        # launches would start late (a bubble every step). Nothing non-finite
        # was applied either way; only the error comes later.
        for device in {f.device for _, f in flagged}:
            on = [(p, f) for p, f in flagged if f.device == device]
            flags = torch.stack([f for _, f in on])
            if device.type == "cuda" and capture is not None:
                capture.hold_flags([p for p, _ in on], flags)
            elif device.type == "cuda":
                host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                host.copy_(flags, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self.unread_flags.append(([p for p, _ in on], host, event))
            else:
                self.unread_flags.append(([p for p, _ in on], flags, None))
        if any(event is None for _, _, event in self.unread_flags):
            # on the host the flags are already there: check at once
            self.raise_if_skipped(state)

    def raise_if_skipped(self, state: dict) -> None:
        """
        #### Raise if an early update of the last step was skipped

        ##### Note: a non-finite gradient in an early update

        An early update cannot be undone, and a step with a non-finite gradient must be
        skipped on every rank (the [loss scaler](grad_scaler.html)'s contract). So an
        early update first checks its gradient: the fused kernel takes a `found_inf`
        flag computed on the device from the gradient (no host sync) and leaves master,
        moments and shard untouched when it is set; the host update reads the flag that
        came down with its gradient (computed on the device, `non_finite_flag`).
        On the host `step()` then raises at once; on a GPU the flags are copied to the
        host behind the backward pass and read at the next `step()` or `shard_state()`
        (so before any checkpoint holds the step). It raises `NonFiniteGradient`, whose
        message gives how many shards' updates were skipped; their step counts are
        set back, so unchanged. `LossScaler.step` refuses
        an optimizer with `update_during_backward=True` outright: skipping a whole step
        is impossible once other shards were updated.
        """
        unread, self.unread_flags = self.unread_flags, []
        bad = []
        for params, flags, event in unread:
            if event is not None:
                # host sync: the flags' copy, queued a whole step ago
                event.synchronize()
            bad += [p for p, skipped in zip(params, flags.tolist()) if skipped]
        if bad:
            for param in bad:
                state[param]["step"] -= 1
            self.pending = {}
            raise NonFiniteGradient(
                f"{len(bad)} shard(s) got a non-finite gradient during the "
                "backward pass; their early update was skipped, but a step "
                "cannot be skipped on every rank once others were updated: use "
                "update_during_backward=False with a LossScaler")
