"""
Host offload of the layouts without a master, `"bf16-stochastic"` and
`"bf16-kahan"`: the host home keeps a copy of the weight and runs the device's
update on it (shard_home.py, Note: a host home without a master). On CPU the
offloaded update must equal the device update bit for bit, at world 1 and 2,
through a checkpoint, and the host bytes must be the memory model's.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.memory_model import STAGING_BYTES
from tests.distributed import run_distributed
from tests.optimizers.test_offload import (DEVICE, HYPER, assert_same,
                                           gradients, set_grad, shards)

NO_MASTER = ("bf16-stochastic", "bf16-kahan")


def train_flat(opt: AdamFP16, params, steps: int, *, early: bool) -> None:
    """`steps` steps of the flat shards; with `early`, each shard's update
    starts when its gradient is announced, as in the engine's backward."""
    for step in range(steps):
        for p, g in zip(params, gradients(step)):
            set_grad(p, g)
            opt.prefetch_grad(p) if not early else opt.grad_ready(p)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("states", NO_MASTER)
def test_no_master_offload_is_bitwise(states, dtype, fused, early):
    on_device, on_host = shards(dtype), shards(dtype)
    kwargs = dict(HYPER, fused=fused, states=states,
                  update_during_backward=early)
    device_opt = AdamFP16(on_device, **kwargs)
    host_opt = AdamFP16(on_host, **kwargs, offload={0, 2, 3})
    assert [p in host_opt.host for p in on_host] == [True, False, True, True]
    for home in host_opt.homes.host:
        # the host's own copy of the weight, the same values as the shard
        assert home.host_weight.device.type == "cpu"
        assert home.host_weight.data_ptr() != home.param.data_ptr()
        assert torch.equal(home.host_weight, home.param.detach().cpu())
    train_flat(device_opt, on_device, 7, early=early)
    train_flat(host_opt, on_host, 7, early=early)
    for a, b in zip(on_device, on_host):
        assert_same(a, b)
        for key in host_opt.layout.names:
            assert_same(device_opt.state[a][key], host_opt.state[b][key])
    for home in host_opt.homes.host:
        assert torch.equal(home.host_weight, home.param.detach().cpu())
        # the copy is not a state: a checkpoint saves the shard alone
        assert set(host_opt.shard_state(home.param)) == {"step",
                                                         *host_opt.layout.names}
    if states == "bf16-kahan" and dtype == torch.bfloat16:
        # the compensation started from master_init on the host too
        assert any(host_opt.state[p]["compensation"].any() for p in on_host)


def test_a_wrong_update_on_the_host_is_caught():
    # the comparison above must see a host update that reads a stale weight
    on_device, on_host = shards(torch.bfloat16), shards(torch.bfloat16)
    device_opt = AdamFP16(on_device, **HYPER, states="bf16-kahan")
    host_opt = AdamFP16(on_host, **HYPER, states="bf16-kahan", offload={0})
    train_flat(device_opt, on_device, 2, early=False)
    train_flat(host_opt, on_host, 2, early=False)
    host_opt.homes.host[0].refresh_weight = lambda: None
    host_opt.homes.host[0].host_weight.zero_()
    train_flat(device_opt, on_device, 1, early=False)
    train_flat(host_opt, on_host, 1, early=False)
    assert not torch.equal(on_device[0], on_host[0])


# ## With the engine, its placement and its checkpoints, at world 1 and 2


def engine(ctx, states: str, fraction: float, params: float = 0.0):
    from labml_zero.planner.placement import StaticPlacement, shard_specs
    from labml_zero.planner.placement_probe import apply_placement
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    # odd chunk sizes: shards of unequal, odd lengths
    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=131, align=1)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=ctx.device,
                                         config=config))
    specs = shard_specs(model)
    placement = StaticPlacement(optimizer_cpu_fraction=fraction,
                                param_cpu_fraction=params).place(specs)
    apply_placement(model, placement)
    opt = AdamFP16(model.get_trainable_chunk(), lr=3e-3, weight_decay=0.01,
                   states=states, offload=placement.optimizer_offload(specs))
    model.runtime.on_grad_ready(opt.grad_ready)
    return model, opt, placement, specs


def steps(ctx, model, opt, which) -> None:
    from tests.zero3.models import batch

    for step in which:
        x, y = batch(step, 2 * ctx.world_size)
        rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
        out = model(x[rows].to(ctx.device, torch.bfloat16)).float()
        torch.nn.functional.mse_loss(out, y[rows].to(ctx.device)).backward()
        opt.step()
        opt.zero_grad()


def host_bytes(opt: AdamFP16) -> int:
    """What the host homes allocated: states, weight copies, staging."""
    total = 0
    for home in opt.homes.host:
        state = opt.state[home.param]
        total += sum(state[name].nbytes for name in opt.layout.names)
        total += home.host_weight.nbytes + home.staging.staging.nbytes
    return total


def offload_and_resume(ctx, states: str, folder: str, params: float) -> dict:
    from labml_zero.planner.placement import resident_bytes
    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint

    plain, plain_opt, _, _ = engine(ctx, states, 0.0)
    # parameter offload needs every optimizer state on the host
    fraction = 1.0 if params else 0.5
    model, opt, placement, specs = engine(ctx, states, fraction, params)
    assert opt.homes.host and (params or len(opt.homes.host) < len(opt.homes.of))
    for m, o in ((plain, plain_opt), (model, opt)):
        steps(ctx, m, o, range(3))
    save_checkpoint(f"{folder}/ckpt", model, opt)
    for m, o in ((plain, plain_opt), (model, opt)):
        steps(ctx, m, o, range(3, 6))
    fresh, fresh_opt, _, _ = engine(ctx, states, fraction, params)
    steps(ctx, fresh, fresh_opt, range(2))  # its host copies go stale
    load_checkpoint(f"{folder}/ckpt", fresh, fresh_opt)
    steps(ctx, fresh, fresh_opt, range(3, 6))
    split = resident_bytes(placement, specs, param_bytes=2,
                           states=opt.layout)
    param_host = sum(c.shard.nbytes for c in model.chunks if c.shard_on_host)
    return {"shards": [[c.shard.detach().clone() for c in m.chunks]
                       for m in (plain, model, fresh)],
            "predicted_host": split.host - param_host,
            "host": host_bytes(opt), "fresh_host": host_bytes(fresh_opt),
            "params_on_host": param_host > 0}


@pytest.mark.parametrize("world_size, params", [(1, 0.0), (2, 0.0), (2, 0.5)])
@pytest.mark.parametrize("states", NO_MASTER)
def test_engine_offload_and_resume_are_bitwise(tmp_path, states, world_size,
                                               params):
    for rank in run_distributed(offload_and_resume, world_size, states,
                                str(tmp_path), params):
        plain, offloaded, resumed = rank["shards"]
        for a, b, c in zip(plain, offloaded, resumed):
            assert torch.equal(a, b)
            assert torch.equal(b, c)
        assert rank["params_on_host"] == bool(params)
        # the memory model's host bytes are what the homes allocated
        assert rank["host"] == rank["fresh_host"] == rank["predicted_host"] > 0


def test_host_bytes_per_element():
    from labml_zero.zero3.state_layout import LAYOUTS

    for layout in LAYOUTS.values():
        for p in (2, 4):
            weight = p if layout.master is None else 0
            assert layout.host_bytes_per_element(p) == \
                layout.bytes_per_element() + weight
    assert LAYOUTS["bf16-kahan"].host_bytes_per_element(2) + STAGING_BYTES == 12
