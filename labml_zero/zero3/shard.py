r"""
---
title: A rank's shard
summary: The rank-local state of one chunk (bf16 shard, fp32 gradient, fp32 first
  master) in one object, with what each piece costs.
---

# A rank's shard

A [chunk](chunk.html) of $C$ elements is cut into $N_d$ slices of $S = C / N_d$
elements, one per rank. Everything a rank keeps of a chunk between two gathers is
its own slice, and this page is the one object that owns it:

| state | elements | bytes per element | lives |
|---|---|---|---|
| `param`, the bf16 (or fp16, fp32) shard | $S$ | $p$ (2 for bf16) | always |
| `grad`, the fp32 gradient shard | $S$ | 4 ($p$ on one rank, see below) | from the reduce-scatter to `zero_grad` |
| `master_init`, the first fp32 master | $S$ | 4 | until the optimizer takes it |

so a trainable element costs $p + 4$ bytes here, beside the $K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes of the optimizer's master and moments (with fp32 states: their
[layout](state_layout.html) declares them), and a frozen one $p$.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


class LocalShard:
    """
    ## This rank's shard of a chunk

    Lifecycle:

    1. built from a filled `[S]` tensor: a trainable shard wraps it in an
       `nn.Parameter` (`param`) and may keep `master_init`, the exact fp32 values
       the bf16 `param` rounds;
    2. after each reduction the [chunk](chunk.html) writes `grad`: the first
       of a step allocates it (`new_grad`), later ones (micro-batches reduced
       one by one, without `no_sync`) add into it (`grad.add_`); an fp32
       shard's `grad` is `param.grad` itself (see Note: why the gradient lives
       beside the parameter);
    3. `take_master_init()`: the optimizer takes the first master and the
       shard drops it; `AdamFP16` takes it at its first step when the shard's
       optimizer state is on the device, and at its construction when that
       state is on the host (`offload`);
    4. `zero_grad()`: the gradient is freed (for an fp32 shard, so does any
       optimizer's `zero_grad()`, which clears `param.grad`);
    5. `move_to_host()` (between steps, optional): `param` moves to host memory,
       `grad` stays on `grad_device`.

    * `data` is the `[S]` shard in the parameter dtype.
    * `trainable`: whether it gets gradients and an optimizer.
    * `master_init`: `[S]` fp32 first master, or `None`.
    """

    # parameter -> its shard, keyed weakly by the parameter's identity (see
    # Note: how a parameter finds its shard)
    _of: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __init__(self, data: torch.Tensor, *, trainable: bool,
                 master_init: torch.Tensor | None = None):
        self.trainable = trainable
        # [S] param dtype. An nn.Parameter so that optimizers accept it.
        self.param: torch.Tensor = (nn.Parameter(data, requires_grad=True)
                                    if trainable else data)
        # [S] fp32 (or the parameter dtype: see Note: one rank keeps the
        # parameter dtype), read and written through `grad`, which keeps it in
        # `param.grad` instead when the two can be one (`_grad_in_param`); see
        # Note: why the gradient lives beside the parameter
        self._grad: torch.Tensor | None = None
        # whether `grad`'s only reader is an early update that frees it, set
        # by the optimizer (see Note: one rank keeps the parameter dtype)
        self.grad_read_once = False
        # whether an update during the backward pass takes the gradient and
        # frees it (`AdamFP16(free_grads=True)`): nothing after `backward()`
        # may read it, and clipping or unscaling refuse to
        self.grad_taken = False
        self._master_init = master_init
        # where `grad` is allocated: the chunk's device, also once `param` is
        # on the host (the reduce-scatter runs there)
        self.grad_device: torch.device = data.device
        self.on_host = False
        self._grad_in_param = trainable and data.dtype == torch.float32
        if trainable:
            LocalShard._of[self.param] = self

    @staticmethod
    def of(param: torch.Tensor) -> "LocalShard | None":
        """The shard that owns `param`, or `None` for an ordinary parameter.

        The optimizer is handed `param` (an `nn.Parameter`, so any optimizer accepts it)
        and finds the rest through `LocalShard.of(param)`; `AdamFP16` works on ordinary
        parameters as well, which have no `LocalShard` and keep their gradient in
        `.grad`.

        #### Note: how a parameter finds its shard

        `LocalShard.of(param)` looks the parameter up in a table keyed by the identity
        of the tensor, holding it weakly: the table never keeps a shard alive, and a
        shard is in it from its construction to its end. No attribute is added to the
        `nn.Parameter`, so `state_dict`, `copy.deepcopy` and `torch.compile` see an
        ordinary parameter.
        """
        return LocalShard._of.get(param)

    ### The first master

    @property
    def master_init(self) -> torch.Tensor | None:
        """`[S]` fp32 first master, until the optimizer takes it (read only)."""
        return self._master_init

    def take_master_init(self) -> torch.Tensor | None:
        """Hand the first master over (the optimizer's first step) and drop it."""
        master, self._master_init = self._master_init, None
        return master

    def set_master_init(self, master: torch.Tensor | None) -> None:
        """A checkpoint without optimizer state gives the next first master."""
        if master is not None and master.shape != self.param.shape:
            raise ValueError(f"master_init of shape {tuple(master.shape)} for a "
                             f"shard of shape {tuple(self.param.shape)}")
        self._master_init = master

    def master_init_nbytes(self) -> int:
        m = self._master_init
        return 0 if m is None else m.numel() * m.element_size()

    ### The gradient
    #
    # #### Note: why the gradient lives beside the parameter
    #
    # `param.grad` must have the parameter's dtype, and the shard's gradient is an fp32
    # average over ranks (summing in bf16 would round every partial sum). So a bf16 or
    # fp16 shard keeps its gradient in `LocalShard.grad`, beside the parameter. For an
    # fp32 shard the two dtypes agree, and there is one gradient, not two: `grad` *is*
    # `param.grad`, read and written through it, so that a plain `torch.optim`
    # optimizer works on fp32 shards. Two copies would disagree as soon as that
    # optimizer's `zero_grad()` set `param.grad` to `None`: the engine would go on
    # adding each step's gradient into the one it kept, the sum of every step so far.
    # Whatever clears `param.grad`, the optimizer or the user, clears the gradient.
    # A shard whose parameter moved to the host while its gradient stays on the
    # device keeps the gradient here again: `param.grad` must be on `param`'s device.

    @property
    def grad(self) -> torch.Tensor | None:
        """`[S]` gradient shard, or `None` between `zero_grad` and a reduction."""
        return self.param.grad if self._grad_in_param else self._grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if self._grad_in_param:
            self.param.grad = value
        else:
            self._grad = value

    def new_grad(self, *, zeroed: bool,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """
        #### Allocate `grad` for the first reduction of a step

        Uninitialised when the reduction writes all of it (`zeroed=False`).
        Allocated on the current stream, which the optimizer reads it on.

        #### Note: one rank keeps the parameter dtype

        On one rank (or in shard groups of one) the mean over ranks is the gradient
        itself, and autograd's bf16 gradients are exact as they are: widening them to
        fp32 adds no digit, only 2 bytes per element written, and 2 more for each
        later read. So a shard keeps its gradient in the parameter dtype when two
        things hold: it is the first reduction of the step on one rank (the
        [gradient's](chunk_grads.html) `alone` path), and its only reader is an update
        during the backward pass that frees it at once (`grad_read_once`, which
        `AdamFP16(free_grads=True)` sets for its device homes: nothing else may read a
        freed gradient, no clipping, no loss scaler). Every other gradient shard is
        fp32, so that sums over ranks and micro-batches, clipping and unscaling round
        in fp32. A second backward pass before `step()` adds into the narrow gradient,
        but `step()` refuses that gradient anyway: it changed after its update began.
        """
        assert self.grad is None, "the gradient shard exists already"
        allocate = torch.zeros if zeroed else torch.empty
        # [S] fp32, or the parameter dtype
        self.grad = allocate(self.param.numel(), dtype=dtype,
                             device=self.grad_device)
        return self.grad

    def zero_grad(self) -> None:
        if self.trainable:
            self._grad = None
            self.param.grad = None

    ### Where it lives

    def move_to_host(self, *, pin: bool) -> None:
        r"""
        #### Keep `param` in host memory

        Saves $p S$ device bytes. A trainable shard stays the same
        `nn.Parameter` (its `.data` moves), and `master_init` follows it (the
        optimizer of such a shard keeps its state on the host anyway).
        """
        if self.on_host:
            return
        # [S] param dtype, on the host (page-locked for DMA on a GPU)
        host = torch.empty(self.param.numel(), dtype=self.param.dtype,
                           pin_memory=pin)
        host.copy_(self.param.detach())
        if self.trainable:
            if self._grad_in_param and self.grad_device.type != "cpu":
                # the gradient stays on `grad_device`, so it leaves
                # `param.grad`, which must be on `param`'s device (see Note:
                # why the gradient lives beside the parameter)
                self._grad, self.param.grad = self.param.grad, None
                self._grad_in_param = False
            self.param.data = host
            if self._master_init is not None:
                self._master_init = self._master_init.cpu()
        else:
            self.param = host
        self.on_host = True


def shard_grad(param: torch.Tensor) -> torch.Tensor | None:
    """
    The gradient to use for `param`: its shard's fp32 `grad`, or for an ordinary
    parameter its own `.grad` (as is, in its dtype).
    """
    shard = LocalShard.of(param)
    return shard.grad if shard is not None else param.grad


def grad_device(param: torch.Tensor) -> torch.device:
    """Where `param`'s gradient lives: its shard's `grad_device`, or its own."""
    shard = LocalShard.of(param)
    return shard.grad_device if shard is not None else param.device


def param_on_host(param: torch.Tensor) -> bool:
    """Whether the engine keeps `param`, a shard, in host memory."""
    shard = LocalShard.of(param)
    return shard is not None and shard.on_host
