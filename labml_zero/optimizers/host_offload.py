r"""
---
title: Optimizer state in host memory
summary: Staging buffers, copy streams and the host worker that let AdamFP16 keep
  the optimizer states of chosen shards in host memory.
---

# Optimizer state in host memory

Of the $p + 4 + K$ bytes a trainable element costs a ZeRO-3 rank ($p$ of
bf16 shard, 4 of fp32 gradient, $K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
of master and moments with fp32 [states](../zero3/state_layout.html)), the
optimizer's $K$ are touched once per step and by the update alone. This page
moves them, shard by shard, to host memory and runs the update there
({{term: offload}}), as ColossalAI's Gemini and ZeRO-Offload do; where each
chunk keeps its states is the model's {{term: placement}}
([its page](../planner/placement.html)). An offloaded element moves $4 + p$
bytes a step: its fp32 gradient down, its new master (without a master, its
new weight) up in the shard's dtype.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from labml_zero.zero3.communication import OnStream, current_cuda_stream


def non_finite_flag(grad: torch.Tensor) -> torch.Tensor:
    r"""
    ## `found_inf`: 0-dim fp32, one when `grad` has an inf or a nan

    Computed on the device, sent down with the gradient.

    An update during the backward pass skips a non-finite gradient (see the
    [early updates](early_update.html)); this is its flag. The largest
    $|g|$, $m$, is non-finite exactly then (a nan propagates through the
    max): one read of the gradient, no temporary, where `isfinite(g).all()`
    also writes and reads a bool copy. Then $0 \cdot m$ is $0$ for a finite
    $m$ and nan for an infinite or nan one, which `nan_to_num_` turns into
    the flag's one: two more kernels on a 0-dim tensor, where `isfinite`, `~`
    and a cast to fp32 are three.
    (tested: tests/optimizers/test_early_update.py::test_non_finite_flag)

    For an offloaded shard it is computed on the device, beside the copy
    down (`HostOffload.copy_down`): there it is one read of the gradient at
    the device's bandwidth, beside the backward pass, where on the host it
    would be one more pass over the gradient in the host's update, which
    bounds a step with many offloaded elements.
    """
    # 0-dim, in the gradient's dtype: the largest |g| is one of its values,
    # exact in any dtype, and the reduction reads the gradient as it is
    largest = torch.linalg.vector_norm(grad, float("inf"))
    # 0-dim fp32, the dtype the fused kernel's flag must have
    return largest.float().mul_(0.0).nan_to_num_(nan=1.0)


def update_threads(share: int) -> int:
    """
    ## The host update's intra-op threads

    The host runs the same kernel as the device (`torch._fused_adamw_` has a
    CPU implementation), spread over these threads.

    The rank's share of the cores but one, for the thread that runs the
    backward pass beside it (see Note: threads of the host update); at least
    one.
    """
    return max(1, share - 1)


def _use_threads(count: int) -> None:
    """
    The worker thread's initializer: its own kernels split over `count`
    threads. OpenMP keeps the count per calling thread; torch sets a thread's
    count from the process's at the thread's first parallel kernel, so that
    first kernel (`get_num_threads`) runs before the count is set.
    """
    torch.get_num_threads()
    torch.set_num_threads(count)


class GradVersion:
    """
    ## Which gradient, at which version

    A weak reference to a gradient tensor and its version counter: `matches(g)`
    says whether `g` is that tensor, unchanged. A weak reference, so that the
    record never keeps a gradient alive.
    """

    def __init__(self, grad: torch.Tensor):
        self.source = weakref.ref(grad)
        self.version = grad._version

    def matches(self, grad: torch.Tensor | None) -> bool:
        return (grad is not None and self.source() is grad
                and self.version == grad._version)


class HostShard:
    """
    ## What an offloaded shard keeps besides its optimizer state

    * `staging` [S] fp32 in the parameter's shape (a flat shard's: [S]),
      pinned when the gradient is on CUDA: the gradient after the copy down,
      then (viewed in the shard dtype) the rounded master going up.
    * `grad_ready`: event after the copy down (`None` on CPU, or none queued).
    * `uploaded`: event after the copy up; the next copy down waits for it.
    * `copied`: which gradient, at which version, `staging` holds.
    * `found_inf`: `[]` fp32 on the host, pinned like `staging`: the
      `non_finite_flag` of the gradient `staging` holds, copied down with it.

    The device saves $K$ bytes per element; the host holds $K + 4$: the state and a
    *staging buffer* of $4S$ bytes, which holds the gradient after its copy down
    and then, once the update has consumed it, the $pS$ bytes of the rounded master
    going up (without a master, of the updated weight, whose copy the host
    keeps beside the state: $p$ more, see the [home](shard_home.html)).
    """

    def __init__(self, param: torch.Tensor, *, pin: bool):
        # [S] fp32 on the host, shaped as the update's other operands (a
        # plain parameter's may be N-d, or 0-d), contiguous
        self.staging = torch.empty(param.shape, dtype=torch.float32,
                                   pin_memory=pin)
        self.found_inf = torch.zeros((), dtype=torch.float32, pin_memory=pin)
        self.grad_ready: torch.cuda.Event | None = None
        self.uploaded: torch.cuda.Event | None = None
        self.copied: GradVersion | None = None

    def holds(self, grad: torch.Tensor | None) -> bool:
        """Whether `staging` is a copy of `grad` as it is now."""
        return self.copied is not None and self.copied.matches(grad)


class HostOffload:
    """
    ## The copy streams and the worker that the offloaded shards share

    Down go the fp32 gradient, 4 bytes an element; up goes the new master
    rounded on the host to the shard dtype, $p$ bytes (half the bytes of
    sending fp32 and casting on the device).

    * `devices`: the GPUs of the offloaded shards' gradients (at most one;
      none on CPU, where the copies are plain ones).
    * `worker`: run updates on a worker thread (`submit`), for updates during
      the backward pass.

    ### Note: pinned memory and copy streams

    Only the staging buffer is page-locked ("pinned", when the shard's gradient
    is on a GPU, `grad_device`): DMA needs it, while the master and moments are
    read by the CPU only, and pinned memory is scarce (it cannot be swapped).
    Copies run on two side streams, one per direction, so the copy engines move
    both ways at once:

    1. `copy_down(host, grad, after=stream)` queues the gradient's copy as soon
       as `stream` (the engine's reduce stream) has written it, and records an
       event;
    2. `host_grad(host, grad)` waits for that event (a host sync) and returns
       the staging buffer, copying again if the gradient changed since;
    3. `upload(host, param, master)` rounds into the staging buffer and queues
       the copy up; the next copy down waits (on the device) for it, and
       `wait_uploads()` makes the compute stream wait for every copy up, so the
       next all-gather reads new shards.

    A gradient changed after its copy down (loss-scale unscaling, clipping and
    accumulation all work in place) is copied again: a `GradVersion` remembers
    the tensor and its version counter, which every in-place op bumps. On CPU
    (tests) "host" and "device" are the same memory, yet the same path is
    taken, with plain synchronous copies into separate tensors.

    Each offloaded shard has a host [home](shard_home.html), which holds its
    `HostShard` (the staging buffer and its events); `HostOffload` holds what they
    share, the copy streams and the worker, and moves the bytes.

    Device and host kernels need not round alike (FMA contraction, vector widths):
    on a GPU an offloaded shard follows AdamW within fp32 rounding, not necessarily
    bitwise like its device twin.

    CI runs the CPU path, which shares everything but the copies; the CUDA path
    (side streams, pinned staging, events) is tested on a GPU with
    `LABML_ZERO_TEST_DEVICE=cuda`.
    """

    def __init__(self, devices: Iterable[torch.device], *, worker: bool):
        devices = set(devices)
        if len(devices) > 1:
            raise ValueError(f"offloaded shards must be on one GPU, got {devices}")
        # One side stream per direction (see Note: pinned memory and copy
        # streams); none when no offloaded shard is on a GPU (plain copies).
        self.down_stream = self.up_stream = None
        for device in devices:
            self.down_stream = torch.cuda.Stream(device, priority=-1)
            self.up_stream = torch.cuda.Stream(device, priority=-1)
        # whether a copy up was queued since the last `wait_uploads`
        self.uploads_queued = False
        # One worker: the updates run in the order their gradients came (see
        # Note: threads of the host update).
        self.worker = None
        if worker:
            share = torch.get_num_threads()
            self.worker = ThreadPoolExecutor(
                1, thread_name_prefix="adam-host", initializer=_use_threads,
                initargs=(update_threads(share),))
            # the initializer runs with the first task: run it now, then give
            # this thread (and threads made later) the rank's share back
            self.worker.submit(lambda: None).result()
            torch.set_num_threads(share)

    ### Down

    def copy_down(self, host: HostShard, grad: torch.Tensor, *,
                  after=None) -> None:
        """
        ### Queue the copy of `grad` into the shard's staging buffer

        `after` is the CUDA stream that wrote `grad` (default: the current
        one). Nothing to do if the buffer already holds it.
        """
        if host.holds(grad):
            return
        host.copied = None
        if self.down_stream is None:
            host.staging.copy_(grad)
            host.found_inf.copy_(non_finite_flag(grad))
            host.copied = GradVersion(grad)
            return
        stream = self.down_stream
        # copy stream waits: `after` wrote the gradient
        stream.wait_stream(after or current_cuda_stream(grad.device.index))
        if host.uploaded is not None:
            # copy stream waits: last step's upload still reads `staging`
            stream.wait_event(host.uploaded)
        with OnStream(stream):
            host.staging.copy_(grad, non_blocking=True)
            # the flag on the device, down with the gradient (see
            # `non_finite_flag`); the temporary is this stream's
            host.found_inf.copy_(non_finite_flag(grad), non_blocking=True)
        # the compute stream may free the gradient (zero_grad) while it is copied
        grad.record_stream(stream)
        host.grad_ready = torch.cuda.Event()
        host.grad_ready.record(stream)
        host.copied = GradVersion(grad)

    def host_grad(self, host: HostShard,
                  grad: torch.Tensor | None) -> torch.Tensor:
        """
        ### `[S]` fp32 gradient on the host, once its copy down has landed

        Its flag, `host.found_inf`, has landed with it.

        Copies `grad` down first when the staging buffer does not hold it as
        it is now (not copied yet, or changed in place since). `grad=None`:
        the device gradient was freed after its copy down was queued
        (`AdamFP16(free_grads=True)`), so the staging buffer is the gradient.
        """
        if grad is not None:
            self.copy_down(host, grad)
        elif host.copied is None:
            raise RuntimeError("an offloaded shard has neither a gradient nor "
                               "a copy of one on the host")
        if host.grad_ready is not None:
            # host sync: the update reads what the copy engine wrote
            host.grad_ready.synchronize()
            host.grad_ready = None
        return host.staging

    ### Up

    def upload(self, host: HostShard, param: torch.Tensor,
               master: torch.Tensor) -> None:
        """
        ### Round the master on the host and copy it up into the shard

        The rounded copy goes into the staging buffer, whose gradient the
        update has consumed: $p S$ bytes of its $4 S$.
        """
        # [S] shard dtype in the shard's shape, a view of the staging
        # buffer's first p·S bytes
        rounded = host.staging.view(-1).view(param.dtype)[: param.numel()]
        rounded = rounded.view(param.shape)
        rounded.copy_(master)
        host.copied = None
        if self.up_stream is None:
            param.data.copy_(rounded)
            return
        # copy stream waits: the compute stream may still read the old shard
        self.up_stream.wait_stream(current_cuda_stream(param.device.index))
        with OnStream(self.up_stream):
            param.data.copy_(rounded, non_blocking=True)
        host.uploaded = torch.cuda.Event()
        host.uploaded.record(self.up_stream)
        self.uploads_queued = True

    def wait_uploads(self) -> None:
        """The compute stream waits for the copies up queued since the last
        call: the next gather reads them. Nothing to wait for, nothing done."""
        if not self.uploads_queued:
            return
        self.uploads_queued = False
        current_cuda_stream(self.up_stream.device_index).wait_stream(
            self.up_stream)

    ### The worker

    def submit(self, update: Callable[[], None]) -> Future:
        r"""
        ### Run `update` on the worker thread, in submission order

        #### Note: threads of the host update

        The CPU kernels split each shard over torch's intra-op threads. Every
        rank is its own process and by default takes one thread per core, so
        $N_d$ ranks on one host oversubscribe the cores $N_d$ times over; give
        each `torch.set_num_threads(cores // ranks_per_host)`, its share. The
        update is memory-bound, so more threads than the memory channels can
        feed buy little. For an update during the backward pass
        (`AdamFP16(update_during_backward=True)`) this one worker thread runs
        the host updates in the order the gradients came, while another
        thread goes on running the backward pass (PyTorch's CPU kernels
        release the GIL).

        That thread needs a core of its own, so the worker's kernels take
        one thread fewer than the share (`update_threads`). On a GPU it is
        always runnable: it runs the hooks and the recomputed forward passes,
        and it waits for the device (a launch into a full queue, a
        synchronisation) by spinning, CUDA's default scheduling where the
        host has more cores than GPUs in use. An intra-op kernel
        splits its elements evenly over its threads and ends when the last
        one does, so if the update took every core, the thread that shares
        its core with the backward pass's would run at half speed and hold
        the whole update up to twice as long; one thread fewer costs at most
        $1/\text{share}$ of its speed, less where memory bandwidth bounds it.
        """
        assert self.worker is not None, "built without a worker"
        return self.worker.submit(update)
