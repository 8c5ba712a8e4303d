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
may resume with other optimizer states than it saved.
"""

from __future__ import annotations

import torch

from . import blockwise_moments, kahan_summation
from .shard_home import ShardHome


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
        the shard itself, which a host home copies (`HostHome.adopt`).
        """
        home = self._home(param)
        if state is None:
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
        self.state[param] = {"step": int(state["step"]),
                             **{name: state[name] for name in self.layout.names}}
        home.adopt(self.state[param])

    def load_state_dict(self, state_dict: dict) -> None:
        """
        `torch.optim`'s, with the states kept as saved, then each moved to its home

        `torch.optim`'s loader casts every floating-point state to its parameter's
        dtype: for a bf16 shard it would round the fp32 master and moments to bf16,
        losing what they exist to keep. The saved tensors are put back in the
        layout's dtypes (as saved, for a state of the same layout), straight on
        their home's device (`state_device`): a host home's state never passes
        through the GPU.
        """
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        positions = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for position, param in zip(positions, params):
            for key, value in saved.get(position, {}).items():
                if key != "step" and torch.is_tensor(value):
                    dtype = (self.layout.dtype(key) if key in self.layout.names
                             else value.dtype)
                    self.state[param][key] = value.to(self.state_device(param),
                                                      dtype, copy=True)
        for param, home in self.homes.of.items():
            if self.state.get(param):
                home.adopt(self.state[param])
