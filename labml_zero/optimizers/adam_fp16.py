r"""
---
title: Adam with fp32 master weights (AdamFP16)
summary: AdamW on flat shards, fp32 masters and moments (on the device or the
  host) rounded back to half precision, and how all ranks agree on an overflow.
---

# Adam with fp32 master weights

The update is exactly `torch.optim.AdamW`'s (decoupled weight decay, $\epsilon$
added to the bias-corrected $\sqrt{v}$). With gradient $g_t$, learning rate
$\alpha$, weight decay $\lambda$:

$$\begin{aligned}
\theta &\leftarrow \theta (1 - \alpha \lambda) \\
m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
\theta &\leftarrow \theta - \frac{\alpha}{1 - \beta_1^t} \cdot
  \frac{m_t}{\sqrt{v_t} / \sqrt{1 - \beta_2^t} + \epsilon}
\end{aligned}$$

with $\theta$ the fp32 master (the {{term: master weights}}), $m$ and $v$ fp32,
and the half-precision (bf16 or fp16) parameter set to $\theta$ rounded after
each step. The master is why: bf16 keeps 8 bits of mantissa, so an update
smaller than half a unit in the last place of a weight (below $2^{-8}$ for a
weight of $1$) would be lost if it were applied to the bf16 parameter; the
master keeps every update, and the parameter is its rounding.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Collection, Iterable

import torch

from labml_zero.zero3.state_layout import StateLayout, state_layout

from . import (blockwise_moments, kahan_summation, narrow_moments,
               rounded_update, stochastic_rounding)
from .captured_update import CapturedUpdates
from .clip_grad import ConsumedGradSquares
from .early_update import EarlyUpdate, EarlyUpdates, NonFiniteGradient
from .host_offload import HostShard
from .shard_home import ShardHome, add_group_homes, build_homes
from .shard_state import ShardStates
from .step_scalars import StepScalars

__all__ = ["AdamFP16", "NonFiniteGradient"]

# A rule answers, for a chunk's index and its parameter shard, whether that
# shard's master and moments live on the host.
OffloadRule = Callable[[int, torch.Tensor], bool]


# torch.optim marks `add_param_group` never to be compiled, and the mark's first
# call imports `torch._dynamo`: a second of start-up in every rank. This optimizer
# is never built inside a compiled region, so it calls the function under the mark.
_add_param_group = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__",
                           torch.optim.Optimizer.add_param_group)


class AdamFP16(ShardStates, torch.optim.Optimizer):
    """
    ## The optimizer

    * `params`: the shards (or any parameters) to update, or param groups.
    * `lr`, `betas`, `eps`, `weight_decay`: as in `torch.optim.AdamW`; the default
      `weight_decay=0.0` keeps `AdamFP16(params, lr=...)` an Adam.
    * `fused`: use the fused kernel (default: where available) or `foreach` ops.
    * `offload`: which shards keep master and moments in host memory: positions
      in the list of all parameters, group after group (for
      `model.get_trainable_chunk()`, the trainable chunks in order;
      `Placement.optimizer_offload` gives them, explained in
      the {{see: placement}}), or a function
      `(position, param) -> bool`; `None` keeps everything on the device.
    * `update_during_backward`: update each shard as soon as `grad_ready` is
      called for it (see Note: updating during the backward pass).
    * `free_grads`: with it, free each shard's gradient once its early update
      has consumed it (see `EarlyUpdates.free_grad`).
    * `grad_squares`: sum the squares of every gradient an update consumes
      into `consumed_squares` (a [`ConsumedGradSquares`](clip_grad.html)),
      for the step's gradient norm where `free_grads` leaves nothing to read
      after `backward()`; it reads each gradient once more.
    * `states`: the [state layout](../zero3/state_layout.html), by name or
      as a `StateLayout`: `"fp32"` (master and moments in fp32, the
      default), `"bf16-moments"` (an fp32 master, the moments rounded to
      bf16 when stored: [narrow moments](narrow_moments.html)) or
      `"bf16-stochastic"` (bf16 moments, no master: [stochastic
      rounding](stochastic_rounding.html)), `"bf16-kahan"` (bf16 moments, no
      master, a bf16 compensation: [Kahan summation](kahan_summation.html))
      or `"8bit-moments"` (an fp32 master, the moments coded in 8 bits per
      block: [8-bit moments](blockwise_moments.html)).

    It holds `homes` (each shard's {{term: home}}, device or host,
    and the kernels' batches) and `early_updates` (the updates during the
    backward pass); `self.state` holds each shard's master and moments,
    which a checkpoint reads and writes through the methods of [a shard's
    optimizer state](shard_state.html).
    Where each piece lives:

    * The parameters handed to `AdamFP16` are the flat half-precision shards of the
      trainable chunks (`model.get_trainable_chunk()`), or any parameters.
    * A shard's gradient is its [`LocalShard`](../zero3/shard.html)'s `grad` (fp32,
      averaged over ranks by the reduce-scatter); an ordinary parameter's is its
      `.grad`.
    * Where a shard's master and moments live, device or host memory, is its
      home ([where a shard's optimizer state lives](shard_home.html)): one
      object per shard, built at construction, that allocates the state, gives
      the gradient the update reads and writes the new master back into the
      shard. The optimizer asks the home and never where the shard is.

    An offloaded shard's update runs in host memory (explained in
    [optimizer state in host memory](host_offload.html)); which shards go is the
    placement's decision.

    No AMSGrad, no `maximize`.
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
        free_grads: bool = False,
        grad_squares: bool = False,
        states: str | StateLayout = "fp32",
    ):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if free_grads and not update_during_backward:
            raise ValueError("free_grads needs update_during_backward=True (the "
                             "gradient is freed after its early update)")
        self.layout = state_layout(states)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        if self.layout.master is None:
            self._check_no_master()
        # None: the fused kernel where this PyTorch has it
        self.fused = hasattr(torch, "_fused_adamw_") if fused is None else fused
        if self.fused and not hasattr(torch, "_fused_adamw_"):
            raise ValueError("fused=True needs torch._fused_adamw_ (PyTorch >= 2.4)")
        self.update_during_backward = update_during_backward
        # Each shard's home, its kind decided here, once, by `offload`.
        self.homes = build_homes(self.param_groups, self._offloaded(offload),
                                 worker=update_during_backward,
                                 layout=self.layout)
        # with `free_grads` only the early update reads a gradient: on one
        # rank it may then stay in the parameter dtype (the shard's Note: one
        # rank keeps the parameter dtype); a later optimizer decides anew
        for home in self.homes.of.values():
            home.read_gradient_once(free_grads)
        # Host homes get their state now: the engine's fp32 `master_init`
        # (4 bytes per element on the device) moves to the host at once
        # instead of waiting there through the first step.
        for home in self.homes.host:
            self._state(home)
        self.early_updates = EarlyUpdates(self._apply, free_grads=free_grads)
        self.consumed_squares = ConsumedGradSquares() if grad_squares else None
        # $t$ and the one-pass coefficients on each device, once a step
        # ([the step's scalars](step_scalars.html))
        self.scalars = StepScalars()
        # set while the step is captured as a CUDA graph and replayed (see
        # [the update inside a captured step](captured_update.html))
        self.capture: CapturedUpdates | None = None

    def _check_no_master(self) -> None:
        """A layout without a master: bf16 (rounded stochastically or with a
        compensation) or fp32 (its own master) shards; a host home updates
        its own copy of the weight (the home's Note: a host home without a
        master)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.bfloat16, torch.float32):
                    raise ValueError(f"states {self.layout.name!r} rounds into "
                                     f"bf16 or fp32 parameters, got {p.dtype}")

    def add_param_group(self, param_group: dict) -> None:
        """A group added after construction: its homes on the device."""
        _add_param_group(self, param_group)
        # during `__init__` the homes are built after all groups
        if hasattr(self, "homes"):
            add_group_homes(self.homes, len(self.param_groups) - 1,
                            self.param_groups[-1], set())

    @property
    def early(self) -> dict[torch.Tensor, EarlyUpdate]:
        """The updates run during this backward pass, by shard."""
        return self.early_updates.pending

    @property
    def free_grads(self) -> bool:
        """Whether an early update frees its gradient (`EarlyUpdates.free_grad`)."""
        return self.early_updates.free_grads

    @property
    def host(self) -> dict[torch.Tensor, HostShard]:
        """The offloaded shards and their staging buffers."""
        return {home.param: home.staging for home in self.homes.host}

    def _offloaded(self, offload) -> list[torch.Tensor]:
        """#### Resolve `offload` into the offloaded parameters, in list order"""
        params = [p for group in self.param_groups for p in group["params"]]
        if offload is None:
            return []
        if callable(offload):
            return [p for i, p in enumerate(params) if offload(i, p)]
        chosen = sorted(set(offload))
        bad = [i for i in chosen if not 0 <= i < len(params)]
        if bad:
            raise ValueError(f"offload names parameter {bad[0]}, but the "
                             f"optimizer has {len(params)} (0 to "
                             f"{len(params) - 1})")
        return [params[i] for i in chosen]

    ### A gradient is final

    def grad_ready(self, param: torch.Tensor, *, after=None) -> None:
        """
        ### `param`'s gradient is final for this step

        The engine calls this as each chunk is reduced, with `after` the stream
        that wrote the gradient. Its home moves it if it must (a host home
        starts the copy down); with `update_during_backward` the shard is
        updated now (see Note: updating during the backward pass).

        An early update reads the gradient as reduced: `step()` refuses one whose
        gradient clipping or unscaling changed since (see Note: updating during the
        backward pass), so a [loss scaler](grad_scaler.html) (the object that scales
        the loss of fp16 training) rules early updates out (passing the scale
        to the kernel, `grad_scale=`, would allow it), and clipping rules them out
        whenever it clips. With `free_grads` the gradients are gone after
        `backward()`, so clipping and the loss scaler refuse them in one line.
        """
        home = self.homes.of.get(param)
        if home is None:
            if self.update_during_backward:
                raise ValueError("the parameter is not one of this optimizer's")
            # not one of ours: nothing to move, nothing to update
            return
        grad = home.gradient()
        if grad is None:
            return
        home.grad_ready(grad, after=after)
        if self.update_during_backward and not self.early_updates.started(param):
            # a second backward before `step()` is not updated again: `step()`
            # sees its gradient changed and refuses it
            self.early_updates.start(home, grad, after=after)

    def prefetch_grad(self, param: torch.Tensor, *, after=None) -> None:
        """`grad_ready` for a shard whose home copies its gradient (a host
        home); nothing for one on the device."""
        if self._home(param).copies_gradient:
            self.grad_ready(param, after=after)

    ### The step

    @torch.no_grad()
    def step(self, closure=None):
        r"""
        ### One pass over all shards

        Each step is one pass over all shards, however many chunks there
        are: PyTorch's fused AdamW kernel (`torch._fused_adamw_`, which
        reads $\theta, g, m, v$ once and writes $\theta, m, v$ once; it
        exists for CPU and CUDA) when available, else the same update as a
        sequence of `foreach` multi-tensor kernels (about three times the
        memory traffic), one launch per batch of device homes (one param
        group, device and dtype). Both are tested against
        `torch.optim.AdamW`. On a GPU a half-precision shard with a master
        takes [the update in one pass](rounded_update.html) instead, whose
        twin is the fused kernel and the copy, and 8-bit moments [one of
        their own](blockwise_moments.html), and a bf16 shard without a
        master one pass of its layout's ([stochastic
        rounding](stochastic_rounding.html), [Kahan
        summation](kahan_summation.html)), whose twin on a CPU runs the
        fused kernel on widened slices. Every update, whenever and wherever it
        runs, goes through one method, `_apply`.

        #### All ranks agree on an overflow

        A step with a non-finite gradient must be skipped on every rank, or the ranks'
        shards would come from different steps, yet each rank sees only its own
        shards. The loss scaler (which also skips a step that overflowed) computes the global gradient
        norm, one all-reduce of each rank's sum of squares (`global_grad_norm`, on the
        [clipping](clip_grad.html) page): a non-finite gradient anywhere makes that sum
        non-finite on every rank at once, so every rank skips the step. Clipping reuses
        the norm, so the agreement costs no collective of its own.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the flags of the last step's early updates on a GPU, then, before
        # any update: a step must not stop half done
        self.early_updates.raise_if_skipped(self.state)
        self.early_updates.check(self.state)
        started = self.early_updates.started
        # Device batches first: they are queued and run while the host works.
        for homes in self.homes.device_batches:
            self._apply([h for h in homes
                         if h.gradient() is not None and not started(h.param)])
        late_host = [h for h in self.homes.host
                     if h.gradient() is not None and not started(h.param)]
        self.early_updates.finish(self.state, capture=self.capture)
        # Last first: in backward their gradients were final first.
        for home in reversed(late_host):
            self._apply([home])
        # compute stream waits: the next all-gather reads the new shards
        self.homes.offload.wait_uploads()
        return loss

    def _apply(self, homes: list[ShardHome], *,
               early: EarlyUpdate | None = None) -> None:
        """
        ### One AdamW step of `homes`, the one path every update takes

        The homes are of one kind, param group, device and dtype (one of
        `homes.device_batches`, or a single home), so the first speaks for all.

        1. Each shard's step count goes up; shards with the same count share the
           bias corrections, so one kernel launch covers them.
        2. The gradients, as the home gives them: the shards' own, or the host
           copies.
        3. The kernel updates master and moments; with `early`, only if the
           gradient is finite (see Note: a non-finite gradient in an early
           update).
        4. The home writes the rounded master back into the shard: on the
           device a copy, from the host an upload.

        A half-precision device home on a GPU does 3 and 4 in one kernel
        ([the update in one pass](rounded_update.html)); 8-bit moments do 3
        in one pass, and 4 with it on the device.
        """
        if not homes:
            return
        lead = homes[0]
        group = self.param_groups[lead.group_index]
        by_step: dict[int, list[ShardHome]] = {}
        for home in homes:
            state = self._state(home)
            if self.capture is None:
                state["step"] += 1
                step = state["step"]
            else:
                # a captured step: its count as the graph will see it
                step = self.capture.step_of(home.param, state)
            by_step.setdefault(step, []).append(home)
        for step, same in by_step.items():
            states = [self.state[h.param] for h in same]
            grads = lead.gradients(same)
            if self.consumed_squares is not None:
                # beside the update, on its stream or thread, before a skip
                self.consumed_squares.add(grads)
            found_inf = None
            if early is not None:
                found_inf = early.flag_non_finite(grads[0])
                if not (self.fused and lead.skip_in_kernel):
                    # host sync on a GPU (foreach); on the host, the flag
                    # that came down with the gradient is read
                    if found_inf.item():
                        return
                    found_inf = None
            if self.fused and (lead.one_pass or self.layout.blockwise):
                self._one_pass(same, grads, step, found_inf=found_inf)
                continue
            # the twin: fp32 gradients (one rank may hand its own dtype, see
            # the shard's Note: one rank keeps the parameter dtype)
            grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
            moments = [[s[t.name] for s in states] for t in self.layout.moments]
            kernel = functools.partial(self._kernel, step=step,
                                       group_index=lead.group_index,
                                       found_inf=found_inf)
            if self.layout.master is None:
                # the weights: the shards, or a host home's copies of them
                weights = [h.weight() for h in same]
                if self.layout.compensation is not None:
                    # their compensations beside them
                    kahan_summation.update(kernel, weights, grads, *moments)
                else:
                    # rounded into stochastically, the noise from the step
                    # on the weights' device
                    stochastic_rounding.update(
                        kernel, weights, grads, *moments,
                        step=self._step_tensor(lead.state_device, step),
                        salts=[h.position for h in same])
                # a host copy goes up; a device shard is already written
                lead.write_back(same, weights)
                continue
            masters = [s[self.layout.master.name] for s in states]
            if self.layout.blockwise:
                # 8-bit moments with `foreach` kernels: decoded block by
                # block around the kernel
                blockwise_moments.update(kernel, masters, grads, moments)
                lead.write_back(same, masters)
                continue
            # moments narrower than fp32 are widened slice by slice around
            # the fp32 kernel and rounded as they are stored
            narrow_moments.update(kernel, masters, grads, *moments)
            lead.write_back(same, masters)

    def _kernel(self, masters, grads, exp_avgs, exp_avg_sqs, *, step: int,
                group_index: int, found_inf: torch.Tensor | None) -> None:
        r"""
        #### The update of master and moments, fused or with `foreach` kernels

        The foreach sequence is `torch.optim.AdamW`'s foreach path. In a
        captured step the fused kernel reads $t$ and $\alpha$ from device
        tensors ([the update inside a captured step](captured_update.html)).

        The foreach fallback checks an early gradient's finiteness with a host sync.
        The fused kernel takes its operands contiguous (see Note: operands in
        memory order, on [narrow moments](narrow_moments.html)).
        """
        group = self.param_groups[group_index]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        if self.fused:
            # The kernel reads the (already incremented) step from a tensor.
            steps = [self._step_tensor(m.device, step) for m in masters]
            if self.capture is not None:
                lr = self.capture.lr(group_index)
            # read only: a copy, where one is needed, goes nowhere after
            grads = [g.contiguous() for g in grads]
            n = len(masters)
            with narrow_moments.contiguous([*masters, *exp_avgs,
                                            *exp_avg_sqs]) as dense:
                torch._fused_adamw_(
                    dense[:n], grads, dense[n:2 * n], dense[2 * n:], [], steps,
                    lr=lr, beta1=beta1, beta2=beta2,
                    weight_decay=group["weight_decay"], eps=group["eps"],
                    amsgrad=False, maximize=False, found_inf=found_inf,
                )
            return
        if group["weight_decay"] != 0:
            torch._foreach_mul_(masters, 1 - lr * group["weight_decay"])
        # m ← β1·m + (1 − β1)·g
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        # v ← β2·v + (1 − β2)·g²
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        # $\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon$
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(masters, exp_avgs, denom, -step_size)

    def _one_pass(self, homes: list[ShardHome], grads: list[torch.Tensor],
                  step: int, *, found_inf: torch.Tensor | None) -> None:
        """
        #### Steps 3 and 4 of `_apply` in one pass per shard

        A half-precision device shard's on a GPU (with a master, or a bf16
        one without), or 8-bit moments'
        ([`blockwise_moments.one_pass`](blockwise_moments.html), eager on a
        CPU), which rounds into the shard beside its state; a host home's
        master goes up by `write_back`.
        """
        lead = homes[0]
        group = self.param_groups[lead.group_index]
        coefficients = self.scalars.coefficients(
            lead.state_device, lead.group_index, group, step, self.capture)
        betas = rounded_update.Betas(*group["betas"], group["eps"])
        states = [self.state[h.param] for h in homes]
        for home, grad, state in zip(homes, grads, states):
            shard, tensors = home.param.detach(), [state[name] for name in
                                                   self.layout.names]
            if self.layout.master is None and self.layout.compensation is not None:
                # a bf16 shard beside its compensation
                # ([Kahan summation](kahan_summation.html))
                kahan_summation.compiled_update()(shard, tuple(tensors), grad,
                                                  coefficients, found_inf, betas)
                continue
            if self.layout.master is None:
                # rounded stochastically with the twin's bits: the step's
                # device tensor, the home's position
                stochastic_rounding.compiled_update()(
                    shard, tuple(tensors), grad, coefficients, found_inf, betas,
                    self._step_tensor(home.state_device, step), home.position)
                continue
            if not self.layout.blockwise:
                rounded_update.one_pass(shard, tuple(tensors), grad,
                                        coefficients, found_inf, betas)
                continue
            master, *moments = tensors
            # an fp32 shard is its own master
            writes = (lead.shard_beside_state
                      and master.data_ptr() != shard.data_ptr())
            blockwise_moments.one_pass(
                master, grad, tuple(moments), shard if writes else None,
                coefficients, found_inf, betas)
        if self.layout.blockwise and not lead.shard_beside_state:
            lead.write_back(homes, [s[self.layout.master.name] for s in states])

    def _step_tensor(self, device: torch.device, step: int) -> torch.Tensor:
        return self.scalars.step(device, step, self.capture)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free every gradient; `set_to_none` is always true (the engine's
        reduction allocates the next step's gradient)."""
        for home in self.homes.of.values():
            home.free_grad()
