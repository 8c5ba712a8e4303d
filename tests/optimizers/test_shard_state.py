"""
`ShardStates.load_state_dict`: a state dict of any state layout is installed
as a checkpoint's state is, converted once into the optimizer's layout, and a
state that no conversion reads is refused in one line, changing nothing.

Each expectation is the conversion's own arithmetic on the saved values (a
decode, a cast, an encode, a sum $w + c$), so the comparisons are exact.
"""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from labml_zero.optimizers import blockwise_moments as bw
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.state_layout import LAYOUTS
from tests.optimizers.test_offload import DEVICE, HYPER

# a flat shard of two blocks of 8-bit moments, and a plain N-d parameter
SHAPES = ((300,), (20, 15))


def trained(states: str, shape: tuple[int, ...]):
    """Two bf16 parameters of `shape` after three steps with `states`."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=DEVICE).bfloat16())
              for _ in range(2)]
    optimizer = AdamFP16(params, **HYPER, states=states)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
        optimizer.step()
    return params, optimizer


def through_a_file(state_dict: dict) -> dict:
    """The state dict as `torch.save` writes it and a `weights_only` load
    reads it: tensors of their own, no longer the optimizer's."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def decoded(state: dict, name: str, signed: bool) -> torch.Tensor:
    """A moment as the saved layout means it: [S] fp32."""
    if f"{name}_absmax" in state:
        return bw.decode(state[name].reshape(-1), state[f"{name}_absmax"],
                         signed=signed)
    return state[name].reshape(-1).float()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("resumed", tuple(LAYOUTS))
@pytest.mark.parametrize("saved", tuple(LAYOUTS))
def test_a_state_dict_of_another_layout_is_converted_once(saved, resumed, shape):
    params, optimizer = trained(saved, shape)
    state_dict = through_a_file(optimizer.state_dict())
    # the model's weights are loaded first: a master may be made from them
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = AdamFP16(again, **HYPER, states=resumed)
    fresh.load_state_dict(state_dict)
    layout = fresh.layout
    for p, q in zip(params, again):
        old, new = optimizer.state[p], fresh.state[q]
        assert list(new) == ["step", *layout.names]
        assert new["step"] == old["step"]
        for t in layout.tensors:
            assert new[t.name].dtype == t.dtype, t.name
            assert new[t.name].shape == (q.shape if t.block is None else
                                         (bw.n_blocks(q.numel()),)), t.name
        if saved == resumed:
            for name in layout.names:
                assert torch.equal(new[name], old[name]), name
            continue
        # the moments: decoded as saved, then cast or encoded into the layout
        for name, signed in bw.CODED:
            wide = decoded(old, name, signed)
            if layout.blockwise:
                codes = torch.empty(wide.shape, dtype=torch.uint8, device=DEVICE)
                scales = wide.new_empty(bw.n_blocks(wide.numel()))
                bw.encode(wide, codes, scales, signed=signed)
                assert torch.equal(new[name].reshape(-1), codes), name
                assert torch.equal(new[f"{name}_absmax"], scales), name
            else:
                assert torch.equal(new[name].reshape(-1),
                                   wide.to(layout.dtype(name))), name
        # the weight the update goes on from: the saved master, else the
        # parameter plus its compensation, else the parameter
        w = q.detach().float()
        master = old.get("master", w + old["compensation"].float()
                         if "compensation" in old else w)
        if layout.master is not None:
            assert torch.equal(new["master"], master)
        elif layout.compensation is not None:
            assert torch.equal(new["compensation"], (master - w).bfloat16())
    for q in again:
        q.grad = torch.ones_like(q)
    fresh.step()
    assert all(bool(torch.isfinite(q).all()) for q in again)


def test_a_state_that_no_conversion_reads_is_refused_and_changes_nothing():
    params, optimizer = trained("8bit-moments", (300,))
    good = optimizer.state_dict()
    fresh_params, fresh = trained("fp32", (300,))
    before = {k: v.clone() if torch.is_tensor(v) else v
              for k, v in fresh.state[fresh_params[0]].items()}

    def spoiled(change) -> dict:
        state_dict = copy.deepcopy(good)
        change(state_dict["state"][1])
        return state_dict

    def bad_scales(s):
        s["exp_avg_absmax"] = s["exp_avg_absmax"][:1]

    refused = {
        "holds 'max_exp_avg_sq', a state of no layout":
            lambda s: s.update(max_exp_avg_sq=s["exp_avg"].float()),
        "lacks 'exp_avg_sq'": lambda s: s.pop("exp_avg_sq"),
        "has 'exp_avg' as torch.uint8 without its scales exp_avg_absmax":
            lambda s: s.pop("exp_avg_absmax"),
        "has 'exp_avg' as torch.float32 beside its scales, not uint8 codes":
            lambda s: s.update(exp_avg=s["exp_avg"].float()),
        "has 'master' of 299 elements, the parameter 300":
            lambda s: s.update(master=s["master"][:-1]),
        "has 'exp_avg_absmax' of 1 torch.float32 values; a parameter of 300 "
        "elements takes 2 or 300 floating-point scales": bad_scales,
    }
    for why, change in refused.items():
        line = (f"state 1 of the state dict {why}: it cannot be loaded as "
                f"states 'fp32'")
        with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
            fresh.load_state_dict(spoiled(change))
        # nothing changed: not the first parameter's state, loaded before
        state = fresh.state[fresh_params[0]]
        assert state.keys() == before.keys()
        for key, value in before.items():
            assert (torch.equal(state[key], value) if torch.is_tensor(value)
                    else state[key] == value), key
    assert bw.n_blocks(300) == 2
