r"""
---
title: Adam with fp32 master weights (AdamFP16)
summary: AdamW on flat shards, fp32 masters and moments (on the device or the
  host), written back in 16 bits.
---

# Adam with fp32 master weights

The update is exactly `torch.optim.AdamW`'s (decoupled weight decay, $\epsilon$
added to the bias-corrected $\sqrt{v}$). With gradient $g_t$, learning rate
$\alpha$, weight decay $\lambda$:

\begin{align}
\theta &\leftarrow \theta (1 - \alpha \lambda) \\
m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
\theta &\leftarrow \theta - \frac{\alpha}{1 - \beta_1^t} \cdot
  \frac{m_t}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon}
\end{align}

with $\theta$ the fp32 master, $m$ and $v$ fp32, and the 16-bit parameter set to
$\theta$ rounded after each step.

## Where each piece lives

* The parameters handed to `AdamFP16` are the flat 16-bit shards of the trainable
  chunks (`model.get_trainable_chunk()`).
* Their gradients are in `param.main_grad` (fp32, averaged over ranks by the
  reduce-scatter); a plain `param.grad` is used where there is no `main_grad`, so
  the optimizer also works on ordinary parameters.
* The master starts from `param.master_init` when the engine left one (the
  original fp32 weights of a 16-bit chunk), otherwise from the parameter itself.
  An fp32 parameter *is* its own master: no copy, $K = 8$ extra bytes.

Each step is one pass over all shards, however many chunks there are: PyTorch's
fused AdamW kernel (`torch._fused_adamw_`, one kernel that reads $\theta, g, m, v$
once and writes $\theta, m, v$ once; it exists for CPU and CUDA) when available,
else the same update as a sequence of `foreach` multi-tensor kernels (each a full
pass over the state: about three times the memory traffic). Both are tested
against `torch.optim.AdamW`.

## Note: optimizer state in host memory

Of the $2 + 4 + K = 18$ bytes a trainable element costs a ZeRO-3 rank (16-bit
shard, fp32 `main_grad`, $K = 12$ of master and moments), the optimizer's $K$ are
touched once per step and by the update alone. `offload=` moves them, shard by
shard, to host memory and runs the update there, as ColossalAI's Gemini and
ZeRO-Offload do ([which shards](../zero3/placement.html)). Per offloaded element
and step:

* **down** (device to host): the fp32 gradient, 4 bytes;
* **the update** on the host: the same kernel as on the device
  (`torch._fused_adamw_` has a CPU implementation; the `foreach` fallback runs
  on CPU tensors too), multi-threaded by torch's intra-op thread pool
  (`torch.get_num_threads()`, one thread per core by default);
* **up** (host to device): the new master rounded on the host to the shard
  dtype, $p$ bytes (2 for bf16: half the bytes of sending fp32 and casting on
  the device).

The device saves $K = 12$ bytes per element (8 for an fp32 shard: its master
was the shard itself and now becomes a host copy); the host holds $12 + 4$ (the
gradient's staging buffer, which the upload reuses: after the update the
gradient is dead, and its $4S$ bytes hold the $pS$ of the rounded master).

When the engine keeps the parameter shard itself in host memory
(`Chunk.offload_shard`, its `grad_device` naming where `main_grad` is), the
update rounds the master straight into it, and nothing goes up: the next gather
copies the shard up itself.

Only the staging buffer is page-locked ("pinned", when CUDA is available):
DMA needs it, while the master and moments are read by the CPU only, and pinned
memory is scarce (it cannot be swapped, and PyTorch's host caching allocator
rounds each block up). Copies run on two side streams owned by the optimizer,
one per direction, so the copy engines can move both ways at once:

1. `prefetch_grad(shard, after=stream)` queues the gradient's copy down as
   soon as `stream` (the reduce stream) has written it, and records an event;
   `step()` does it for any shard not prefetched;
2. `step()` first launches the device shards' update (asynchronous), then for
   each offloaded shard, last first, waits for its event (a host sync), updates
   on the host, rounds into the staging buffer and queues the copy up;
3. the copy down of the *next* step waits (on the device) for that copy up,
   which still reads the staging buffer; the compute stream waits for every
   copy up before `step()` returns, so the next all-gather reads new shards.

A gradient changed after its prefetch (loss-scale unscaling, clipping,
accumulation all work in place on `main_grad`) is copied again: the prefetch
remembers the tensor and its version counter, which every in-place op bumps.

### Updating during the backward pass

Run after the backward pass, the host's update adds its whole time to the step
(for GPT-NeoX-20B with 40% of the state offloaded, about 4 billion elements
per rank: seconds). Yet an offloaded shard's gradient is final as soon as its
chunk is reduced, and the output-end chunks, the ones offloaded, are reduced
first. With `update_during_backward=True`, `prefetch_grad` also hands the
shard to a worker thread, which waits for the copy down, updates on the host
and queues the copy up, while the main thread goes on launching the rest of
the backward pass (PyTorch's CPU kernels release the GIL). `step()` then only
waits for the worker. The update is the same, with the same operands:

* it needs the final gradient at `prefetch_grad` time, so it is for steps
  without clipping or loss-scale unscaling (they change the gradient in place
  afterwards): `step()` raises if a gradient changed after its early update,
  instead of silently having used the old one;
* it reads `lr` and the other hyperparameters when the worker runs: change them
  between `step()` and the next backward, as schedulers do.

Measured on the benchmark's W5 (GPT-NeoX-20B, 4.1 billion offloaded elements
per rank, 2×H200, 16 host threads per rank): 4.49 s per step with the host's
update after the backward pass, 3.07 s with it during the backward pass.

The same reasoning holds for the shards on the device. Their update reads and
writes about 30 bytes per element ($\theta$, $m$, $v$ in fp32 both ways, the
fp32 gradient, the 16-bit shard), a memory-bound pass; from the bytes alone,
$30 \cdot 3.45 \cdot 10^9 / 4\,\text{TB/s} \approx 26$ ms per step for
Pythia-6.9B on 2 ranks, about 6% of its step, were it to run alone. The engine
announces each final gradient (`grad_ready`, called as its chunk is reduced), and
with `update_during_backward=True` the shard's update is queued then on a side
stream of the optimizer that waits for the reduce-scatter, so it runs beside
the backward kernels of the layers below (which are bound by arithmetic, not by
memory). Only the chunks reduced last, at the input end, still update after the
backward pass.

Threads: the CPU kernels split each shard over torch's intra-op threads. Every
rank is its own process and by default takes one thread per core, so $N$ ranks
on one host oversubscribe the cores $N$ times over; give each
`torch.set_num_threads(cores // ranks_per_host)`. The update is memory-bound
(about 28 bytes read and written per element), so more threads than the memory
channels can feed buy little.

Checkpoints read and write `state[shard]` with the usual keys (`master`,
`exp_avg`, `exp_avg_sq`: host tensors here; `step`: an int). A state loaded onto
the device is copied back to the host at the next step, and `state_device(shard)`
says where a loader should put it to avoid that detour.

On CPU (tests) "host" and "device" are the same memory, yet the offloaded path
is taken all the same, with plain synchronous copies into separate tensors;
the tests check that it gives bitwise the same masters and shards as the
device path.

## Limitations

* No AMSGrad, no `maximize`, no capturable (CUDA graph) mode.
* Offloaded updates run one shard at a time on the host; they overlap the
  backward pass only with `update_during_backward` (not with clipping, which
  needs the global norm first).
* A prefetched gradient that is unscaled or clipped afterwards is copied again,
  so with a loss scaler or clipping the prefetch saves nothing yet; passing the
  scale to the kernel (`grad_scale=`) instead would keep it.
* Device and host kernels need not round alike (FMA contraction, vector
  widths): on a GPU an offloaded shard follows AdamW within fp32 rounding, but
  not necessarily bitwise like its device twin.
* CI runs the CPU path, which shares everything but the copies; the CUDA path
  (side streams, pinned staging, events) is tested on a GPU with
  `LABML_ZERO_TEST_DEVICE=cuda`.
"""

from __future__ import annotations

import math
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Collection, Iterable

import torch


OffloadRule = Callable[[int, torch.Tensor], bool]


def grad_device(param: torch.Tensor) -> torch.device:
    """Where `param`'s gradient lives: its own device, unless the engine keeps the
    shard in host memory and says otherwise (`grad_device`)."""
    return getattr(param, "grad_device", param.device)


class HostShard:
    """
    ## What an offloaded shard keeps besides its optimizer state

    * `staging` [S] fp32, pinned when CUDA is available: the gradient after the
      copy down, then (viewed in the shard dtype) the rounded master going up.
    * `grad_ready`: event after the copy down (`None` on CPU, or none queued).
    * `uploaded`: event after the copy up; the next copy down waits for it.
    * `source`, `version`: which `main_grad`, at which version, `staging`
      holds; a weak reference, so a prefetch never keeps a gradient alive.
    """

    def __init__(self, param: torch.Tensor, *, pin: bool):
        # [S] fp32 on the host
        self.staging = torch.empty(param.numel(), dtype=torch.float32,
                                   pin_memory=pin)
        self.grad_ready: torch.cuda.Event | None = None
        self.uploaded: torch.cuda.Event | None = None
        self.source: weakref.ref | None = None
        self.version = -1

    def holds(self, grad: torch.Tensor) -> bool:
        """Whether `staging` is a copy of `grad` as it is now."""
        return (self.source is not None and self.source() is grad
                and self.version == grad._version)


class AdamFP16(torch.optim.Optimizer):
    """
    ## The optimizer

    * `params`: the shards (or any parameters) to update, or param groups.
    * `lr`, `betas`, `eps`, `weight_decay`: as in `torch.optim.AdamW`; the default
      `weight_decay=0.0` keeps labml-nn's `AdamFP16(params, lr=...)` an Adam.
    * `fused`: use the fused kernel (default: where available) or `foreach` ops.
    * `offload`: which shards keep master and moments in host memory (see Note:
      optimizer state in host memory): positions in the list of all parameters,
      group after group (for `model.get_trainable_chunk()`, the trainable
      chunks in order; `Placement.optimizer_on_host` gives them), or a function
      `(position, param) -> bool`; `None` keeps everything on the device.
    * `update_during_backward`: update each shard as soon as `grad_ready`
      (or, for an offloaded one, `prefetch_grad`) is called for it (see Updating
      during the backward pass).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        fused: bool | None = None,
        offload: Collection[int] | OffloadRule | None = None,
        update_during_backward: bool = False,
    ):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        # None: the fused kernel where this PyTorch has it
        self.fused = hasattr(torch, "_fused_adamw_") if fused is None else fused
        if self.fused and not hasattr(torch, "_fused_adamw_"):
            raise ValueError("fused=True needs torch._fused_adamw_ (PyTorch >= 2.4)")
        self.host: dict[torch.Tensor, HostShard] = self._place(offload)
        # the param group of each shard, for an update on its own (offloaded, or
        # during the backward pass)
        self.group_of = {p: group for group in self.param_groups
                         for p in group["params"]}
        devices = {grad_device(p) for p in self.host if grad_device(p).type == "cuda"}
        if len(devices) > 1:
            raise ValueError(f"offloaded shards must be on one GPU, got {devices}")
        # One side stream per direction, so both copy engines can run at once;
        # none when no offloaded shard is on a GPU (CPU: plain copies).
        self.down_stream = self.up_stream = None
        for device in devices:
            self.down_stream = torch.cuda.Stream(device, priority=-1)
            self.up_stream = torch.cuda.Stream(device, priority=-1)
        # Offloaded shards get their host state now: the engine's fp32
        # `master_init` (4 bytes per element on the device) moves to the host at
        # once instead of waiting on the device through the first step, when the
        # gradients and activations are also there.
        for param in self.host:
            self.init_state(param)
        # One worker: the shards' updates run in the order their gradients came,
        # each spread over torch's intra-op threads.
        self.worker = (ThreadPoolExecutor(1, thread_name_prefix="adam-host")
                       if update_during_backward and self.host else None)
        self.early: dict[torch.Tensor, Future] = {}
        self.update_during_backward = update_during_backward
        # device shards updated during this backward pass: (gradient, its version)
        self.early_on_device: dict[torch.Tensor, tuple[weakref.ref, int]] = {}
        # the side stream of those updates, made at the first one on a GPU
        self.update_stream: torch.cuda.Stream | None = None

    def _place(self, offload) -> dict[torch.Tensor, HostShard]:
        """#### Resolve `offload` into the offloaded parameters, in list order"""
        params = [p for group in self.param_groups for p in group["params"]]
        if offload is None:
            return {}
        if callable(offload):
            chosen = [i for i, p in enumerate(params) if offload(i, p)]
        else:
            chosen = sorted(set(offload))
            bad = [i for i in chosen if not 0 <= i < len(params)]
            if bad:
                raise ValueError(f"offload names parameter {bad[0]}, but the "
                                 f"optimizer has {len(params)} (0 to "
                                 f"{len(params) - 1})")
        # pinned staging only where a DMA engine will read or write it
        return {params[i]: HostShard(params[i],
                                     pin=grad_device(params[i]).type == "cuda")
                for i in chosen}

    def state_device(self, param: torch.Tensor) -> torch.device:
        """Where `param`'s master and moments belong (for checkpoint loading)."""
        return torch.device("cpu") if param in self.host else param.device

    @staticmethod
    def gradient(param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 gradient the engine left, or the ordinary one."""
        grad = getattr(param, "main_grad", None)
        if grad is None and param.grad is not None:
            grad = param.grad.float()
        return grad

    def init_state(self, param: torch.Tensor) -> dict:
        """
        ### The state of one shard

        `master` [S] fp32, `exp_avg` [S] fp32, `exp_avg_sq` [S] fp32, `step`;
        host tensors for an offloaded shard, whose master never aliases it.
        """
        state = self.state[param]
        if state:
            if param in self.host:
                self._move_to_host(param, state)
            return state
        master = getattr(param, "master_init", None)
        if master is not None:
            # The exact fp32 weights; the 16-bit shard is a rounding of them.
            del param.master_init
        elif param.dtype == torch.float32 and param not in self.host:
            master = param.data
        else:
            master = param.detach().float()
        if param in self.host:
            # [S] fp32 on the host; copy=True: on CPU an fp32 shard is already
            # there, and its master must still be a tensor of its own
            master = master.to("cpu", torch.float32, copy=True)
        state["step"] = 0
        state["master"] = master
        state["exp_avg"] = torch.zeros_like(master)
        state["exp_avg_sq"] = torch.zeros_like(master)
        return state

    @staticmethod
    def _move_to_host(param: torch.Tensor, state: dict) -> None:
        """
        #### Bring a state loaded onto the device back to the host

        `load_checkpoint` installs master and moments on the shard's device (an
        fp32 shard's master as the shard itself); copies, then, so that the
        device memory is freed and the master does not alias the shard.
        """
        for key in ("master", "exp_avg", "exp_avg_sq"):
            t = state[key]
            if t.device.type != "cpu" or t.data_ptr() == param.data_ptr():
                state[key] = t.to("cpu", torch.float32, copy=True)

    ### A gradient is final

    def grad_ready(self, param: torch.Tensor, *, after=None) -> None:
        """
        ### `param`'s gradient is final for this step

        The engine calls this as each chunk is reduced (`runtime.grad_ready`),
        with `after` the stream that wrote `main_grad`. An offloaded shard starts
        its copy down (`prefetch_grad`); with `update_during_backward`, a device
        shard is updated at once (see Updating during the backward pass).
        """
        if param in self.host:
            self.prefetch_grad(param, after=after)
        elif self.update_during_backward:
            self._update_early_on_device(param, after=after)

    def _update_early_on_device(self, param: torch.Tensor, *, after=None) -> None:
        """
        #### Update a device shard while the backward pass goes on

        On a GPU the update is queued on a side stream that waits for `after`
        (the reduce-scatter), so it runs beside the backward kernels of the
        layers below; `step()` makes the compute stream wait for it. On CPU it
        runs here, the same kernel on the same operands as in `step()`.
        """
        grad = getattr(param, "main_grad", None)
        if grad is None or param in self.early_on_device:
            # a second backward before `step()`: `step()` will see the gradient
            # changed after the update and refuse it
            return
        group = self._group_of(param)
        self.early_on_device[param] = (weakref.ref(grad), grad._version)
        if param.device.type != "cuda":
            self._device_step(param, group)
            return
        if self.update_stream is None:
            self.update_stream = torch.cuda.Stream(param.device)
        stream = self.update_stream
        # update stream waits: `after` wrote the gradient
        stream.wait_stream(after or torch.cuda.current_stream(param.device))
        with torch.cuda.stream(stream):
            self._device_step(param, group)
        # the compute stream frees the gradient at `zero_grad`
        grad.record_stream(stream)

    def _device_step(self, param: torch.Tensor, group: dict) -> None:
        state = self.init_state(param)
        state["step"] += 1
        self._update([param], state["step"], group)

    def _group_of(self, param: torch.Tensor) -> dict:
        group = self.group_of.get(param)
        if group is None:
            # a group added after construction (`add_param_group`)
            for candidate in self.param_groups:
                if any(p is param for p in candidate["params"]):
                    group = self.group_of[param] = candidate
                    break
            else:
                raise ValueError("the parameter is not one of this optimizer's")
        return group

    ### Copies of offloaded shards

    def prefetch_grad(self, param: torch.Tensor, *, after=None) -> None:
        """
        ### Start copying an offloaded shard's gradient to the host

        Call as soon as `main_grad` is final, with `after` the CUDA stream that
        wrote it (the engine's reduce stream; default: the current stream). Does
        nothing for a shard on the device or without a gradient; `step()` copies
        again any gradient changed since.
        """
        host = self.host.get(param)
        grad = getattr(param, "main_grad", None)
        if host is None or grad is None or host.holds(grad):
            return
        self._copy_down(host, grad, after=after)
        host.source, host.version = weakref.ref(grad), grad._version
        if self.worker is not None and param not in self.early:
            self.early[param] = self.worker.submit(self._host_step, param)

    def _host_step(self, param: torch.Tensor) -> None:
        """#### One offloaded shard's whole step (on the worker, or in `step()`)"""
        state = self.init_state(param)
        state["step"] += 1
        self._update([param], state["step"], self._group_of(param),
                     grads=[self._host_gradient(param)])

    def _copy_down(self, host: HostShard, grad: torch.Tensor, *, after=None) -> None:
        """#### Queue the copy of `grad` into the staging buffer"""
        host.source = None
        if self.down_stream is None:
            host.staging.copy_(grad)
            return
        stream = self.down_stream
        # copy stream waits: `after` wrote the gradient
        stream.wait_stream(after or torch.cuda.current_stream(grad.device))
        if host.uploaded is not None:
            # copy stream waits: last step's upload still reads `staging`
            stream.wait_event(host.uploaded)
        with torch.cuda.stream(stream):
            host.staging.copy_(grad, non_blocking=True)
        # the compute stream may free the gradient (zero_grad) while it is copied
        grad.record_stream(stream)
        host.grad_ready = torch.cuda.Event()
        host.grad_ready.record(stream)

    def _host_gradient(self, param: torch.Tensor) -> torch.Tensor:
        """#### The gradient on the host, once its copy down has landed"""
        host = self.host[param]
        main_grad = getattr(param, "main_grad", None)
        if main_grad is None:
            # an ordinary parameter's `.grad`, a new fp32 tensor each time
            self._copy_down(host, self.gradient(param))
        elif not host.holds(main_grad):
            # not prefetched, or changed in place since (unscale, clip)
            self.prefetch_grad(param)
        if host.grad_ready is not None:
            # host sync: the update reads what the copy engine wrote
            host.grad_ready.synchronize()
            host.grad_ready = None
        # [S] fp32 on the host
        return host.staging

    def _upload(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """
        #### Round the master on the host and copy it up into the shard

        The rounded copy goes into the staging buffer, whose gradient the
        update has consumed: $p S$ bytes of its $4 S$.
        """
        host = self.host[param]
        # [S] shard dtype, a view of the staging buffer's first p·S bytes
        if hasattr(param, "grad_device"):
            # a shard the engine keeps in host memory (`Chunk.offload_shard`):
            # round into it; its next gather copies it up
            param.data.copy_(master)
            return
        rounded = host.staging.view(param.dtype)[: param.numel()]
        rounded.copy_(master)
        if self.up_stream is None:
            param.data.copy_(rounded)
            return
        # copy stream waits: the compute stream may still read the old shard
        self.up_stream.wait_stream(torch.cuda.current_stream(param.device))
        with torch.cuda.stream(self.up_stream):
            param.data.copy_(rounded, non_blocking=True)
        host.uploaded = torch.cuda.Event()
        host.uploaded.record(self.up_stream)

    ### The step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # before any update: a step must not stop half done
        self._check_early_on_device()
        offloaded: list[torch.Tensor] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if self.gradient(p) is not None]
            # Shards that have taken the same number of steps share one bias
            # correction, so they can share one foreach pass.
            by_step: dict[int, list[torch.Tensor]] = {}
            for param in params:
                if param in self.host:
                    offloaded.append(param)
                    continue
                if param in self.early_on_device:
                    continue
                state = self.init_state(param)
                state["step"] += 1
                by_step.setdefault(state["step"], []).append(param)
            # Device updates first: they are queued and run while the host works.
            for step, same_step in by_step.items():
                self._update(same_step, step, group)
        self._finish_early()
        self._finish_early_on_device()
        # Last first: in backward their gradients were final first.
        late = [p for p in reversed(offloaded) if p not in self.early]
        for param in late:
            self._host_step(param)
        self.early = {}
        if self.up_stream is not None and offloaded:
            # compute stream waits: the next all-gather reads the new shards
            torch.cuda.current_stream(self.up_stream.device).wait_stream(
                self.up_stream)
        return loss

    def _finish_early(self) -> None:
        """
        #### Wait for the updates started during the backward pass

        Raises when a gradient changed in place after its update began (clipping
        or unscaling with `update_during_backward`): that update used the old
        gradient.
        """
        for param, done in self.early.items():
            # host sync: the worker's update and its upload are queued
            done.result()
            grad = getattr(param, "main_grad", None)
            if grad is not None and not self.host[param].holds(grad):
                raise RuntimeError(
                    "an offloaded shard's gradient changed after its update "
                    "began (clipping or unscaling?): use "
                    "update_during_backward=False with them")

    def _check_early_on_device(self) -> None:
        """
        #### Refuse a device update that used a gradient changed since

        As `_finish_early` does for offloaded shards: clipping, unscaling or a
        second backward pass changed the gradient after its update began.
        """
        for param, (source, version) in self.early_on_device.items():
            grad = getattr(param, "main_grad", None)
            if grad is not None and (source() is not grad
                                     or grad._version != version):
                self._finish_early_on_device()
                raise RuntimeError(
                    "a shard's gradient changed after its update during the "
                    "backward pass (clipping, unscaling or a second backward "
                    "before step()?): use update_during_backward=False with them")

    def _finish_early_on_device(self) -> None:
        """#### Order the device updates of the backward pass before what follows"""
        early, self.early_on_device = self.early_on_device, {}
        if early and self.update_stream is not None:
            # compute stream waits: the next all-gather reads the new shards
            torch.cuda.current_stream(self.update_stream.device).wait_stream(
                self.update_stream)

    def _update(self, params: list[torch.Tensor], step: int, group: dict, *,
                grads: list[torch.Tensor] | None = None) -> None:
        """
        ### One AdamW step over shards with the same step count

        Shards with the same step share the bias corrections, so one kernel
        launch (or one foreach sequence) covers them all. `grads` replaces the
        shards' own gradients (the host copies of an offloaded shard's).
        """
        lr, (beta1, beta2) = group["lr"], group["betas"]
        states = [self.state[p] for p in params]
        masters = [s["master"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        if grads is None:
            grads = [self.gradient(p) for p in params]

        if self.fused:
            # The kernel reads the (already incremented) step from a tensor.
            steps = [torch.full((), float(step), device=m.device) for m in masters]
            torch._fused_adamw_(
                masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                eps=group["eps"], amsgrad=False, maximize=False,
            )
        else:
            self._update_foreach(masters, grads, exp_avgs, exp_avg_sqs, step, group)

        if params[0] in self.host:
            for param, master in zip(params, masters):
                self._upload(param, master)
            return
        # Write back the rounded master; the next all-gather spreads it.
        pairs = [(p, m) for p, m in zip(params, masters)
                 if m.data_ptr() != p.data_ptr()]
        if pairs:
            torch._foreach_copy_([p.data for p, _ in pairs], [m for _, m in pairs])

    @staticmethod
    def _update_foreach(masters, grads, exp_avgs, exp_avg_sqs, step, group) -> None:
        """
        #### The same update with `foreach` kernels

        The sequence of operations of `torch.optim.AdamW`'s foreach path.
        """
        lr, (beta1, beta2) = group["lr"], group["betas"]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(masters, 1 - lr * group["weight_decay"])
        # m ← β1·m + (1 − β1)·g
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        # v ← β2·v + (1 − β2)·g²
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        # √v / √(1 − β2^t) + ε
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(masters, exp_avgs, denom, -step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.main_grad = None
                param.grad = None
