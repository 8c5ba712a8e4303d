"""A rank's shard: its state, where it lives, and how a parameter finds it."""

from __future__ import annotations

import pytest
import torch

from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.shard import LocalShard, grad_device, param_on_host, shard_grad
from tests.zero3.models import tiny_layers


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
    shard.expose_grad()
    assert param.grad is None
    shard.zero_grad()
    assert shard.grad is None
    with pytest.raises(ValueError, match="master_init of shape"):
        shard.set_master_init(torch.zeros(3))


def test_fp32_shard_exposes_its_gradient_and_ordinary_parameters():
    shard = LocalShard(torch.zeros(4), trainable=True)
    shard.new_grad(zeroed=False).fill_(2.0)
    shard.expose_grad()
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
