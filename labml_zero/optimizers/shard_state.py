r"""
---
title: A shard's optimizer state, saved and restored
summary: The part of AdamFP16 a checkpoint talks to: each shard's step, master
  and moments, handed out in the layout's dtypes and put back on the shard's home.
---

# A shard's optimizer state, saved and restored

This page deepens [AdamFP16](adam_fp16.html). A checkpoint asks the optimizer
two things for each shard $i$ of $S_i$ elements: what its state is, and to take
a state back. The state is the step $t$ and the tensors of the optimizer's
[state layout](../zero3/state_layout.html), $K$ bytes an element in all, so a
rank saves

$$\sum_i K\, S_i \ \text{bytes of optimizer state}$$

and no more: the half-precision shard itself is the model's, saved beside it.
Two rules make a saved state safe to load:

* The tensors keep the layout's dtypes both ways. `torch.optim`'s own loader
  casts every state to its parameter's dtype, which for a bf16 shard would
  round the fp32 master and moments to bf16 and lose what they exist to keep.
* Each tensor goes straight to its shard's home
  ([where a shard's optimizer state lives](shard_home.html)): a host home's
  state never passes through the GPU.

A state saved with another layout is converted as it is installed, so a run
may resume with other optimizer states than it saved; a state that no
conversion can read is refused in one line, before anything changes.
A load also ends a captured step (see Note: a load ends a captured step).
"""

from __future__ import annotations

import torch

from labml_zero.zero3.state_layout import LAYOUTS, StateLayout

from . import blockwise_moments, kahan_summation
from .shard_home import ShardHome

# What a saved state may name: its step and the states of any layout
SAVED_NAMES = frozenset({"step", *(name for layout in LAYOUTS.values()
                                   for name in layout.names)})


class ShardStates:
    """
    ## The optimizer's state, shard by shard

    A part of `AdamFP16` (it is one of its bases): it reads the optimizer's
    `homes`, `layout`, `state` and `early_updates`, which `AdamFP16` builds.
    """

    def _home(self, param: torch.Tensor) -> ShardHome:
        home = self.homes.of.get(param)
        if home is None:
            raise ValueError("the parameter is not one of this optimizer's")
        return home

    def state_device(self, param: torch.Tensor) -> torch.device:
        """Where `param`'s master and moments belong (for checkpoint loading;
        a parameter not updated here, a frozen chunk's shard: its own device)."""
        home = self.homes.of.get(param)
        return param.device if home is None else home.state_device

    def init_state(self, param: torch.Tensor) -> dict:
        """
        ### The state of one shard

        `step` and each state of the layout (`master` [S] fp32, `exp_avg` and
        `exp_avg_sq` [S] in the layout's dtype), allocated by its home at the
        first use (host tensors for a host home,
        whose master never aliases the shard).

        The master starts from the shard's `master_init` when the engine
        kept one (the original fp32 weights of a half-precision chunk),
        otherwise from the parameter itself; it is taken at the first step,
        or at construction for a shard whose state is on the host. An fp32
        parameter *is* its own master: no copy, $K = 8$ extra bytes
        (tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
        instead of {{py: memory_model.OPTIMIZER_BYTES}} with fp32 states.
        """
        return self._state(self._home(param))

    def _state(self, home: ShardHome) -> dict:
        state = self.state[home.param]
        if not state:
            state.update(home.new_state())
        return state

    def shard_state(self, param: torch.Tensor) -> dict | None:
        """
        ### `param`'s state, for a checkpoint

        `{"step": int, "master", "exp_avg", "exp_avg_sq"}` ([S] each, in the
        layout's dtypes), or `None` before its first step.
        """
        # a checkpoint must not hold a step whose early update was skipped
        self.early_updates.raise_if_skipped(self.state)
        # `.get`, not `[]`: `self.state` is a defaultdict and must not grow
        state = self.state.get(param)
        if not state:
            return None
        return {"step": int(state["step"]),
                **{name: state[name] for name in self.layout.names}}

    def load_shard_state(self, param: torch.Tensor, state: dict | None) -> None:
        """
        ### Install a checkpoint's state for `param`, or forget it (`None`)

        The tensors are used as given (put them on `state_device(param)`), cast
        to the layout's dtypes where they differ (a state saved with another
        choice; 8-bit moments are encoded or decoded:
        [`convert`](blockwise_moments.html), a compensation made or added:
        [`converted`](kahan_summation.html)); an fp32 shard's `master` may be
        the shard itself, which a host home copies (`HostHome.adopt`). A
        captured step ends (see Note: a load ends a captured step).
        """
        home = self._home(param)
        if state is None:
            self._end_capture()
            self.state.pop(param, None)
            return
        # a compensation made from the master, or a master from the pair
        state = kahan_summation.converted(state, self.layout, param.detach())
        missing = {"step", *(t.name for t in self.layout.tensors
                             if t.block is None)} - set(state)
        if missing:
            raise ValueError(f"shard state lacks {sorted(missing)}")
        if self.layout.blockwise or "exp_avg_absmax" in state:
            # 8-bit moments, kept or saved: encoded or decoded here, once
            state = blockwise_moments.convert(state,
                                              blockwise=self.layout.blockwise)
        self._end_capture()
        self.state[param] = {"step": int(state["step"]),
                             **{name: state[name] for name in self.layout.names}}
        home.adopt(self.state[param])

    def load_state_dict(self, state_dict: dict) -> None:
        r"""
        ### `torch.optim`'s loader, each state installed as a checkpoint's is

        `torch.optim`'s loader casts every floating-point state to its
        parameter's dtype: for a bf16 shard it would round the fp32 master and
        moments to bf16, losing what they exist to keep, and it would take a
        state saved with another layout as it is (8-bit codes as moment
        values). So each saved state goes through `load_shard_state`, as a
        checkpoint's does: kept as saved within the layout, converted from
        another, straight onto its home's device (`state_device`: a host
        home's state never passes through the GPU).

        A layout with a master loaded from one without (`"bf16-stochastic"`,
        `"bf16-kahan"`) takes it from the parameter, $w$, or $w + c$ beside a
        compensation: load the model's weights first. Every saved state is
        checked (`refusal`) before anything changes.
        """
        saved = state_dict["state"]
        positions = [i for group in state_dict["param_groups"]
                     for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for position, param in zip(positions, params):
            why = refusal(saved.get(position) or {}, param, self.layout)
            if why is not None:
                raise ValueError(f"state {position} of the state dict {why}: "
                                 f"it cannot be loaded as states "
                                 f"{self.layout.name!r}")
        super().load_state_dict(state_dict)
        self._end_capture()
        for position, param in zip(positions, params):
            state = saved.get(position)
            if not state:
                continue
            device = self.state_device(param)
            # copies: the saved dict (another optimizer's own, maybe) stays
            # its owner's
            tensors = {key: value.to(device, copy=True)
                       for key, value in state.items() if key != "step"}
            master = self.layout.master
            if master is not None and master.name not in tensors:
                # the weight as a master (an fp32 one is its own; a
                # compensation, where saved, is added in `load_shard_state`)
                tensors[master.name] = param.detach().to(device, master.dtype)
            self.load_shard_state(param, {"step": int(state["step"]), **tensors})

    def _end_capture(self) -> None:
        r"""
        #### Note: a load ends a captured step

        A [captured step](captured_update.html) replays the kernels it
        recorded on the tensors it recorded them with (a CUDA graph keeps
        their addresses), and each replay sets every updated shard's count to
        $t_c + r$. A load puts new tensors in the state and a new count $t$:
        a replay would update the old tensors and write its own count over
        the loaded one, so that a resume would go on from the capture's
        count, not the checkpoint's. So
        any load forgets the capture (`capture = None`), and the
        [`GraphedStep`](graphed_step.html) that recorded it, finding it gone,
        warms up and records again from the loaded state
        (tested: tests/optimizers/test_graphed_step.py::test_a_load_ends_the_captured_step).
        """
        self.capture = None


def refusal(saved: dict, param: torch.Tensor, layout: StateLayout) -> str | None:
    r"""
    ### Why a saved state cannot be loaded into `layout`, or `None`

    `saved` is one parameter's state in a state dict (empty: none). It may
    hold `step` and the states of any [layout](../zero3/state_layout.html),
    and must hold the moments `layout` keeps (a master is taken from the
    parameter, a compensation made from it). Each per-element state has the
    parameter's $S$ elements, floating point, but a moment beside its
    `_absmax` scales: uint8 codes, with one scale a block or one an element.
    """
    if not saved:
        return None
    unknown = sorted(set(saved) - SAVED_NAMES)
    if unknown:
        return f"holds {unknown[0]!r}, a state of no layout"
    needed = {"step", *(t.name for t in layout.tensors
                        if t.block is None and not t.master
                        and not t.compensation)}
    missing = sorted(needed - set(saved))
    if missing:
        return f"lacks {missing[0]!r}"
    n = param.numel()
    for name, value in saved.items():
        if name == "step":
            continue
        if not torch.is_tensor(value):
            return f"has {name!r} as a {type(value).__name__}, not a tensor"
        if name.endswith("_absmax"):
            blocks = blockwise_moments.n_blocks(n)
            if not value.is_floating_point() or value.numel() not in (blocks, n):
                return (f"has {name!r} of {value.numel()} {value.dtype} values; "
                        f"a parameter of {n} elements takes {blocks} or {n} "
                        f"floating-point scales")
            continue
        if value.numel() != n:
            return (f"has {name!r} of {value.numel()} elements, the parameter "
                    f"{n}")
        coded = f"{name}_absmax" in saved
        if coded and value.dtype != torch.uint8:
            return f"has {name!r} as {value.dtype} beside its scales, not uint8 codes"
        if not coded and not value.is_floating_point():
            return f"has {name!r} as {value.dtype} without its scales {name}_absmax"
    return None
