r"""
---
title: The whole step as one CUDA graph
summary: Record a training step's kernels once and replay them, so that the host's
  Python, hooks and launches no longer set the pace of a small model's step.
---

# The whole step as one CUDA graph

A GPU runs what the host queues. For a small model each kernel is short, and the
host's work per kernel (Python, the engine's hooks, autograd, the launch itself)
can take as long as the kernel: the GPU then waits between kernels. With $k$
kernels a step, host time $h$ per kernel and device time $d_i$ for kernel $i$,
an eager step takes about

$$T_\text{eager} \approx \max\Big(k\,h,\ \sum_i d_i\Big),$$

plus the time the host runs ahead of the device at the start of the step (the
bench starts every step on an idle device).
"""

from __future__ import annotations

from typing import Callable

import torch

from labml_zero.zero3.communication import CommCounter

from .adam_fp16 import AdamFP16
from .captured_update import CapturedUpdates

__all__ = ["GraphedStep", "CaptureFailed"]


class CaptureFailed(RuntimeError):
    """The step could not be recorded as one CUDA graph; the message names
    the cause."""


class GraphedStep:
    r"""
    ## A training step recorded once and replayed

    A CUDA graph records the kernels of one step, with their arguments and the
    memory they use, and launches them all with one call
    (`CUDAGraph.replay`): the host's share falls to one launch, and

    $$T_\text{graph} \approx \sum_i d_i + k\,\delta,$$

    with $\delta$ the device's own gap between two kernels of a graph, about a
    microsecond.

    * `step(batch) -> loss`: one whole training step (forward, backward,
      `optimizer.step()`, `zero_grad()`), returning the 0-dim loss;
    * `optimizer`: the `AdamFP16` the step updates with;
    * `warmup`: eager calls before the capture (at least one);
    * `counter`: the communicator's counter, so that the collectives of a
      replay, which no Python code launches, are counted as the capture's.

    Calls before the capture, the capture and each replay all train: every
    call is one step.

    The graph holds the forward pass with its all-gathers, the backward pass
    with its reduce-scatters, the optimizer's updates, on every stream they use.
    A replay runs the same kernels on the same memory, so everything that
    changes between steps must be in device memory that the host refills before
    each replay:

    * the batch: each call copies it into the graph's own input tensor;
    * the learning rate and the step counts of the update: the optimizer reads
      them from device tensors while the step is recorded ([the update inside a
      captured step](captured_update.html));
    * the loss: the graph writes it to its own output tensor, copied out for the
      caller.

    The memory a step allocates is the graph's for as long as it lives (a
    private pool of the caching allocator): the same bytes the eager step peaks
    at, kept.
    """

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor],
                 optimizer: AdamFP16, *, warmup: int = 2,
                 counter: CommCounter | None = None):
        """
        #### When a step can be recorded

        A capture records kernels; it does not run them, and the host must not
        wait for the device while it records. So the step cannot contain a host
        sync (`.item()`, a loss scaler's overflow check, printing a tensor), an
        optimizer state in host memory (its update runs on a host thread), or a
        batch whose shape changes. What can be told before the capture is
        refused here (host homes, the `foreach` update); a capture that fails
        names its cause. Activation recomputation, host offload, loss scaling
        and clipping are not captured (each waits on the host, or recomputes
        under a random state the capture would have to own). Collectives over
        NCCL only (gloo has no graphs); one device per process.
        """
        if warmup < 1:
            raise ValueError(f"GraphedStep's warmup must be at least 1 (the "
                             f"optimizer's state is made outside the graph), "
                             f"got {warmup}")
        if optimizer.homes.host:
            raise ValueError(
                f"GraphedStep cannot record a step whose optimizer keeps "
                f"{len(optimizer.homes.host)} shard(s) in host memory (their "
                "update runs on a host thread): offload nothing")
        if not optimizer.fused:
            raise ValueError("GraphedStep needs AdamFP16's fused kernel (the "
                             "foreach update computes its bias corrections on "
                             "the host)")
        self.step = step
        self.optimizer = optimizer
        self.warmup = warmup
        self.counter = counter
        self.eager_calls = 0
        # the recorded step: its input and output tensors, the graph (`None`
        # on a CPU, whose twin re-runs `step`) and the collectives it runs
        self.batch: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.counted: CommCounter | None = None
        # the optimizer's side of the recorded step, while it holds it
        self.recorded: CapturedUpdates | None = None

    @property
    def captured(self) -> bool:
        """Whether a recorded step is replayed now: the optimizer still holds
        this step's capture."""
        return (self.recorded is not None
                and self.optimizer.capture is self.recorded)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """The first `warmup` calls run eagerly: they allocate the optimizer's
        state, NCCL's communicators and cuBLAS's workspaces outside the graph,
        and the engine learns its prefetch order. A recorded step whose
        capture the optimizer let go (a load replaced the tensors it
        updates, see the Note: a load ends a captured step, in [a shard's
        optimizer state](shard_state.html)) is dropped, and the calls warm
        up and record again."""
        if self.captured:
            return self._replay(batch)
        if self.recorded is not None:
            self.drop()
        if self.eager_calls < self.warmup:
            self.eager_calls += 1
            return self.step(batch)
        return self._capture(batch)

    ### Recording

    def _capture(self, batch: torch.Tensor) -> torch.Tensor:
        r"""
        ### Record the step, then run it once

        Last step's unread flags are read first (the capture must not wait on
        the device). On a GPU the step is recorded on the capture's stream and
        then replayed; on a CPU the twin runs it at once.

        #### The CPU twin

        There is no graph on a CPU. There the step is re-run eagerly in the same
        mode: the optimizer reads $\alpha$ and $t$ from the same tensors, the
        host's step counts are set by the same bookkeeping, and the early
        updates' flags take the same path; only the kernels are launched again
        instead of replayed. The tests compare both with the plain step, bit for
        bit on CPU, and on a GPU when `LABML_ZERO_TEST_DEVICE=cuda`.
        """
        optimizer = self.optimizer
        optimizer.early_updates.raise_if_skipped(optimizer.state)
        self.batch = batch.clone()
        capture = CapturedUpdates(optimizer.param_groups, batch.device)
        optimizer.capture = self.recorded = capture
        if batch.device.type != "cuda":
            try:
                self.loss = self.step(self.batch)
                capture.end_recording()
                capture.replayed(optimizer.state, optimizer.early_updates)
            except BaseException:
                self.drop()
                raise
            return self.loss
        before = _counts(self.counter)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self.loss = self.step(self.batch)
        except Exception as failure:
            self.drop()
            raise capture_failed(failure) from failure
        # the capture ran nothing: what it counted is what each replay runs,
        # and the first replay (just below) is the first to run it
        self.counted = _difference(_counts(self.counter), before)
        _restore(self.counter, before)
        capture.end_recording()
        return self._launch()

    def drop(self) -> None:
        """Forget the recorded step; the next calls warm up and record again."""
        if self.optimizer.capture is self.recorded:
            self.optimizer.capture = None
        self.graph = self.batch = self.loss = self.counted = None
        self.recorded = None
        self.eager_calls = 0

    ### Replaying

    def _replay(self, batch: torch.Tensor) -> torch.Tensor:
        expected = self.batch
        if (batch.shape, batch.dtype, batch.device) != (
                expected.shape, expected.dtype, expected.device):
            raise ValueError(
                f"GraphedStep recorded batches of shape {list(expected.shape)} "
                f"{expected.dtype} on {expected.device}; got "
                f"{list(batch.shape)} {batch.dtype} on {batch.device}")
        self.batch.copy_(batch)
        return self._launch()

    def _launch(self) -> torch.Tensor:
        r"""
        ### One replay and its bookkeeping

        Refill $\alpha$ and $r$, replay (on a CPU: re-run), then the host's
        bookkeeping: step counts, the flags of the last replay, the counter.
        A failure drops the graph: its step counts and flags no longer agree
        with the host's.
        """
        capture = self.recorded
        try:
            capture.before_replay(self.optimizer.param_groups)
            if self.graph is None:
                loss = self.step(self.batch)
            else:
                self.graph.replay()
                loss = self.loss.clone()
                _add(self.counter, self.counted)
            capture.replayed(self.optimizer.state, self.optimizer.early_updates)
        except BaseException:
            self.drop()
            raise
        return loss


def capture_failed(failure: BaseException) -> CaptureFailed:
    """
    The error a failed capture raises: it names the first error of the chain,
    not the invalidated capture's errors that followed it. A failed capture
    leaves CUDA's random number generator in its capture state for the rest of
    the process (PyTorch cannot undo it): after `CaptureFailed` the run ends,
    and is started again without the graph.
    """
    cause = failure
    while cause.__context__ is not None:
        cause = cause.__context__
    return CaptureFailed(
        "the training step could not be recorded as one CUDA graph "
        f"({type(cause).__name__}: {_first_line(cause)}); a "
        "step that waits on the host (.item(), a loss scaler, "
        "printing a tensor) cannot be: start the run again without "
        "the graph")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "no message"


def _counts(counter: CommCounter | None) -> CommCounter | None:
    if counter is None:
        return None
    return CommCounter(dict(counter.calls), dict(counter.elements),
                       dict(counter.bytes))


def _difference(after: CommCounter | None,
                before: CommCounter | None) -> CommCounter | None:
    """What the capture counted: the collectives each replay runs."""
    if after is None:
        return None
    return CommCounter(*({k: v - old.get(k, 0) for k, v in new.items()}
                         for new, old in ((after.calls, before.calls),
                                          (after.elements, before.elements),
                                          (after.bytes, before.bytes))))


def _restore(counter: CommCounter | None, saved: CommCounter | None) -> None:
    if counter is None:
        return
    for mine, theirs in ((counter.calls, saved.calls),
                         (counter.elements, saved.elements),
                         (counter.bytes, saved.bytes)):
        mine.clear()
        mine.update(theirs)


def _add(counter: CommCounter | None, counted: CommCounter | None) -> None:
    if counter is None or counted is None:
        return
    for mine, theirs in ((counter.calls, counted.calls),
                         (counter.elements, counted.elements),
                         (counter.bytes, counted.bytes)):
        for kind, value in theirs.items():
            mine[kind] = mine.get(kind, 0) + value
