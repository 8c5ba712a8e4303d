"""Global gradient-norm clipping (`labml_zero/optimizers/clip_grad.py`) on one
process: the page's formula, and `torch.nn.utils.clip_grad_norm_`'s result."""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.clip_grad import clip_grad_norm_, global_grad_norm
from labml_zero.zero3.communication import Communicator


def params_with_grads(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        params.append(p)
    return params


def test_clipping_is_the_formula_of_the_page():
    # g <- g * min(1, c / (|g|_2 + 1e-6)). At |g| = c = 1e-6 the 1e-6 halves g,
    # which pins the constant: without it g would be left as it is.
    comm = Communicator(torch.device("cpu"))
    tiny = params_with_grads([1e-6])
    norm = clip_grad_norm_(tiny, 1e-6, comm)
    assert norm.item() == pytest.approx(1e-6, rel=1e-6)
    assert tiny[0].grad.item() == pytest.approx(0.5e-6, rel=1e-5)
    # Below the bound: min(1, ...) leaves g; above it: scaled to norm c.
    small = params_with_grads([0.3, 0.4])
    clip_grad_norm_(small, 1.0, comm)
    assert small[0].grad.tolist() == pytest.approx([0.3, 0.4])
    big = params_with_grads([3.0, 4.0], [12.0])
    norm = clip_grad_norm_(big, 1.0, comm)
    assert norm.item() == pytest.approx(13.0)
    coefficient = 1.0 / (13.0 + 1e-6)
    assert big[0].grad.tolist() == pytest.approx([3 * coefficient, 4 * coefficient])
    assert big[1].grad.item() == pytest.approx(12 * coefficient)


def test_clipping_is_torchs_on_one_rank():
    torch.manual_seed(0)
    grads = [torch.randn(7), torch.randn(3, 5), torch.randn(11)]
    ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    comm = Communicator(torch.device("cpu"))
    norm = clip_grad_norm_(ours, 0.5, comm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    # the norm of the clipped gradient is the bound
    assert global_grad_norm(ours, comm).item() == pytest.approx(0.5, rel=1e-5)


def test_a_bound_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="max_norm must be positive, got 0"):
        clip_grad_norm_(params_with_grads([1.0]), 0.0,
                        Communicator(torch.device("cpu")))
