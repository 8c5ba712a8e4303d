r"""
---
title: The optimizer's state layout
summary: The tensors an optimizer keeps per shard element (name, dtype, bytes),
  declared once, and the typed contract between the engine and its optimizer;
  the checkpoint, the memory model, placement and the calculator read them here.
---

# The optimizer's state layout

For every trainable element a shard optimizer keeps a few tensors of its own
beside the shard: with AdamW an fp32 master and the two moments $m$ and $v$.
Their bytes per element are the memory model's $K$,

$$K = \sum_{s \in \text{layout}} b_s,$$

$b_s$ the bytes of state $s$'s dtype:
{{py: state_layout.FP32_STATES.bytes_per_element()}} with fp32 moments,
{{py: state_layout.BF16_MOMENTS.bytes_per_element()}} with bf16 ones and
{{py: state_layout.BF16_STOCHASTIC.bytes_per_element()}} without a master,
{{py: state_layout.BF16_KAHAN.bytes_per_element()}} without a master but with
a bf16 compensation and
{{py: state_layout.EIGHT_BIT_MOMENTS.bytes_per_element() | .5g}} with 8-bit
ones. Each layout is declared once, here; the optimizer, the
[checkpoint](checkpoint/index.html), the [memory model](../planner/memory_model.html),
the {{see: placement}} and the calculator read it. Adding a state is one entry
below, and `bytes_table` sets them side by side. Last comes `ShardOptimizer`, the typed contract the engine calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["StateTensor", "StateLayout", "FP32_STATES", "BF16_MOMENTS",
           "BF16_STOCHASTIC", "BF16_KAHAN", "EIGHT_BIT_MOMENTS", "EIGHT_BIT_BLOCK",
           "LAYOUTS", "state_layout", "BF16_WEIGHT_BYTES", "bytes_table",
           "ShardOptimizer"]


@dataclass(frozen=True)
class StateTensor:
    r"""
    ## One state, per shard element

    * `name`: its key in the optimizer's state and in a checkpoint
      (`exp_avg`, as in `torch.optim.AdamW`'s state, so a state dict reads the
      same).
    * `dtype`: the dtype it is kept and saved in.
    * `master`: whether it is the master copy of the weights, the one the update
      writes and the shard is the rounding of; a shard of the master's dtype
      is its own master.
    * `block`: `None` for one value per element; $B$ for one value per block
      of $B$ elements (an 8-bit moment's scales), $\lceil S / B \rceil$ values
      per shard, the last block partial.
    * `compensation`: whether it is the low-order part of the weight, $c$ in
      $w + c$ ([Kahan summation](../optimizers/kahan_summation.html)). It is
      not a master (the shard is the weight), so it is saved, loaded and
      resharded as a moment is; a load of a layout without one computes it.

    Every state of a shard lives in the shard's
    [home](../optimizers/shard_home.html), device or host, together: the
    update reads and writes all of them at once, so a state kept apart would
    cross the host link at every step.
    """

    name: str
    dtype: torch.dtype
    master: bool = False
    block: int | None = None
    compensation: bool = False

    @property
    def nbytes(self) -> float:
        """$b_s$, bytes per element: a per-block value's bytes over $B$."""
        if self.block is None:
            return self.dtype.itemsize
        return self.dtype.itemsize / self.block

    def numel(self, shard_numel: int) -> int:
        """Its values for a shard of `shard_numel` elements."""
        if self.block is None:
            return shard_numel
        return -(-shard_numel // self.block)


@dataclass(frozen=True)
class StateLayout:
    """
    ## A choice of states

    * `name`: the choice as a user names it (`states="bf16-moments"`).
    * `tensors`: its states, the master first; at most one master, and a
      compensation only where there is none.
    """

    name: str
    tensors: tuple[StateTensor, ...]

    def __post_init__(self):
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"layout {self.name!r} names a state twice: {names}")
        if sum(t.master for t in self.tensors) > 1:
            raise ValueError(f"layout {self.name!r} has more than one master")
        if self.compensation is not None and self.master is not None:
            raise ValueError(f"layout {self.name!r} has a master and a "
                             "compensation: the master already keeps every bit")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def master(self) -> StateTensor | None:
        return next((t for t in self.tensors if t.master), None)

    @property
    def compensation(self) -> StateTensor | None:
        return next((t for t in self.tensors if t.compensation), None)

    @property
    def moments(self) -> tuple[StateTensor, ...]:
        """Every state but the master, in order (a compensation too: the
        checkpoint saves and reshards it as it does a moment)."""
        return tuple(t for t in self.tensors if not t.master)

    def dtype(self, name: str) -> torch.dtype:
        for t in self.tensors:
            if t.name == name:
                return t.dtype
        raise ValueError(f"layout {self.name!r} has no state {name!r}; it has "
                         f"{', '.join(self.names)}")

    @property
    def dtypes(self) -> dict[str, str]:
        """Each state's dtype by name, as a checkpoint records it."""
        return {t.name: str(t.dtype).removeprefix("torch.") for t in self.tensors}

    @property
    def blockwise(self) -> bool:
        """Whether some state is kept per block (8-bit moments)."""
        return any(t.block is not None for t in self.tensors)

    def bytes_per_element(self, *, shard_is_master: bool = False) -> float:
        r"""
        ### $K$, the bytes per trainable element

        $\sum_s b_s$ (whole unless a state is kept per block); with
        `shard_is_master` (an fp32 shard on the device,
        see `shard_is_master`) less the master's bytes: the shard itself is
        the master.
        """
        master = self.master
        drop = master.nbytes if shard_is_master and master is not None else 0
        return sum(t.nbytes for t in self.tensors) - drop

    def host_bytes_per_element(self, param_bytes: int) -> float:
        r"""
        ### $K_h$, the state's bytes per element in a host home

        All of $K$ (a host master never aliases the shard), and for a layout
        without a master the host's copy of the weight, $p$ bytes: the update
        works on the weight, which the host must hold to update it
        (see the host home in [where a shard's optimizer state
        lives](../optimizers/shard_home.html)). The staging buffer is the
        memory model's, apart.
        """
        weight = param_bytes if self.master is None else 0
        return self.bytes_per_element() + weight

    def shard_is_master(self, param_bytes: int) -> bool:
        """Whether a device shard of `param_bytes` per element is its own master:
        the master is fp32, and fp32 is the only dtype of 4 bytes the engine
        shards."""
        master = self.master
        return master is not None and master.nbytes == param_bytes


# ## The choices
#
# `FP32_STATES` is AdamW's state as `torch.optim.AdamW` keeps it for an fp32
# parameter. `BF16_MOMENTS` keeps the master in fp32 (the update still adds
# every small step to it) and rounds $m$ and $v$ to bf16 each time they are
# stored: the update itself computes in fp32 from the rounded moments it
# read, and a bf16 moment carries 8 significant bits (7 stored), a relative
# error of at most $2^{-8}$ per store (see the optimizer's page). `BF16_STOCHASTIC` keeps
# no master at all: the bf16 shard is the weight, and each update is rounded
# into it stochastically, so that small updates survive on average.
# `BF16_KAHAN` keeps no master either, but a bf16 compensation $c$ beside
# the bf16 weight $w$: the pair $w + c$ carries twice bf16's mantissa, and
# what rounding $w$ to nearest loses is kept in $c$ (Kahan summation).
# Without a master the update works on the weight itself, so a host home of
# either keeps a copy of it beside the states: $K + p$ bytes an element on
# the host (`host_bytes_per_element`), $K$ saved on the device.
# `EIGHT_BIT_MOMENTS` keeps the fp32 master and stores each moment as uint8
# codes with one fp32 absmax scale per block of `EIGHT_BIT_BLOCK` elements
# ([8-bit moments](../optimizers/blockwise_moments.html)).

EIGHT_BIT_BLOCK = 256
"""$B$, elements per scale of an 8-bit moment."""

FP32_STATES = StateLayout("fp32", (
    StateTensor("master", torch.float32, master=True),
    StateTensor("exp_avg", torch.float32),
    StateTensor("exp_avg_sq", torch.float32),
))
BF16_MOMENTS = StateLayout("bf16-moments", (
    StateTensor("master", torch.float32, master=True),
    StateTensor("exp_avg", torch.bfloat16),
    StateTensor("exp_avg_sq", torch.bfloat16),
))
BF16_STOCHASTIC = StateLayout("bf16-stochastic", (
    StateTensor("exp_avg", torch.bfloat16),
    StateTensor("exp_avg_sq", torch.bfloat16),
))
BF16_KAHAN = StateLayout("bf16-kahan", (
    StateTensor("compensation", torch.bfloat16, compensation=True),
    StateTensor("exp_avg", torch.bfloat16),
    StateTensor("exp_avg_sq", torch.bfloat16),
))
EIGHT_BIT_MOMENTS = StateLayout("8bit-moments", (
    StateTensor("master", torch.float32, master=True),
    StateTensor("exp_avg", torch.uint8),
    StateTensor("exp_avg_absmax", torch.float32, block=EIGHT_BIT_BLOCK),
    StateTensor("exp_avg_sq", torch.uint8),
    StateTensor("exp_avg_sq_absmax", torch.float32, block=EIGHT_BIT_BLOCK),
))
LAYOUTS = {layout.name: layout
           for layout in (FP32_STATES, BF16_MOMENTS, BF16_STOCHASTIC,
                          BF16_KAHAN, EIGHT_BIT_MOMENTS)}
"""Every choice by name; the first is the default."""


def state_layout(choice: str | StateLayout) -> StateLayout:
    """A layout by name (a layout is returned as it is); a clear error names
    the choices."""
    if isinstance(choice, StateLayout):
        return choice
    layout = LAYOUTS.get(choice)
    if layout is None:
        raise ValueError(f"states must be one of {', '.join(LAYOUTS)}; "
                         f"got {choice!r}")
    return layout


# The parameter's own bytes beside its states: a bf16 weight in the chunk.
BF16_WEIGHT_BYTES = torch.bfloat16.itemsize


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bytes_table() -> str:
    r"""
    ## Bytes per parameter, by choice

    {{py: state_layout.bytes_table()}}

    Each row is read from its layout: $K$ its states' bytes per trainable
    element, and beside it $2 + K$ with the bf16 weight the chunk holds (the
    gradient's bytes depend on the engine's settings and are the memory
    model's). `bf16-moments` halves the moments and keeps the fp32 master,
    which still adds every small step. `8bit-moments` pays a fraction of a
    byte per element for its per-block scales. `bf16-stochastic` drops the
    master: the bf16 weight is the only copy, and an update smaller than half
    a bf16 step survives only on average, by [stochastic
    rounding](../optimizers/stochastic_rounding.html). `bf16-kahan` pays 2
    bytes more for a bf16 compensation, the part of the weight the bf16 shard
    could not hold, so that such an update survives every time, to twice
    bf16's precision ([Kahan summation](../optimizers/kahan_summation.html)).
    """
    rows = ["| choice | master | moments | $K$ (bytes) | with the bf16 weight |",
            "| --- | --- | --- | --- | --- |"]
    for layout in LAYOUTS.values():
        master, compensation = layout.master, layout.compensation
        moments = sorted({_dtype_name(t.dtype) for t in layout.moments
                          if t.block is None and not t.compensation})
        moments += sorted({f"{_dtype_name(t.dtype)} scale per {t.block}"
                           for t in layout.moments if t.block is not None})
        kept = _dtype_name(master.dtype) if master else "none"
        if compensation:
            kept += f"; {_dtype_name(compensation.dtype)} compensation"
        k = layout.bytes_per_element()
        rows.append(f"| `{layout.name}` | {kept} | "
                    f"{', '.join(moments)} | {k:.6g} | {BF16_WEIGHT_BYTES + k:.6g} |")
    return "\n".join(rows)


class ShardOptimizer(Protocol):
    """
    ## What the engine and its checkpoint call on an optimizer

    Typed, so that no caller probes the optimizer with `hasattr`. `AdamFP16`
    implements it; a checkpoint, the placement probe and the engine's
    gradient callbacks take a `ShardOptimizer` and call these, nothing else.

    * `layout`: its `StateLayout`.
    * `update_during_backward`: whether `grad_ready` may update the shard.
    * `state_device(param)`: where `param`'s states belong (its home's device;
      a parameter not updated here, its own).
    * `shard_state(param)`: `{"step": int, <each state>: [S] tensor}` in the
      layout's dtypes (a per-block state: one value per block), or `None`
      before the first step.
    * `load_shard_state(param, state)`: install such a dict (converted to the
      layout's dtypes), or forget the state (`None`).
    * `grad_ready(param, after=...)`: the shard's gradient is final.
    """

    layout: StateLayout
    update_during_backward: bool

    def state_device(self, param: torch.Tensor) -> torch.device: ...

    def shard_state(self, param: torch.Tensor) -> dict | None: ...

    def load_shard_state(self, param: torch.Tensor, state: dict | None) -> None: ...

    def grad_ready(self, param: torch.Tensor, *, after=None) -> None: ...
