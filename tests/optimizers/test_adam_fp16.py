"""AdamFP16's update equals torch.optim.AdamW's, fused and foreach, fp32 and 16-bit."""

from __future__ import annotations

import math

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.state_layout import LAYOUTS
from tests import tolerance
from tests.optimizers.test_offload import (DEVICE, HYPER, STEPS_AT_MOST,
                                           assert_same)


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


# ## Parameters of any shape and layout
#
# `AdamFP16` takes any parameter, not only the engine's flat shards: a scalar
# (0-d), a transposed view registered as a parameter, a parameter whose
# `.data` is a slice of a wider tensor. Each is updated as the flat,
# contiguous parameter of its elements in row-major order: the same kernels
# read the same operands in the same order (a copy in memory order where a
# kernel needs one, see Note: operands in memory order), so on a CPU the
# result is equal bit for bit, every state included.

# the 8-bit layout's blocks: whole ones and a partial one in each N-d form
ROWS, COLS = 300, 5


def any_layout(form: str, dtype: torch.dtype) -> torch.nn.Parameter:
    """A parameter of `form`, its values fixed by the seed."""
    torch.manual_seed(0)
    if form == "0-d":
        return torch.nn.Parameter(torch.randn((), device=DEVICE).to(dtype))
    if form == "transposed":
        # [ROWS, COLS], strides (1, ROWS)
        return torch.nn.Parameter(
            torch.randn(COLS, ROWS, device=DEVICE).to(dtype).t())
    # [ROWS, COLS], strides (2 * COLS, 1): `.data` the left half of a wider
    # tensor, not viewable flat
    p = torch.nn.Parameter(torch.empty(ROWS, COLS, device=DEVICE, dtype=dtype))
    p.data = torch.randn(ROWS, 2 * COLS, device=DEVICE).to(dtype)[:, :COLS]
    return p


def flat_twin(p: torch.Tensor) -> torch.nn.Parameter:
    """`p`'s elements as a flat contiguous parameter, [numel] (a 0-d one: [1])."""
    return torch.nn.Parameter(p.detach().reshape(-1).clone())


def a_step(params, step: int) -> None:
    """The same gradient values for each parameter, in its own shape; as
    autograd leaves it, with the parameter's strides where they are dense."""
    g = torch.Generator().manual_seed(step)
    values = torch.randn(params[0].numel(), generator=g)
    for p in params:
        p.grad = torch.empty_like(p).copy_(values.view(p.shape))


@pytest.mark.parametrize("form", ["0-d", "transposed", "slice"])
@pytest.mark.parametrize("states", tuple(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("offload", [None, {0}])
def test_a_parameter_of_any_layout_is_updated_as_its_flat_elements(
        form, states, dtype, fused, offload):
    shaped = any_layout(form, dtype)
    assert shaped.dim() == 0 or not shaped.is_contiguous()
    layout = (shaped.data_ptr(), shaped.stride())
    flat = flat_twin(shaped)
    opts = [AdamFP16([p], **HYPER, fused=fused, offload=offload, states=states)
            for p in (shaped, flat)]
    for step in range(STEPS_AT_MOST):
        a_step([shaped, flat], step)
        for opt in opts:
            opt.step()
    # updated in place, in its own memory
    assert (shaped.data_ptr(), shaped.stride()) == layout
    assert_same(shaped.detach().reshape(-1), flat.detach())
    mine, theirs = (opt.state[p] for opt, p in zip(opts, (shaped, flat)))
    assert mine["step"] == theirs["step"] == STEPS_AT_MOST
    for t in LAYOUTS[states].tensors:
        assert_same(mine[t.name].reshape(-1), theirs[t.name].reshape(-1))
    # and it moved: a step that did nothing would pass the comparisons too
    assert not torch.equal(shaped.detach(), any_layout(form, dtype).detach())


# ## A 0-d parameter in every layout, against the fp32 layout
#
# Each layout is AdamW with its own roundings (its page says which), so a
# scalar parameter's weight follows the fp32 layout's within them. The
# gradients are of one sign: every moment is then a sum of positive terms,
# whose relative error after $t$ stores rounded to bf16's unit roundoff $u$
# is at most $e_t = (1 + u)^t - 1$ (each store adds one rounding to the
# sum's), and a step $\alpha \hat m / \sqrt{\hat v}$ is off by at most
# $(1 + e_t) / \sqrt{1 - e_t} - 1$ of itself. An 8-bit moment of one element
# is its own block's scale, stored exactly (its code is the top of the map).
# Both programs' fp32 kernels round in their own orders ($\rho$, each step's
# `ADAMW_ROUNDINGS`), and each stores its fp32 weight once a step ($u_{32}$);
# a bf16 weight without a master is rounded once a step too: to a
# neighbour, stochastically (one bf16 step, $2u|x|$), or with its
# compensation ($2u^2|x|$, the Kahan page's bound).

SCALAR_STEPS = 4
SCALAR_START = 2.0**-5  # a bf16 value: every layout starts from the same weight


def scalar_run(states: str, dtype, *, fused, offload, lr=HYPER["lr"]):
    """The fp32 weight each step continues from (the master, $w + c$, or the
    weight itself), from the start and after each of `SCALAR_STEPS` steps."""
    p = torch.nn.Parameter(torch.tensor(SCALAR_START, device=DEVICE, dtype=dtype))
    opt = AdamFP16([p], **{**HYPER, "lr": lr}, fused=fused, offload=offload,
                   states=states)
    g = torch.Generator().manual_seed(0)
    weights = [torch.tensor(SCALAR_START)]
    for _ in range(SCALAR_STEPS):
        # in [0.5, 1.5): of one sign
        p.grad = (0.5 + torch.rand((), generator=g)).to(DEVICE, dtype)
        opt.step()
        state = opt.state[p]
        weight = state.get("master", p.detach()).float()
        if "compensation" in state:
            weight = weight + state["compensation"].float()
        weights.append(weight.cpu().clone())
    return torch.stack(weights)


def scalar_bound(states: str, dtype, reference: torch.Tensor) -> float:
    """How far `states`' weights may be from the fp32 layout's `reference`
    after `SCALAR_STEPS` steps (the rule above)."""
    u = tolerance.unit_roundoff(torch.bfloat16)
    u32 = tolerance.unit_roundoff(torch.float32)
    rho = tolerance.sum_error(torch.float32, tolerance.ADAMW_ROUNDINGS)
    lr, decay = HYPER["lr"], 1 - HYPER["lr"] * HYPER["weight_decay"]
    # each step's AdamW move, the decay apart: [SCALAR_STEPS]
    moves = (reference[1:] - decay * reference[:-1]).abs().tolist()
    # its own weights are within far less than a step of the reference's
    top = reference.abs().max().item() + lr
    stored = {"bf16-stochastic": 2 * u, "bf16-kahan": 2 * u**2}.get(states, 0)
    if dtype == torch.float32:
        # an fp32 parameter is its own master, in every layout
        stored = 0
    rounded = states in ("bf16-moments", "bf16-stochastic", "bf16-kahan")
    bound = 0.0
    for t, move in enumerate(moves, start=1):
        e = (1 + u) ** t - 1 if rounded else 0.0
        step_error = (1 + e) / math.sqrt(1 - e) - 1 + 2 * rho
        # a difference made earlier is only decayed since, never grown
        bound += step_error * move + (2 * u32 + stored) * top
    return bound


@pytest.mark.parametrize("states", tuple(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("offload", [None, {0}])
@pytest.mark.parametrize("bug", [None, "lr x 1.1"])
def test_a_0d_parameter_follows_the_fp32_layout_within_its_roundings(
        states, dtype, fused, offload, bug):
    lr = HYPER["lr"] * (1.1 if bug else 1)
    reference = scalar_run("fp32", dtype, fused=fused, offload=offload, lr=lr)
    ours = scalar_run(states, dtype, fused=fused, offload=offload)
    bound = scalar_bound(states, dtype, reference)
    # the bound leaves room to catch an update 10% too large
    assert bound < 0.5 * SCALAR_STEPS * 0.1 * HYPER["lr"]
    assert ((ours[-1] - reference[-1]).abs().item() <= bound) == (bug is None)
