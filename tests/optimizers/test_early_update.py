"""The early update's non-finite flag, and what the communicator holds for its side stream."""

import pytest
import torch

from labml_zero.optimizers.host_offload import non_finite_flag
from labml_zero.zero3.communication import SideStreamHolds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_non_finite_flag(dtype, bad):
    """0-dim fp32, exactly 1.0 (what the fused kernel tests) when the gradient
    has an inf or a nan, else 0.0; also for huge finite values."""
    grad = torch.full((37,), torch.finfo(dtype).max, dtype=dtype)
    grad[::2] = -1.5
    if bad is not None:
        grad[11] = bad
    flag = non_finite_flag(grad)
    assert flag.dtype == torch.float32 and flag.dim() == 0
    assert flag.item() == (0.0 if bad is None else 1.0)


class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_side_stream_holds_drop_in_order():
    holds = SideStreamHolds()
    first, second = FakeEvent(), FakeEvent()
    a, b = torch.ones(3), torch.ones(4)
    holds.hold([a], first)
    holds.hold([b], second)
    # the second passed but the first not: events on one stream pass in
    # order, so nothing is dropped past an unfinished one
    second.done = True
    holds.drop_finished()
    assert len(holds.held) == 2
    first.done = True
    holds.drop_finished()
    assert not holds.held
    holds.hold([a], FakeEvent())
    holds.drop_all()
    assert not holds.held
