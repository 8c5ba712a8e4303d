r"""
---
title: Measuring a training step
summary: Step time, peak memory, and the share of a step spent waiting on collectives,
  read from a profiler trace.
---

# Measuring a training step

Every engine hands the benchmark one function, `step(batch) -> loss`, that runs
forward, backward and the optimizer step. This page times it and reads what the
step waited for.

## Step time

The device is synchronised before and after each step, so a step's time is from
the host's launch of its first kernel to the end of its last. Warm-up steps are
run first and not counted: they allocate the caching allocator's blocks, create
NCCL communicators and pick cuDNN/cuBLAS algorithms. The mean and standard
deviation are over the timed steps; tokens per second are those of all ranks over
the mean step time.

## The host's share

A step bound by the host is one whose kernels wait for their launches. Two
figures tell: `host_s`, the time from a step's start until `step()` returns
on the main thread, before the synchronisation (the host's issue time; close
to the step time when the host sets the pace), and, in the profiled step,
`device_ops`, the kernels, copies and memsets it launched. The garbage
collector runs on the main thread whenever enough objects were allocated, and
a full collection walks every live object: each timed step counts its
collections and their time (`gc_ms`). With `gc_freeze` (the default) every
object alive after the warm-up steps is moved out of the collector's reach
(`gc.freeze()`), the same for every engine, so a collection walks only what
the steps themselves allocate.

## Waiting on communication

One more step runs under `torch.profiler` (after the timed steps, so the profiler
does not slow the timed ones). From its trace, on a GPU,

* *communication* $C$: the union of the time intervals in which an NCCL kernel
  runs, on any stream (with `--peer-gather`, also the copies from the other
  GPU and the barrier kernels around them);
* *computation* $K$: the union of the intervals of every other kernel, copy and
  memset;
* *exposed communication* $C \setminus K$: time in which the GPU moves data but
  computes nothing, that is, time the computation waits for a collective.

We report $|C \setminus K|$ over the profiled step's wall time as `comm_exposed`,
$|C|$ over it as `comm_total`, and the time with no kernel at all as `gpu_idle`
(launch gaps, host syncs, the CPU falling behind). A perfectly overlapped engine
has `comm_exposed` near 0 however large `comm_total` is.

An NCCL kernel starts spinning as soon as its stream reaches it and moves
data only once every rank's kernel has started, so a rank that is ahead waits
inside the collective for the others: `comm_exposed` also counts a peer that
is *late*, which is imbalance between the ranks (a host that launches slower,
a profiler that slows one rank more than the other), not the cost of moving
bytes. To tell the two apart, the ranks exchange the start times of their
NCCL kernels (the $k$-th all-gather of one rank is the $k$-th of every other:
one communicator runs its collectives in order), and each kernel's interval is
cut to start when the last rank's started, $[\max_r s^{(r)}_k, e_k)$; the
exposed share of these intervals is `comm_exposed_transfer`, and the rest of
`comm_exposed` is time spent waiting for a late peer.

On CPU with gloo every collective is synchronous: the calling thread blocks while
gloo's worker thread runs it (the `gloo:*` ranges of the trace), so all of it is
exposed.

## Limitations

* An NCCL kernel also spins while it waits for the other rank to arrive, so load
  imbalance between ranks shows up as communication.
* Kernel start times of different GPUs are compared on the host's clock,
  to which the profiler converts each GPU's timestamps: a few microseconds of
  error, against collectives of tens of microseconds or more.
* The profiled step is one sample, and the profiler adds a little launch overhead
  (the share is of that step's own wall time, so it stays consistent).
* `max_memory_allocated` counts the caching allocator's live tensors, not its
  reserved blocks nor NCCL's own buffers.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

Interval = tuple[float, float]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        # host sync: the step's kernels must be done before the clock is read
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class StepTimes:
    """
    ## Timed steps

    * `times_s`: seconds of each timed step.
    * `loss`: the loss of the last step, as a float (one host sync at the end).
    """

    times_s: tuple[float, ...]
    loss: float
    host_s: tuple[float, ...] = ()
    """Per step, the host's issue time: from the start until `step()` returns."""
    gc_collections: int = 0
    """Garbage collections during the timed steps, all generations."""
    gc_ms: float = 0.0
    """Their total time."""
    wall_window: tuple[float, float] = (0.0, 0.0)
    """`time.time()` at the start of the first timed step and the end of the
    last, to pick the [GPU clock samples](gpu_clocks.html) of the timed steps."""

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.times_s)

    @property
    def std_s(self) -> float:
        return statistics.stdev(self.times_s) if len(self.times_s) > 1 else 0.0


class GcWatch:
    """
    #### Count the garbage collector's runs and their time

    Through `gc.callbacks`, which the collector calls at the start and the end
    of every collection, on the thread that triggered it.
    """

    def __init__(self):
        self.collections = 0
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections += 1
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def time_steps(
    step: Callable[[torch.Tensor], torch.Tensor],
    batches: Sequence[torch.Tensor],
    *,
    warmup: int,
    steps: int,
    device: torch.device,
    gc_freeze: bool = True,
) -> StepTimes:
    """
    ### Run `warmup` untimed and `steps` timed steps

    `batches` are cycled; the loss is read only after the last step, so no step
    but the last waits for a `.item()`. With `gc_freeze`, the objects alive
    after the warm-up are frozen (see The host's share) and unfrozen at the end.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    loss = None
    for i in range(warmup):
        loss = step(batches[i % len(batches)])
    if gc_freeze:
        gc.collect()
        gc.freeze()
    times, host = [], []
    wall_start = time.time()
    try:
        with GcWatch() as watch:
            for i in range(steps):
                synchronize(device)
                start = time.perf_counter()
                loss = step(batches[(warmup + i) % len(batches)])
                host.append(time.perf_counter() - start)
                synchronize(device)
                times.append(time.perf_counter() - start)
    finally:
        if gc_freeze:
            gc.unfreeze()
    wall_end = time.time()
    # host sync: .item()
    return StepTimes(tuple(times), float(loss.detach().float().item()),
                     host_s=tuple(host), gc_collections=watch.collections,
                     gc_ms=1e3 * watch.seconds, wall_window=(wall_start, wall_end))


# ## Communication share


@dataclass(frozen=True)
class CommShare:
    """
    ## Where one profiled step spent its time

    Shares of `step_s`, the profiled step's wall time.
    """

    step_s: float
    comm_total: float
    """$|C|$ / step: any collective running."""
    comm_exposed: float
    """$|C \\setminus K|$ / step: a collective running and nothing else."""
    gpu_idle: float | None
    """No kernel at all / step; `None` on CPU."""
    comm_exposed_transfer: float | None = None
    """Exposed, counting each collective only from when every rank had started
    it / step; `None` on CPU or with one rank."""
    device_ops: int | None = None
    """Kernels, copies and memsets the step ran; `None` on CPU."""


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into disjoint, sorted ones."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """`a \\ b` for disjoint sorted interval lists (two-pointer sweep)."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def is_communication(name: str, category: str) -> bool:
    """
    An NCCL kernel; or, for gathers from peer memory, a copy from another GPU
    (`Memcpy PtoP`) or the barrier kernel of PyTorch's symmetric memory.
    """
    lowered = name.lower()
    return ("nccl" in lowered or "barrier_kernel" in lowered
            or (category == "gpu_memcpy" and "ptop" in lowered))


def classify(events: Iterable[dict], *, on_gpu: bool) -> tuple[list, list]:
    """
    #### Split trace events into communication and computation intervals (µs)

    On a GPU: device events, NCCL kernels being communication. On CPU: gloo's
    `gloo:*` ranges are communication and the other operators computation, except
    the `c10d::` operators that only hand work to gloo.
    """
    comm, compute = [], []
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        interval = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        name, category = event.get("name", ""), event.get("cat", "")
        if on_gpu:
            if category not in DEVICE_CATEGORIES:
                continue
            (comm if is_communication(name, category) else compute).append(interval)
        elif name.startswith("gloo:"):
            comm.append(interval)
        elif category == "cpu_op" and not name.startswith("c10d::"):
            compute.append(interval)
    return comm, compute


def nccl_kernels(events: Iterable[dict]) -> dict[str, list[Interval]]:
    """NCCL kernel intervals (µs) by kernel name, each list in start order."""
    kernels: dict[str, list[Interval]] = {}
    for event in events:
        if (event.get("ph") == "X" and "dur" in event
                and event.get("cat") in DEVICE_CATEGORIES
                and "nccl" in event.get("name", "").lower()):
            start = float(event["ts"])
            kernels.setdefault(event["name"], []).append(
                (start, start + float(event["dur"])))
    return {name: sorted(found) for name, found in kernels.items()}


def peer_copies(events: Iterable[dict]) -> list[Interval]:
    """Intervals (µs) of copies from another GPU's memory."""
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
            if e.get("ph") == "X" and "dur" in e and e.get("cat") == "gpu_memcpy"
            and "ptop" in e.get("name", "").lower()]


def after_arrival(kernels: dict[str, list[Interval]],
                  starts: Sequence[dict[str, list[float]]]) -> list[Interval] | None:
    """
    #### Each collective from the moment every rank had started it

    `starts` are the kernel start times of every rank, by name, from
    `nccl_kernels`. `None` when the ranks ran different collectives.
    """
    clipped = []
    for name, intervals in kernels.items():
        others = [rank.get(name, []) for rank in starts]
        if any(len(o) != len(intervals) for o in others):
            return None
        for k, (start, end) in enumerate(intervals):
            arrived = max([start] + [o[k] for o in others])
            if arrived < end:
                clipped.append((arrived, end))
    return clipped


def profile_comm(
    step: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    *,
    device: torch.device,
    keep_trace: str | None = None,
    exchange: Callable[[dict], list[dict]] | None = None,
) -> CommShare:
    """
    ### Profile one step and measure its exposed communication

    `keep_trace` is a path to keep the Chrome trace at (for `bench.timeline`).
    `exchange(mine)` returns every rank's value of `mine` (an all-gather of
    objects); with it, on a GPU, `comm_exposed_transfer` is measured too.
    """
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step(batch)
        synchronize(device)
        step_s = time.perf_counter() - start
    # The chrome trace is the profiler's stable, documented output format.
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        if keep_trace:
            shutil.move(path, keep_trace)
        else:
            os.remove(path)
    comm, compute = classify(events, on_gpu=on_gpu)
    comm, compute = union(comm), union(compute)
    step_us = step_s * 1e6
    idle = transfer = device_ops = None
    if on_gpu:
        device_ops = sum(1 for e in events if e.get("ph") == "X"
                         and e.get("cat") in DEVICE_CATEGORIES)
        idle = max(0.0, 1.0 - length(union(comm + compute)) / step_us)
        if exchange is not None:
            kernels = nccl_kernels(events)
            # every rank takes part, whatever it found
            starts = exchange({name: [start for start, _ in intervals]
                               for name, intervals in kernels.items()})
            arrived = after_arrival(kernels, starts)
            if arrived is not None:
                # a copy from a peer starts only after its barrier, when every
                # rank has arrived: all of it is transfer
                arrived += peer_copies(events)
                transfer = length(subtract(union(arrived), compute)) / step_us
    return CommShare(
        step_s=step_s,
        comm_total=length(comm) / step_us,
        comm_exposed=length(subtract(comm, compute)) / step_us,
        gpu_idle=idle,
        comm_exposed_transfer=transfer,
        device_ops=device_ops,
    )


def peak_memory(device: torch.device, *, uncounted: int = 0) -> int | None:
    """
    `max_memory_allocated` in bytes since the last reset, plus `uncounted`
    bytes the caching allocator does not see (peer memory); `None` on CPU.
    """
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) + uncounted


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a non-finite loss is written as `null` plus a flag."""
    return value if math.isfinite(value) else None
