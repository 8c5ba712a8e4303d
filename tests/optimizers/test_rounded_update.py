"""
The update in one pass (`rounded_update`) against its twin, the fused fp32
AdamW and the write-back copy.

On CPU the one-pass function runs as written; `LABML_ZERO_TEST_DEVICE=cuda`
runs it compiled, the kernel the optimizer launches on a GPU. The two round in
their own orders, so they agree within the fp32 roundings of the updates
(tests/tolerance.py), and a shard within one step of its dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from labml_zero.optimizers import rounded_update as R
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from tests import tolerance
from tests.optimizers.test_offload import DEVICE

STEPS = 12
SIZE = 1000
HYPER = dict(lr=1e-2, betas=(0.8, 0.999), eps=1e-8, weight_decay=0.1)
FP32 = tolerance.parity(torch.float32, terms=tolerance.ADAMW_ROUNDINGS * STEPS)


def start(dtype):
    torch.manual_seed(0)
    master = torch.randn(SIZE, device=DEVICE)
    return {"shard": master.to(dtype), "master": master,
            "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}


def gradient(step: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(SIZE, generator=g).to(DEVICE, dtype)


def twin(state: dict, grad: torch.Tensor, step: int, lr: float) -> None:
    """What every update did before the one pass, and still does on a CPU."""
    torch._fused_adamw_(
        [state["master"]], [grad.float()], [state["exp_avg"]], [state["exp_avg_sq"]],
        [], [torch.full((), float(step), device=DEVICE)], lr=lr,
        beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
        weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], amsgrad=False,
        maximize=False)
    state["shard"].copy_(state["master"])


def one_pass(state: dict, grad: torch.Tensor, step: int, lr: float,
             found_inf=None) -> None:
    beta1, beta2 = HYPER["betas"]
    coefficients = R.step_coefficients(
        torch.full((), float(step), device=DEVICE),
        torch.full((), lr, device=DEVICE), beta1=beta1, beta2=beta2,
        weight_decay=HYPER["weight_decay"])
    run = R.one_pass if DEVICE.type == "cuda" else R.adamw_rounded_
    run(state["shard"], (state["master"], state["exp_avg"], state["exp_avg_sq"]),
        grad, coefficients, found_inf, R.Betas(beta1, beta2, HYPER["eps"]))


def train(update, dtype, grad_dtype, *, lr=HYPER["lr"]) -> dict:
    state = start(dtype)
    for step in range(1, STEPS + 1):
        update(state, gradient(step, grad_dtype), step, lr)
    return state


def assert_close(a: dict, b: dict) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(a[key], b[key], **FP32)
    # a master near a rounding boundary of the shard dtype may round the other
    # way: one step of that dtype
    torch.testing.assert_close(a["shard"].float(), b["shard"].float(),
                               rtol=torch.finfo(a["shard"].dtype).eps,
                               atol=FP32["atol"])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_pass_is_the_twin_within_rounding(dtype, grad_dtype):
    if grad_dtype == torch.bfloat16 and dtype == torch.float16:
        grad_dtype = torch.float16
    reference = train(twin, dtype, grad_dtype)
    assert_close(train(one_pass, dtype, grad_dtype), reference)
    # the shard is its master rounded, exactly
    done = train(one_pass, dtype, grad_dtype)
    assert torch.equal(done["shard"], done["master"].to(dtype))
    # the tolerance still catches a wrong update: lr x 1.001
    with pytest.raises(AssertionError):
        assert_close(train(one_pass, dtype, grad_dtype, lr=HYPER["lr"] * 1.001),
                     reference)


def test_a_set_flag_changes_nothing():
    state = train(one_pass, torch.bfloat16, torch.bfloat16)
    before = {k: v.clone() for k, v in state.items()}
    nan = gradient(STEPS + 1, torch.bfloat16)
    nan[3] = float("nan")
    one_pass(state, nan, STEPS + 1, HYPER["lr"],
             found_inf=torch.ones((), device=DEVICE))
    for key in before:
        assert torch.equal(state[key], before[key]), key


def test_step_coefficients_are_fp64_rounded():
    beta1, beta2 = HYPER["betas"]
    for step in (1, 2, 10, 1000):
        lr = 3e-4
        got = R.step_coefficients(
            torch.full((), float(step), device=DEVICE),
            torch.full((), lr, device=DEVICE), beta1=beta1, beta2=beta2,
            weight_decay=HYPER["weight_decay"]).cpu()
        lr32 = float(torch.tensor(lr))  # the fp32 learning rate the kernels see
        want = torch.tensor([lr32 / (1 - beta1**step), math.sqrt(1 - beta2**step),
                             1 - lr32 * HYPER["weight_decay"]])
        # fp64 pow may differ from Python's in the last fp64 bit: one fp32 step
        torch.testing.assert_close(got, want, rtol=torch.finfo(torch.float32).eps,
                                   atol=0)


def test_bytes_per_element():
    # the page's figures: two kernels against one pass, bf16 shard
    assert R.twin_bytes(2) == 28 + 6
    assert R.one_pass_bytes(2, 4) == 30
    assert R.one_pass_bytes(2, 2) == 28


def test_the_optimizer_takes_the_one_pass_on_a_gpu_only():
    shard = LocalShard(torch.randn(8, device=DEVICE).bfloat16(), trainable=True).param
    optimizer = AdamFP16([shard], lr=1e-3)
    assert optimizer.homes.of[shard].one_pass == (DEVICE.type == "cuda")
    fp32 = LocalShard(torch.randn(8, device=DEVICE), trainable=True).param
    assert not AdamFP16([fp32], lr=1e-3).homes.of[fp32].one_pass
