"""
`states="bf16-stochastic"`: no master, bf16 moments, each update rounded into
the bf16 shard stochastically.

The reference is `torch.optim.AdamW` on the bf16 weight widened to fp32, its
moments rounded to bf16 and its result rounded with `stochastic_round` and the
same bits after every step: the same kernel on the same operands, so the
tolerance is zero (see tests/optimizers/test_narrow_moments.py). The rounding
itself is tested on its own: unbiased, within the spread of its draws.
"""

from __future__ import annotations

import math

import pytest
import torch

from labml_zero.optimizers import narrow_moments, stochastic_rounding
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.optimizers.stochastic_rounding import noise, stochastic_round
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.state_layout import BF16_STOCHASTIC
from tests import tolerance
from tests.optimizers import no_master_steps as steps_driver
from tests.optimizers.test_narrow_moments import MOMENTS, round_moments, sharded
from tests.optimizers.test_offload import (DEVICE, HYPER, assert_same, gradients,
                                           run_steps, set_grad, shards)

STEPS = 20
# a draw is one of two neighbours a step $h$ apart: its spread is at most
# $h / 2$, and the mean of $n$ independent draws is within $Z h / (2\sqrt{n})$
# of $x$ but for a chance below $10^{-9}$ per value at $Z = 6$
Z = 6


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above fp32 `x` (x > 0)."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)
    up = ((down.view(torch.int32) + 65536)).view(torch.float32)
    return down, up


def test_stochastic_round_is_unbiased_and_picks_a_neighbour():
    torch.manual_seed(0)
    x = torch.rand(64) + 0.5  # [64] fp32 in [0.5, 1.5)
    draws = 4096
    down, up = neighbours(x)
    total = torch.zeros(64, dtype=torch.float64)
    for step in range(draws):
        r = stochastic_round(x, noise(0, 64, torch.tensor(float(step)), salt=3))
        assert r.dtype == torch.bfloat16
        assert bool(((r.float() == down) | (r.float() == up)).all())
        total += r.double()
    spread = (up - down).double() / 2
    assert bool(((total / draws - x.double()).abs()
                 <= Z * spread / math.sqrt(draws)).all())
    # a bf16 value has nothing to round
    exact = x.bfloat16()
    assert torch.equal(stochastic_round(exact.float(), noise(0, 64, torch.tensor(1.0),
                                                             salt=0)), exact)
    # negative values round by magnitude, symmetrically
    assert torch.equal(stochastic_round(-x, noise(0, 64, torch.tensor(5.0), salt=1)),
                       -stochastic_round(x, noise(0, 64, torch.tensor(5.0), salt=1)))


def test_small_updates_survive_on_average():
    """Weights of 1 in bf16 (a step of $2^{-7}$ above 1) each get 1,000 updates
    of $10^{-4}$, below half a step: rounded to nearest nothing moves; rounded
    stochastically the mean over the weights moves by the sum, $0.1$."""
    n, updates, delta = 4096, 1000, 1e-4
    nearest = torch.ones(n, dtype=torch.bfloat16)
    stochastic = nearest.clone()
    for step in range(updates):
        nearest = (nearest.float() + delta).bfloat16()
        bits = noise(0, n, torch.tensor(float(step)), salt=7)
        stochastic = stochastic_round(stochastic.float() + delta, bits)
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))
    # each update's draw spreads by at most half a step, 2^-8; independent
    # over updates and weights
    spread = 2**-8 * math.sqrt(updates) / math.sqrt(n)
    assert abs(stochastic.double().mean().item() - (1 + updates * delta)) <= Z * spread


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bug", [None, "rounded to nearest", "moments kept fp32",
                                 "lr x 1.01"])
def test_the_update_is_adamw_rounded_stochastically(fused, bug):
    ours = shards(torch.bfloat16)
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = AdamFP16(ours, **HYPER, fused=fused, states="bf16-stochastic")
    lr = HYPER["lr"] * (1.01 if bug == "lr x 1.01" else 1)
    ref = torch.optim.AdamW(theirs, **{**HYPER, "lr": lr}, fused=fused or None,
                            foreach=not fused)
    for step in range(STEPS):
        for p, q, g in zip(ours, theirs, gradients(step)):
            set_grad(p, g.clone())
            q.grad = g.clone()
        opt.step()
        ref.step()
        round_moments(ref, None if bug != "moments kept fp32" else bug)
        with torch.no_grad():
            for salt, q in enumerate(theirs):
                # the step count the kernel saw, as a tensor (as the optimizer's)
                bits = noise(0, q.numel(),
                             torch.tensor(float(step + 1), device=DEVICE), salt)
                rounded = (q.bfloat16() if bug == "rounded to nearest"
                           else stochastic_round(q, bits))
                q.copy_(rounded.float())
        opt.zero_grad()
    # weights and moments stored differently: none on CPU, bit for bit; a
    # GPU's kernels round their fp32 values in their own orders, so a few
    # values may round to the other neighbour
    differing = sum(int((p.detach().float() != q.detach()).sum())
                    + sum(int((opt.state[p][key]
                               != ref.state[q][key].bfloat16()).sum())
                          for key in MOMENTS)
                    for p, q in zip(ours, theirs))
    elements = 3 * sum(p.numel() for p in ours)
    allowed = (0 if DEVICE.type == "cpu"
               else steps_driver.flips_at_most(elements, STEPS))
    assert (differing <= allowed) == (bug is None)
    for p in ours:
        assert list(opt.state[p]) == ["step", *MOMENTS]
        assert LocalShard.of(p).master_init is None  # dropped, not kept


def test_an_early_update_is_the_same_update():
    early_update_is_the_same_update("bf16-stochastic")


def early_update_is_the_same_update(states: str) -> None:
    """Updated during the backward pass or after it, a layout without a
    master: the same bits, every state of the layout."""
    after, during = shards(torch.bfloat16), shards(torch.bfloat16)
    after_opt = AdamFP16(after, **HYPER, states=states)
    during_opt = AdamFP16(during, **HYPER, update_during_backward=True,
                          states=states)
    for step in range(5):
        for a, b, g in zip(after, during, gradients(step)):
            set_grad(a, g.clone())
            set_grad(b, g.clone())
            during_opt.grad_ready(b)
        after_opt.step()
        during_opt.step()
        after_opt.zero_grad()
        during_opt.zero_grad()
    for a, b in zip(after, during):
        assert torch.equal(a, b)
        for key in after_opt.layout.names:
            assert torch.equal(after_opt.state[a][key], during_opt.state[b][key])


def test_what_cannot_go_without_a_master_is_refused():
    half = [LocalShard(torch.ones(4).half(), trainable=True).param]
    with pytest.raises(ValueError, match="bf16 or fp32 parameters, got torch.float16"):
        AdamFP16(half, states="bf16-stochastic")
    with pytest.raises(ValueError, match="bf16 or fp32 parameters, got torch.float16"):
        AdamFP16(half, states="bf16-stochastic", offload={0})


def test_resume_is_bit_exact_and_converts_from_fp32(tmp_path, capsys):
    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint

    model, opt = sharded(torch.bfloat16, "bf16-stochastic")
    run_steps(model, opt, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    run_steps(model, opt, range(3, 6))
    fresh, fresh_opt = sharded(torch.bfloat16, "bf16-stochastic")
    assert load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt).converted is None
    run_steps(fresh, fresh_opt, range(3, 6))
    for a, b in zip(model.chunks, fresh.chunks):
        assert torch.equal(a.shard, b.shard)
    # from fp32 states: the master dropped, the shard (its nearest rounding)
    # kept, the moments rounded
    full, full_opt = sharded(torch.bfloat16, "fp32")
    run_steps(full, full_opt, range(3))
    save_checkpoint(tmp_path / "fp32", full, full_opt)
    capsys.readouterr()
    fresh, fresh_opt = sharded(torch.bfloat16, "bf16-stochastic")
    loaded = load_checkpoint(tmp_path / "fp32", fresh, fresh_opt)
    assert loaded.converted.endswith("saved as 'fp32', converted once to "
                                     "'bf16-stochastic'")
    assert capsys.readouterr().err == loaded.converted + "\n"
    for a, b in zip(full.chunks, fresh.chunks):
        assert torch.equal(a.shard, b.shard)
    for p, q in zip(full_opt.param_groups[0]["params"],
                    fresh_opt.param_groups[0]["params"]):
        assert set(fresh_opt.state[q]) == {"step", *MOMENTS}
        assert torch.equal(fresh_opt.state[q]["exp_avg"],
                           full_opt.state[p]["exp_avg"].bfloat16())
    # and back: the master is the shard widened, exactly
    save_checkpoint(tmp_path / "back", fresh, fresh_opt)
    again, again_opt = sharded(torch.bfloat16, "fp32")
    load_checkpoint(tmp_path / "back", again, again_opt)
    for q in again_opt.param_groups[0]["params"]:
        # each optimized parameter is a trainable chunk's shard
        assert torch.equal(again_opt.state[q]["master"], q.detach().float())
    assert BF16_STOCHASTIC.bytes_per_element() == 2 + 2


FLIPS_AT_MOST = steps_driver.flips_at_most(steps_driver.SIZE, steps_driver.STEPS)


def twin_step(state, grad, step, lr):
    stochastic_rounding.update(
        steps_driver.fp32_kernel(step, lr), [state["weight"]], [grad],
        [state["exp_avg"]], [state["exp_avg_sq"]],
        step=torch.full((), float(step), device=DEVICE), salts=[SALT])


def one_pass_step(state, grad, step, lr):
    step_t, coefficients = steps_driver.scalars(step, lr)
    run = (stochastic_rounding.compiled_update() if DEVICE.type == "cuda"
           else stochastic_rounding.adamw_stochastic_)
    run(state["weight"], (state["exp_avg"], state["exp_avg_sq"]), grad,
        coefficients, None, steps_driver.betas(), step_t, SALT)


SALT = 3


def flips(a: dict, b: dict) -> int:
    """Weights that the two programs rounded differently (the moments, which
    read no weight, within one step of bf16)."""
    for key in MOMENTS:
        torch.testing.assert_close(a[key].float(), b[key].float(),
                                   rtol=torch.finfo(torch.bfloat16).eps, atol=0)
    return int((a["weight"] != b["weight"]).sum())


def test_one_pass_is_the_twin_within_rounding():
    reference = steps_driver.train(twin_step, MOMENTS)
    done = steps_driver.train(one_pass_step, MOMENTS)
    assert flips(done, reference) <= FLIPS_AT_MOST
    # a flip picks the other neighbour: bf16 bit patterns one apart
    apart = (done["weight"].view(torch.int16).int()
             - reference["weight"].view(torch.int16).int()).abs()
    assert int(apart.max()) <= 1
    wrong = steps_driver.train(one_pass_step, MOMENTS,
                               lr=steps_driver.HYPER["lr"] * 1.01)
    assert flips(wrong, reference) > FLIPS_AT_MOST


# A plain parameter of any shape (AdamFP16 takes any): `ROWS` x `COLS`
ROWS, COLS = 10, 3


@pytest.mark.parametrize("fused", [True, False])
def test_a_parameter_of_any_shape_is_rounded_as_its_flat_elements(fused,
                                                                  monkeypatch):
    """An N-d bf16 parameter is updated as the flat one of its elements,
    bit for bit: each element draws the bits of its flat position. The twin
    slices dim 0, here 4 rows of 3 at a time, the flat run's slices of 12
    elements, so both kernels see the same operands and only the bits'
    positions could differ: the second slice starts at element 12, not 4."""
    torch.manual_seed(0)
    start = torch.randn(ROWS * COLS, device=DEVICE).bfloat16()
    runs = {}
    for shape, wide_numel in (((ROWS * COLS,), 4 * COLS), ((ROWS, COLS), 4)):
        monkeypatch.setattr(narrow_moments, "WIDE_NUMEL", wide_numel)
        p = torch.nn.Parameter(start.clone().view(shape))
        opt = AdamFP16([p], **HYPER, fused=fused, states="bf16-stochastic")
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            p.grad = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
            opt.step()
        runs[len(shape)] = (p.detach().reshape(-1),
                            *(opt.state[p][k].reshape(-1) for k in MOMENTS))
    flat, square = runs[1], runs[2]
    for a, b in zip(flat, square):
        assert_same(a, b)
    assert not torch.equal(flat[0], start)


def test_the_one_pass_rounds_a_parameter_of_any_shape():
    """`adamw_stochastic_` on an N-d shard: the flat shard's update, its
    bits by flat position."""
    done = {}
    for shape in ((ROWS * COLS,), (ROWS, COLS)):
        torch.manual_seed(0)
        weight = torch.randn(shape, device=DEVICE).bfloat16()
        moments = (torch.zeros_like(weight), torch.zeros_like(weight))
        step_t, coefficients = steps_driver.scalars(1, steps_driver.HYPER["lr"])
        grad = torch.randn(shape, device=DEVICE)
        stochastic_rounding.adamw_stochastic_(
            weight, moments, grad, coefficients, None, steps_driver.betas(),
            step_t, SALT)
        done[len(shape)] = (weight.reshape(-1), *(m.reshape(-1) for m in moments))
    for a, b in zip(done[1], done[2]):
        assert torch.equal(a, b)
