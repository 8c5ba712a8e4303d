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

## Where each piece lives

* The parameters handed to `AdamFP16` are the flat half-precision shards of the
  trainable chunks (`model.get_trainable_chunk()`), or any parameters.
* A shard's gradient is its [`LocalShard`](../zero3/shard.html)'s `grad` (fp32,
  averaged over ranks by the reduce-scatter); an ordinary parameter's is its
  `.grad`.
* The master starts from the shard's `master_init` when the engine kept one
  (the original fp32 weights of a half-precision chunk), otherwise from the
  parameter itself; it is taken at the first step, or at construction for a
  shard whose state is on the host. An fp32 parameter *is* its own master: no
  copy, $K = 8$ extra bytes
  (tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
  instead of {{py: memory_model.OPTIMIZER_BYTES}}.

Each step is one pass over all shards, however many chunks there are: PyTorch's
fused AdamW kernel (`torch._fused_adamw_`, which reads $\theta, g, m, v$ once and
writes $\theta, m, v$ once; it exists for CPU and CUDA) when available, else the
same update as a sequence of `foreach` multi-tensor kernels (about three times
the memory traffic). Both are tested against `torch.optim.AdamW`. Every update,
whenever and wherever it runs, goes through one method, `_apply`.

`offload=` keeps the master and moments of chosen shards in host memory and
updates them there (explained in
[optimizer state in host memory](host_offload.html)): the gradient shard is
copied down, the update runs on the CPU, and the rounded shard goes back up.
Which shards go is the {{see: placement}}'s decision.
`update_during_backward=` updates each shard as soon as its gradient is final,
while the backward pass goes on (explained in
[updating during the backward pass](early_update.html)).

## All ranks agree on an overflow

A step with a non-finite gradient must be skipped on every rank, or the ranks'
shards would come from different steps, yet each rank sees only its own
shards. The agreement costs no collective of its own: the global gradient norm
is one all-reduce of each rank's sum of squares (explained in
[clipping](clip_grad.html)), and a non-finite gradient anywhere makes that sum
non-finite on every rank at once; the [loss scaler](grad_scaler.html) reads it
and skips the step everywhere.

## Limitations

* No AMSGrad, no `maximize`, no capturable (CUDA graph) mode.
* With a loss scaler or clipping an early update is impossible (see Note:
  updating during the backward pass); passing
  the scale to the kernel (`grad_scale=`) instead would allow it.
* The foreach fallback checks an early gradient's finiteness with a host sync.
"""

from __future__ import annotations

import math
from typing import Callable, Collection, Iterable

import torch

from labml_zero.zero3.shard import LocalShard

from .early_update import EarlyUpdate, EarlyUpdates, NonFiniteGradient
from .host_offload import HostOffload

__all__ = ["AdamFP16", "NonFiniteGradient"]

# A rule answers, for a chunk's index and its parameter shard, whether that
# shard's master and moments live on the host; the two moments are named as in
# `torch.optim.AdamW`'s state, so a state dict reads the same.
OffloadRule = Callable[[int, torch.Tensor], bool]

MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamFP16(torch.optim.Optimizer):
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
      [placement](../zero3/placement.html)), or a function
      `(position, param) -> bool`; `None` keeps everything on the device.
    * `update_during_backward`: update each shard as soon as `grad_ready` is
      called for it (see Note: updating during the backward pass).
    * `free_grads`: with it, free each shard's gradient once its early update
      has consumed it (see `EarlyUpdates.free_grad`).
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        # None: the fused kernel where this PyTorch has it
        self.fused = hasattr(torch, "_fused_adamw_") if fused is None else fused
        if self.fused and not hasattr(torch, "_fused_adamw_"):
            raise ValueError("fused=True needs torch._fused_adamw_ (PyTorch >= 2.4)")
        self.update_during_backward = update_during_backward
        self.offload = HostOffload(self._offloaded(offload),
                                   worker=update_during_backward)
        # the param group of each shard, for an update on its own
        self.group_of = {p: group for group in self.param_groups
                         for p in group["params"]}
        # Offloaded shards get their host state now: the engine's fp32
        # `master_init` (4 bytes per element on the device) moves to the host
        # at once instead of waiting there through the first step.
        for param in self.offload.shards:
            self.init_state(param)
        # the updates run during the backward pass, their stream and flags
        self.early_updates = EarlyUpdates(self.offload, self._apply, self.gradient,
                                          free_grads=free_grads)
        # (step, 0-dim step tensor) per (device, stream): every shard updated
        # at that step there reads the same one, one fill a step, not a shard
        self._step_tensors: dict[tuple, tuple[int, torch.Tensor]] = {}

    @property
    def early(self) -> dict[torch.Tensor, EarlyUpdate]:
        """The updates run during this backward pass, by shard."""
        return self.early_updates.pending

    @property
    def free_grads(self) -> bool:
        """Whether an early update frees its gradient (`EarlyUpdates.free_grad`)."""
        return self.early_updates.free_grads

    @property
    def host(self):
        """The offloaded shards and their staging (`HostOffload.shards`)."""
        return self.offload.shards

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

    ### State

    def state_device(self, param: torch.Tensor) -> torch.device:
        """Where `param`'s master and moments belong (for checkpoint loading)."""
        return torch.device("cpu") if param in self.offload else param.device

    @staticmethod
    def gradient(param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 gradient: the shard's, or the ordinary one cast."""
        shard = LocalShard.of(param)
        grad = shard.grad if shard is not None else None
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
            if param in self.offload:
                self._move_to_host(param, state)
            return state
        shard = LocalShard.of(param)
        # The exact fp32 weights; the half-precision shard is a rounding of them.
        master = shard.take_master_init() if shard is not None else None
        if master is None:
            if param.dtype == torch.float32 and param not in self.offload:
                master = param.data
            else:
                master = param.detach().float()
        if param in self.offload:
            # [S] fp32 on the host; copy=True: on CPU an fp32 shard is already
            # there, and its master must still be a tensor of its own
            master = master.to("cpu", torch.float32, copy=True)
        state["step"] = 0
        state["master"] = master
        for kind in MOMENTS:
            state[kind] = torch.zeros_like(master)
        return state

    @staticmethod
    def _move_to_host(param: torch.Tensor, state: dict) -> None:
        """
        #### Bring a state loaded onto the device back to the host

        A state installed on the shard's device (an fp32 shard's master as the
        shard itself) is copied, so the device memory is freed and the master
        does not alias the shard.
        """
        for key in ("master", *MOMENTS):
            t = state[key]
            if t.device.type != "cpu" or t.data_ptr() == param.data_ptr():
                state[key] = t.to("cpu", torch.float32, copy=True)

    def shard_state(self, param: torch.Tensor) -> dict | None:
        """
        ### `param`'s state, for a checkpoint

        `{"step": int, "master", "exp_avg", "exp_avg_sq"}` ([S] fp32 each), or
        `None` before its first step.
        """
        # a checkpoint must not hold a step whose early update was skipped
        self.early_updates.raise_if_skipped(self.state)
        # `.get`, not `[]`: `self.state` is a defaultdict and must not grow
        state = self.state.get(param)
        if not state:
            return None
        return {"step": int(state["step"]), "master": state["master"],
                **{kind: state[kind] for kind in MOMENTS}}

    def load_shard_state(self, param: torch.Tensor, state: dict | None) -> None:
        """
        ### Install a checkpoint's state for `param`, or forget it (`None`)

        The tensors are used as given (put them on `state_device(param)`); an
        fp32 shard's `master` may be the shard itself.
        """
        if param not in self.group_of:
            raise ValueError("the parameter is not one of this optimizer's")
        if state is None:
            self.state.pop(param, None)
            return
        missing = {"step", "master", *MOMENTS} - set(state)
        if missing:
            raise ValueError(f"shard state lacks {sorted(missing)}")
        self.state[param] = {"step": int(state["step"]), "master": state["master"],
                             **{kind: state[kind] for kind in MOMENTS}}

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

    ### A gradient is final

    def grad_ready(self, param: torch.Tensor, *, after=None) -> None:
        """
        ### `param`'s gradient is final for this step

        The engine calls this as each chunk is reduced, with `after` the stream
        that wrote the gradient. An offloaded shard starts its copy down; with
        `update_during_backward` the shard is updated now
        (see Note: updating during the backward pass).
        """
        grad = self.gradient(param)
        if grad is None:
            return
        if param in self.offload:
            self.offload.copy_down(param, grad, after=after)
        if self.update_during_backward and param not in self.early:
            # a second backward before `step()` is not updated again: `step()`
            # sees its gradient changed and refuses it
            self.early_updates.start(param, grad, self._group_of(param),
                                     after=after)

    def prefetch_grad(self, param: torch.Tensor, *, after=None) -> None:
        """`grad_ready` for an offloaded shard; nothing for one on the device."""
        if param in self.offload:
            self.grad_ready(param, after=after)

    ### The step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the flags of the last step's early updates on a GPU, then, before
        # any update: a step must not stop half done
        self.early_updates.raise_if_skipped(self.state)
        self.early_updates.check(self.state)
        offloaded = []
        for group in self.param_groups:
            late = [p for p in group["params"]
                    if self.gradient(p) is not None and p not in self.early]
            offloaded += [p for p in late if p in self.offload]
            # Device updates first: they are queued and run while the host works.
            self._apply([p for p in late if p not in self.offload], group)
        self.early_updates.finish(self.state)
        # Last first: in backward their gradients were final first.
        for param in reversed(offloaded):
            self._apply([param], self._group_of(param))
        if offloaded or any(p in self.offload for p in self.early):
            # compute stream waits: the next all-gather reads the new shards
            self.offload.wait_uploads()
        self.early_updates.pending = {}
        return loss

    def _apply(self, params: list[torch.Tensor], group: dict, *,
               early: EarlyUpdate | None = None) -> None:
        """
        ### One AdamW step of `params`, the one path every update takes

        1. Each shard's step count goes up; shards with the same count share the
           bias corrections, so one kernel launch covers them.
        2. The gradients: the shards' own, or the host copies of offloaded ones.
        3. The kernel updates master and moments; with `early`, only if the
           gradient is finite (see Note: a non-finite gradient in an early
           update).
        4. The rounded master goes back into the shard: on the device a copy,
           for an offloaded shard an upload.
        """
        by_step: dict[int, list[torch.Tensor]] = {}
        for param in params:
            state = self.init_state(param)
            state["step"] += 1
            by_step.setdefault(state["step"], []).append(param)
        for step, same in by_step.items():
            states = [self.state[p] for p in same]
            masters = [s["master"] for s in states]
            grads = [self.gradient(p) for p in same]
            if same[0] in self.offload:
                grads = [self.offload.host_grad(p, g) for p, g in zip(same, grads)]
            found_inf = None
            if early is not None:
                # 0-dim fp32: one when the gradient has an inf or a nan. The
                # largest |g| is non-finite exactly then (a nan propagates
                # through the max): one read of the gradient, no temporary,
                # where isfinite(g).all() also writes and reads a bool copy.
                found_inf = early.found_inf = (~torch.isfinite(
                    torch.linalg.vector_norm(grads[0], float("inf")))).float()
                if not self.fused or same[0] in self.offload:
                    # host sync on a GPU (foreach); on the host, a host check
                    if found_inf.item():
                        return
                    found_inf = None
            self._kernel(masters, grads, [s["exp_avg"] for s in states],
                         [s["exp_avg_sq"] for s in states], step, group,
                         found_inf=found_inf)
            if same[0] in self.offload:
                for param, master in zip(same, masters):
                    self.offload.upload(param, master)
                continue
            # Write back the rounded master; the next all-gather spreads it.
            pairs = [(p, m) for p, m in zip(same, masters)
                     if m.data_ptr() != p.data_ptr()]
            if pairs:
                torch._foreach_copy_([p.data for p, _ in pairs],
                                     [m for _, m in pairs])

    def _kernel(self, masters, grads, exp_avgs, exp_avg_sqs, step: int,
                group: dict, *, found_inf: torch.Tensor | None) -> None:
        """
        #### The update of master and moments, fused or with `foreach` kernels

        The foreach sequence is `torch.optim.AdamW`'s foreach path.
        """
        lr, (beta1, beta2) = group["lr"], group["betas"]
        if self.fused:
            # The kernel reads the (already incremented) step from a tensor.
            steps = [self._step_tensor(m.device, step) for m in masters]
            torch._fused_adamw_(
                masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                eps=group["eps"], amsgrad=False, maximize=False, found_inf=found_inf,
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
        # √v / √(1 − β2^t) + ε
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(masters, exp_avgs, denom, -step_size)

    def _step_tensor(self, device: torch.device, step: int) -> torch.Tensor:
        """The kernel only reads it, so shards of one step may share it."""
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        held = self._step_tensors.get((device, stream))
        if held is None or held[0] != step:
            held = (step, torch.full((), float(step), device=device))
            self._step_tensors[(device, stream)] = held
        return held[1]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                shard = LocalShard.of(param)
                if shard is not None:
                    shard.zero_grad()
                param.grad = None
