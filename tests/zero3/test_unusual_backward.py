"""Backward passes a training step does not usually take: a second one through
the same forward (`retain_graph=True`), a forward without gradients between a
forward and its backward, and a backward that raises and is caught."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from labml_zero.planner.sharding import shard_model
from labml_zero.zero3 import ZeroConfig
from tests import tolerance
from tests.distributed import run_distributed

ROWS_PER_RANK = 3
# a gradient's path: the forward's and the backward's products (inner sizes
# 4, 6 and 6 each way), the batch's rows (2 ranks) and the ranks' average;
# every value is within 2 in size
GRAD = tolerance.parity(torch.float32, terms=2 * (4 + 6 + 6) + 2 * ROWS_PER_RANK + 2,
                        scale=2.0)


def mlp() -> nn.Sequential:
    """Its first and last linear are the root unit, the middle one a unit: the
    backward pass reads the root's readout before any unit's hook runs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 2))


def shard_grad_errors(sharded, reference) -> list[bool]:
    """Whether each trainable chunk's gradient shard is the reference's slice."""
    named = dict(reference.named_parameters())
    found = []
    for chunk in sharded.chunks:
        if not chunk.trainable:
            continue
        expected = torch.zeros(chunk.numel)
        for slot, name in zip(chunk.spec.slots, chunk.names):
            expected[slot.offset:slot.end] = named[name].grad.reshape(-1)
        start = chunk.shard_offset
        found.append(tolerance.within(
            chunk.local.grad, expected[start:start + chunk.shard_numel], GRAD))
    return found


def train_unusual(ctx, case: str) -> list[bool]:
    model = mlp()
    reference = copy.deepcopy(model)
    sharded = shard_model(model, [model[2]], device=ctx.device,
                          config=ZeroConfig(dtype=torch.float32, chunk_numel=64, align=1))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS_PER_RANK * ctx.world_size, 4, generator=generator)
    y = torch.randn(ROWS_PER_RANK * ctx.world_size, 2, generator=generator)
    mine = slice(ROWS_PER_RANK * ctx.rank, ROWS_PER_RANK * (ctx.rank + 1))
    for net, rows in ((sharded, mine), (reference, slice(None))):
        out = net(x[rows])
        if case == "retain_graph":  # two losses, two backward passes
            nn.functional.mse_loss(out, y[rows]).backward(retain_graph=True)
            out.square().mean().backward()
        else:  # a forward without gradients before the backward
            with torch.no_grad():
                net(x[rows])
            nn.functional.mse_loss(out, y[rows]).backward()
    return shard_grad_errors(sharded, reference)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["retain_graph", "no_grad_forward_between"])
def test_the_root_is_gathered_again_for_a_backward_pass(case):
    """Both release the root unit before the backward pass that reads it (the
    first backward's end; the no-grad forward's end): the backward gathers it
    again, and every gradient shard is the unsharded model's, on two ranks."""
    for found in run_distributed(train_unusual, 2, case):
        assert found and all(found)


class RaisesOnce(nn.Module):
    """Raises in the backward pass the first time, as a check of the
    gradients would on a bad batch."""

    def __init__(self):
        super().__init__()
        self.armed = True

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(self.check)
        return x

    def check(self, grad):
        if self.armed:
            self.armed = False
            raise FloatingPointError("non-finite gradient")


def test_a_backward_that_raised_is_discarded_and_the_next_step_runs():
    """The caught exception leaves no backward running; the next forward says
    in one warning that the failed pass's gradients are dropped, and the next
    step's gradients are the next batch's alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), RaisesOnce(), nn.Tanh(), nn.Linear(6, 2))
    reference = copy.deepcopy(model)
    reference[1].armed = False
    sharded = shard_model(model, [model[0], model[3]], device="cpu",
                          config=ZeroConfig(dtype=torch.float32, chunk_numel=64, align=1))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    with pytest.raises(FloatingPointError):
        sharded(x).sum().backward()
    with pytest.warns(UserWarning, match="last backward pass raised before its end"):
        out = sharded(2 * x)
    out.sum().backward()
    reference(2 * x).sum().backward()
    found = shard_grad_errors(sharded, reference)
    assert found and all(found)
