r"""
The one-pass update of 8-bit moments (`blockwise_moments.one_pass`) against
its twin, `blockwise_moments.update`: decode, `AdamFP16`'s fp32 kernel,
encode, then the copy that rounds the master into the shard.

With the `foreach` kernel the twin runs the same operations on the same
values, so codes, scales, master and shard are equal bit for bit. The fused
fp32 kernel rounds $v$ in its own order: one step from the same state agrees
within the fp32 roundings of an update (tests/tolerance.py), which a codes'
rounding boundary may turn into one code's difference.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

from labml_zero.optimizers import blockwise_moments as bw
from labml_zero.optimizers import rounded_update as R
from labml_zero.optimizers.adam_fp16 import AdamFP16
from tests import tolerance

HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
STEPS = 5
# a shard of less than a block, one of whole blocks, and two with a partial
# last block; with `SLICE` the largest spans several slices of the CPU's loop
SIZES = (37, 256, 513, 1000)
SLICE = 2 * bw.BLOCK
# one step of one update, its roundings (tests/tolerance.py)
ONE_STEP = tolerance.parity(torch.float32, terms=tolerance.ADAMW_ROUNDINGS)


@pytest.fixture(autouse=True)
def small_slices(monkeypatch):
    """Slices of two blocks, so that the slice loops of both paths run."""
    monkeypatch.setattr(bw, "WIDE_NUMEL", SLICE)


def start(n: int, seed: int = 0) -> dict:
    """A shard's state as `AdamFP16` makes it: zero moments."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    return {"master": master, "shard": master.bfloat16(),
            "exp_avg": torch.zeros(n, dtype=torch.uint8),
            "exp_avg_absmax": torch.zeros(bw.n_blocks(n)),
            "exp_avg_sq": torch.zeros(n, dtype=torch.uint8),
            "exp_avg_sq_absmax": torch.zeros(bw.n_blocks(n))}


def clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def gradient(n: int, step: int, dtype=torch.float32) -> torch.Tensor:
    """Gradients over several orders of magnitude, as a model's are."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, generator=g) * 10 ** (-3 * torch.rand(n, generator=g))
            ).to(dtype)


def moments(state: dict) -> tuple[torch.Tensor, ...]:
    return tuple(state[k] for k in ("exp_avg", "exp_avg_absmax", "exp_avg_sq",
                                    "exp_avg_sq_absmax"))


def twin(state: dict, grad: torch.Tensor, step: int, *, fused: bool,
         weight_decay: float) -> None:
    """The current path of `AdamFP16`: decode, its fp32 kernel, encode, copy."""
    opt = AdamFP16([torch.nn.Parameter(torch.zeros(1))], **HYPER,
                   weight_decay=weight_decay, fused=fused)
    kernel = functools.partial(opt._kernel, step=step, group_index=0,
                               found_inf=None)
    bw.update(kernel, [state["master"]], [grad.float()],
              [[t] for t in moments(state)])
    state["shard"].copy_(state["master"])


def one_pass(state: dict, grad: torch.Tensor, step: int, *, weight_decay: float,
             betas: tuple[float, float] = HYPER["betas"], lr: float = HYPER["lr"],
             found_inf: torch.Tensor | None = None) -> None:
    """`one_pass` with the step's coefficients as `AdamFP16` computes them on a
    CPU ($\\alpha$ in fp64)."""
    coefficients = R.step_coefficients(
        torch.full((), float(step)), torch.full((), lr, dtype=torch.float64),
        beta1=betas[0], beta2=betas[1], weight_decay=weight_decay)
    bw.one_pass(state["master"], grad, moments(state), state["shard"],
                coefficients, found_inf, R.Betas(*betas, HYPER["eps"]))


def all_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay,bug", [
    (0.0, None), (0.1, None), (0.1, "beta2 - 0.001"),
    (0.1, "no weight decay")])
@pytest.mark.parametrize("n", SIZES)
def test_one_pass_is_the_foreach_twin_bit_for_bit(n, weight_decay, bug,
                                                  grad_dtype):
    ours = start(n)
    theirs = clone(ours)
    beta1, beta2 = HYPER["betas"]
    for step in range(1, STEPS + 1):
        grad = gradient(n, step, grad_dtype)
        twin(theirs, grad, step, fused=False, weight_decay=weight_decay)
        one_pass(ours, grad, step,
                 weight_decay=0.0 if bug == "no weight decay" else weight_decay,
                 betas=(beta1, beta2 - 0.001 if bug == "beta2 - 0.001" else beta2))
    assert all_equal(ours, theirs) == (bug is None)
    assert torch.equal(ours["shard"], ours["master"].bfloat16())


@pytest.mark.parametrize("bug", [None, "lr x 1.001"])
@pytest.mark.parametrize("n", SIZES)
def test_one_pass_is_the_fused_twin_within_rounding(n, bug):
    """One step from a state both paths reached together: the master within
    an update's roundings, each scale within them of its value, each code
    within one of the other's."""
    weight_decay = 0.1
    ours = start(n)
    for step in range(1, STEPS):
        one_pass(ours, gradient(n, step), step, weight_decay=weight_decay)
    theirs = clone(ours)
    grad = gradient(n, STEPS)
    twin(theirs, grad, STEPS, fused=True, weight_decay=weight_decay)
    one_pass(ours, grad, STEPS, weight_decay=weight_decay,
             lr=HYPER["lr"] * (1.001 if bug == "lr x 1.001" else 1))
    masters = tolerance.within(ours["master"], theirs["master"], ONE_STEP)
    assert masters == (bug is None)
    for scale in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        torch.testing.assert_close(ours[scale], theirs[scale],
                                   rtol=ONE_STEP["rtol"], atol=0)
    for codes in ("exp_avg", "exp_avg_sq"):
        assert (ours[codes].int() - theirs[codes].int()).abs().max() <= 1


def test_a_skipped_step_leaves_everything_as_it_was():
    """`found_inf` set: master, codes, scales and shard untouched, also in a
    block whose absmax is subnormal in fp32, where decoding and encoding again
    does not give the codes back; `found_inf` clear: the step is taken."""
    n = 700
    state = start(n)
    # the second block's gradients below fp32's smallest normal: its $m$ is
    # subnormal, its $v$ zero
    subnormal = torch.finfo(torch.float32).tiny / 64 * (
        1 + torch.arange(bw.BLOCK) % 7)
    for step in range(1, 3):
        grad = gradient(n, step)
        grad[bw.BLOCK:2 * bw.BLOCK] = subnormal
        one_pass(state, grad, step, weight_decay=0.1)
    assert 0 < state["exp_avg_absmax"][1] < torch.finfo(torch.float32).tiny
    # there, the twin's decode and encode would not give the codes back
    again = torch.empty_like(state["exp_avg"])
    bw.encode(bw.decode(state["exp_avg"], state["exp_avg_absmax"], signed=True),
              again, torch.empty_like(state["exp_avg_absmax"]), signed=True)
    assert not torch.equal(again, state["exp_avg"])
    before = clone(state)
    overflowed = gradient(n, 3)
    overflowed[5] = float("inf")
    one_pass(state, overflowed, 3, weight_decay=0.1,
             found_inf=torch.ones(()))
    assert all_equal(state, before)
    # the same flag clear: the step runs as without one
    flagged, plain = clone(before), clone(before)
    finite = gradient(n, 3)
    one_pass(flagged, finite, 3, weight_decay=0.1, found_inf=torch.zeros(()))
    one_pass(plain, finite, 3, weight_decay=0.1)
    assert all_equal(flagged, plain) and not all_equal(plain, before)


def test_the_compiled_update_is_its_eager_twin_within_rounding():
    """`torch.compile` of `adamw_coded_` on a CPU (Inductor's C++ kernel), the
    whole blocks and the padded last one, one step from a common state: the
    compiled kernel may contract a product and a sum into one rounding, so
    the comparison is the fused twin's."""
    n = 1000
    ours = start(n)
    for step in range(1, STEPS):
        one_pass(ours, gradient(n, step), step, weight_decay=0.1)
    theirs = clone(ours)
    grad = gradient(n, STEPS)
    one_pass(theirs, grad, STEPS, weight_decay=0.1)
    compiled = torch.compile(bw.adamw_coded_, dynamic=False)
    with mock.patch.object(bw, "adamw_coded_", compiled):
        one_pass(ours, grad, STEPS, weight_decay=0.1,
                 found_inf=torch.zeros(()))
    assert tolerance.within(ours["master"], theirs["master"], ONE_STEP)
    for scale in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        torch.testing.assert_close(ours[scale], theirs[scale],
                                   rtol=ONE_STEP["rtol"], atol=0)
    for codes in ("exp_avg", "exp_avg_sq"):
        assert (ours[codes].int() - theirs[codes].int()).abs().max() <= 1
    # a master near a rounding boundary of bf16 may round the other way
    torch.testing.assert_close(ours["shard"].float(), theirs["shard"].float(),
                               rtol=torch.finfo(torch.bfloat16).eps,
                               atol=ONE_STEP["atol"])

