"""The parity tests' rule (`tests/tolerance.py`): a true bound for the orders a
kernel may choose, and no more than one."""

import math

import pytest
import torch

from tests import tolerance


def test_gamma_bounds_a_sum_in_any_order():
    # one set of fp32 terms summed four ways: in order, reversed, largest
    # first, and by torch's own (blocked, vectorised) kernel
    n = 4096
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 10
    exact = x.double().sum().item()
    bound = tolerance.sum_error(torch.float32, n) * x.abs().double().sum().item()
    orders = [x, x.flip(0), x[x.abs().argsort(descending=True)]]
    sums = []
    for terms in orders:
        total = torch.zeros((), dtype=torch.float32)
        for term in terms:  # recursive summation, one rounding a term
            total = total + term
        sums.append(total.item())
    sums.append(x.sum().item())
    for total in sums:
        assert abs(total - exact) <= bound
    # the orders do differ: the rule is about something real
    assert len(set(sums)) > 1


def test_the_rule_in_numbers():
    u = torch.finfo(torch.float32).eps / 2
    assert tolerance.unit_roundoff(torch.float32) == u
    assert tolerance.sum_error(torch.float32, 100) == pytest.approx(100 * u, rel=1e-5)
    # k AdamW steps at lr: atol k lr gamma_T, rtol k u
    tol = tolerance.parity(torch.float32, terms=100, steps=5, lr=1e-2)
    assert tol["atol"] == pytest.approx(5 * 1e-2 * 100 * u, rel=1e-5)
    assert tol["rtol"] == 5 * u
    # a loss after 2 steps: (2 + 1) gamma_T, relative
    assert tolerance.loss_after(torch.float32, terms=100, steps=2)["rel"] == \
        pytest.approx(3 * 100 * u, rel=1e-5)
    assert tolerance.within(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]),
                            {"rtol": 2e-7, "atol": 0.0})
    assert not tolerance.within(torch.tensor([1.0]), torch.tensor([1.0 + 1e-6]),
                                {"rtol": 2e-7, "atol": 0.0})


def test_too_many_terms_for_the_dtype_is_refused():
    # bf16 has 8 bits: 256 terms may carry no correct digit
    with pytest.raises(ValueError, match="carry no correct digit"):
        tolerance.sum_error(torch.bfloat16, 256)
    assert math.isfinite(tolerance.sum_error(torch.bfloat16, 255))
