"""A rank's shard: its state, where it lives, and how a parameter finds it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.shard import LocalShard, grad_device, param_on_host, shard_grad
from tests import tolerance
from tests.distributed import run_distributed
from tests.zero3.models import TINY_TERMS, batch, tiny_layers


def test_lifecycle_of_a_16bit_shard():
    exact = torch.randn(10)
    shard = LocalShard(exact.bfloat16(), trainable=True, master_init=exact.clone())
    param = shard.param
    assert isinstance(param, torch.nn.Parameter)
    assert LocalShard.of(param) is shard
    # nothing of the shard's state is stuck on the parameter
    assert vars(param) == {}
    assert shard.master_init_nbytes() == 40
    assert torch.equal(shard.take_master_init(), exact)
    assert shard.master_init is None and shard.take_master_init() is None
    grad = shard.new_grad(zeroed=True)
    assert grad.dtype == torch.float32 and torch.equal(grad, torch.zeros(10))
    assert shard_grad(param) is grad
    # a bf16 parameter's .grad cannot hold the fp32 gradient
    assert param.grad is None
    shard.zero_grad()
    assert shard.grad is None
    with pytest.raises(ValueError, match="master_init of shape"):
        shard.set_master_init(torch.zeros(3))


def test_fp32_shard_exposes_its_gradient_and_ordinary_parameters():
    shard = LocalShard(torch.zeros(4), trainable=True)
    shard.new_grad(zeroed=False).fill_(2.0)
    assert shard.param.grad is shard.grad
    # one gradient, not two: whoever clears `param.grad` (a `torch.optim`
    # optimizer's `zero_grad`) clears the shard's
    shard.param.grad = None
    assert shard.grad is None and shard_grad(shard.param) is None
    shard.new_grad(zeroed=True)
    assert shard.param.grad is shard.grad
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.ones(3)
    assert LocalShard.of(plain) is None
    assert shard_grad(plain) is plain.grad
    assert grad_device(plain) == plain.device and not param_on_host(plain)
    # a frozen shard is a plain tensor, not registered
    frozen = LocalShard(torch.zeros(4), trainable=False)
    assert not isinstance(frozen.param, torch.nn.Parameter)


def test_move_to_host_keeps_the_parameter_object():
    exact = torch.randn(6)
    shard = LocalShard(exact.bfloat16(), trainable=True, master_init=exact)
    param = shard.param
    shard.move_to_host(pin=False)
    assert shard.param is param and shard.on_host and param_on_host(param)
    assert torch.equal(param.detach(), exact.bfloat16())
    assert grad_device(param) == torch.device("cpu")


def test_a_chunk_owns_one_local_shard():
    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=200, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu",
                                         config=config))
    for chunk in model.chunks:
        assert chunk.shard is chunk.local.param
        if chunk.trainable:
            assert LocalShard.of(chunk.shard) is chunk.local
            # the fp32 originals of a bf16 chunk, for the optimizer's master
            assert chunk.local.master_init is not None


# ## A plain `torch.optim` optimizer on fp32 shards
#
# Its `zero_grad()` clears `param.grad`, setting it to `None` or zeroing it in
# place; either must clear the gradient the engine adds the next step into, or
# step $k$'s gradient becomes the sum of steps $1..k$ (see the shard's Note: why
# the gradient lives beside the parameter).

STEPS = 3
ROWS_PER_RANK = 3
LR = 1e-2
# fp32 through `tiny_layers` (tests/tolerance.py): a gradient of one pass and
# the parameters after the steps, each at most about 1.5 in size
GRAD_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, scale=1.5), 1.5)
PARAM_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, steps=STEPS, lr=LR), 1.5)


def train_with_torch_adamw(ctx, set_to_none: bool) -> dict:
    """`torch.optim.AdamW` on the shards beside one on an unsharded copy; each
    step's largest gradient difference and the parameters' at the end."""
    layers = tiny_layers(freeze=False)
    reference = nn.Sequential(*copy.deepcopy(layers)).to(ctx.device)
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    model = Zero3Sequential(zero3_layers(layers, device=ctx.device, config=config))
    optimizer = torch.optim.AdamW(model.get_trainable_chunk(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    named = dict(reference.named_parameters())
    mine = slice(ctx.rank * ROWS_PER_RANK, (ctx.rank + 1) * ROWS_PER_RANK)
    grad_errors = []
    for step in range(STEPS):
        x, y = (t.to(ctx.device)
                for t in batch(step, ROWS_PER_RANK * ctx.world_size))
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        worst = 0.0
        for chunk in model.chunks:
            # [C] fp32: the reference's gradients in the chunk's layout
            expected = torch.zeros(chunk.numel, device=ctx.device)
            for slot, name in zip(chunk.spec.slots, chunk.names):
                expected[slot.offset:slot.end] = named[name].grad.reshape(-1)
            lo = chunk.shard_offset
            # what the optimizer reads is what the engine holds
            assert chunk.shard.grad is chunk.local.grad
            worst = max(worst, (chunk.shard.grad - expected[lo:lo + chunk.shard_numel]
                                ).abs().max().item())
        grad_errors.append(worst)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        ref_optimizer.zero_grad()
    with model.runtime.gathered():
        ours = [p.detach().clone() for p in nn.Sequential(*layers).parameters()]
    param_error = max((a - b).abs().max().item()
                      for a, b in zip(ours, reference.parameters()))
    return {"grad_errors": grad_errors, "param_error": param_error}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_torch_optimizer_zero_grad_clears_the_shard_gradient(world_size, set_to_none):
    for rank, report in enumerate(run_distributed(
            train_with_torch_adamw, world_size, set_to_none)):
        assert max(report["grad_errors"]) <= GRAD_ERROR, (rank, report)
        assert report["param_error"] <= PARAM_ERROR, (rank, report)
