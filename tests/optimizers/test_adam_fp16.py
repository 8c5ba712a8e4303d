"""AdamFP16's update equals torch.optim.AdamW's, fused and foreach, fp32 and 16-bit."""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from tests import tolerance


def gradients(step: int, sizes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(n, generator=g) for n in sizes]


# The same gradients into two kernels of the update (tests/tolerance.py).
FP32_STEPS = 20
FP32_TOLERANCE = tolerance.parity(torch.float32, terms=tolerance.ADAMW_ROUNDINGS,
                                  steps=FP32_STEPS, lr=1e-2)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bug", [None, "lr x 1.001", "no weight decay"])
def test_fp32_update_equals_adamw(fused, bug):
    # `bug`: the reference a little wrong, which the tolerance must reject
    lr, weight_decay = {None: (1e-2, 0.1), "lr x 1.001": (1e-2 * 1.001, 0.1),
                        "no weight decay": (1e-2, 0.0)}[bug]
    sizes = (37, 5, 130)
    torch.manual_seed(0)
    # fp32 shards, as the engine builds them
    ours = [LocalShard(torch.randn(n), trainable=True).param for n in sizes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = AdamFP16(
        ours, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=fused
    )
    ref = torch.optim.AdamW(
        theirs, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay
    )
    for step in range(FP32_STEPS):
        for p, q, g in zip(ours, theirs, gradients(step, sizes)):
            # the engine's fp32 shard gradient lives in its LocalShard
            LocalShard.of(p).grad = g.clone()
            q.grad = g.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        assert all(LocalShard.of(p).grad is None for p in ours)
    close = all(tolerance.within(p.detach(), q.detach(), FP32_TOLERANCE)
                for p, q in zip(ours, theirs))
    assert close == (bug is None)
    # fp32 parameters are their own master: no copy
    assert all(opt.state[p]["master"].data_ptr() == p.data_ptr() for p in ours)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_shards_keep_fp32_masters(dtype):
    torch.manual_seed(1)
    exact = torch.randn(64)
    # what the engine leaves when the original weights were fp32
    shard = LocalShard(exact.to(dtype), trainable=True,
                       master_init=exact.clone()).param
    reference = torch.nn.Parameter(exact.clone())
    opt = AdamFP16([shard], lr=1e-4)
    ref = torch.optim.AdamW([reference], lr=1e-4, weight_decay=0.0)
    for step in range(30):
        (g,) = gradients(step, (64,))
        LocalShard.of(shard).grad = g.clone()
        reference.grad = g.clone()
        opt.step()
        ref.step()
    master = opt.state[shard]["master"]
    # The master follows fp32 AdamW to fp32's rounding (tests/tolerance.py);
    # updates of 1e-4 on weights of ~1 would mostly be lost in 16 bits.
    torch.testing.assert_close(master, reference.detach(), **tolerance.parity(
        torch.float32, terms=tolerance.ADAMW_ROUNDINGS, steps=30, lr=1e-4))
    assert torch.equal(shard.detach(), master.to(dtype))
    assert LocalShard.of(shard).master_init is None


def test_plain_gradients_and_bad_arguments():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    AdamFP16([p], lr=0.1).step()
    assert (p < 1).all()
    for kwargs, name in [({"lr": -1}, "lr"), ({"betas": (1.0, 0.9)}, "betas"),
                         ({"eps": -1}, "eps"), ({"weight_decay": -1}, "weight_decay")]:
        with pytest.raises(ValueError, match=name):
            AdamFP16([p], **kwargs)


def snapshot(opt: AdamFP16, params) -> list[list]:
    """Each shard, its master, its moments and its step count, copied."""
    out = []
    for p in params:
        state = opt.shard_state(p) or {}
        out.append([p.detach().clone()]
                   + [state[k].clone() for k in ("master", "exp_avg", "exp_avg_sq")
                      if k in state]
                   + [state.get("step")])
    return out


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(a, b))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("offload", [None, {0, 1}])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_early_update_never_applies_a_non_finite_gradient(fused, offload, bad):
    """Issue #20 item 6: an overflow in one shard's gradient during the
    backward pass leaves that shard, its master, moments and step count as
    they were; `step()` then says so. The other shard was updated."""
    torch.manual_seed(2)
    sizes = (37, 5)
    params = [LocalShard(torch.randn(n).bfloat16(), trainable=True,
                         master_init=torch.randn(n)).param for n in sizes]
    opt = AdamFP16(params, lr=1e-2, fused=fused, offload=offload,
                   update_during_backward=True)
    for step in range(2):
        for p, g in zip(params, gradients(step, sizes)):
            LocalShard.of(p).grad = g
            opt.grad_ready(p)
        opt.step()
        opt.zero_grad()
    before = snapshot(opt, params)
    finite, overflowed = gradients(2, sizes)
    overflowed[3] = bad
    for p, g in zip(params, (finite, overflowed)):
        LocalShard.of(p).grad = g
        opt.grad_ready(p)
    with pytest.raises(RuntimeError, match="non-finite gradient"):
        opt.step()
    after = snapshot(opt, params)
    assert same(before[1], after[1])
    assert not torch.equal(before[0][0], after[0][0])
    assert opt.shard_state(params[1])["step"] == 2


def test_shard_state_round_trip():
    """What checkpoints read and write: `shard_state` / `load_shard_state`."""
    p = LocalShard(torch.randn(6), trainable=True).param
    opt = AdamFP16([p], lr=0.1)
    assert opt.shard_state(p) is None
    LocalShard.of(p).grad = torch.ones(6)
    opt.step()
    state = opt.shard_state(p)
    assert state["step"] == 1 and set(state) == {"step", "master", "exp_avg",
                                                 "exp_avg_sq"}
    fresh = AdamFP16([p], lr=0.1)
    fresh.load_shard_state(p, state)
    assert fresh.shard_state(p)["step"] == 1
    fresh.load_shard_state(p, None)
    assert fresh.shard_state(p) is None
    with pytest.raises(ValueError, match="lacks"):
        fresh.load_shard_state(p, {"step": 1})
    with pytest.raises(ValueError, match="not one of this optimizer's"):
        fresh.load_shard_state(torch.nn.Parameter(torch.ones(2)), None)
