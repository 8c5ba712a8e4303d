"""
Each shard's home decides where its state lives and how it is updated: a device
and a host shard in one `AdamFP16` get the updates two optimizers of one kind
each give them, and the device homes share one kernel launch.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.optimizers.shard_home import DeviceHome, HostHome
from labml_zero.zero3.shard import LocalShard
from tests import tolerance
from tests.optimizers.test_offload import DEVICE

HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
STEPS = 8
SIZES = (37, 5, 130, 64)


def shards(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    out = []
    for n in SIZES:
        exact = torch.randn(n, device=DEVICE)
        master = exact.clone() if dtype != torch.float32 else None
        out.append(LocalShard(exact.to(dtype), trainable=True,
                              master_init=master).param)
    return out


def train(optimizers: list[AdamFP16], *lists: list[torch.Tensor]) -> None:
    """The shards at one position in each of `lists` get the same gradients."""
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(n, generator=g).to(DEVICE) for n in SIZES]
        for params in lists:
            for p, grad in zip(params, grads):
                LocalShard.of(p).grad = grad.clone()
        for opt in optimizers:
            for p in opt.param_groups[0]["params"]:
                # what the engine calls as each chunk is reduced
                opt.grad_ready(p)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("during", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bug", [None, "lr x 1.001"])
def test_mixed_homes_update_as_one_kind_each(dtype, fused, during, bug):
    host_positions = {1, 3}
    mixed = shards(dtype)
    opt = AdamFP16(mixed, **HYPER, fused=fused, offload=host_positions,
                   update_during_backward=during)
    assert [type(opt.homes.of[p]) for p in mixed] == [
        DeviceHome, HostHome, DeviceHome, HostHome]
    # the reference: the device shards in one optimizer, the host ones in
    # another with every shard offloaded; `bug` makes it a little wrong
    lr = HYPER["lr"] * (1.001 if bug else 1)
    apart = shards(dtype)
    on_device = [p for i, p in enumerate(apart) if i not in host_positions]
    on_host = [p for i, p in enumerate(apart) if i in host_positions]
    device_opt = AdamFP16(on_device, **{**HYPER, "lr": lr}, fused=fused,
                          update_during_backward=during)
    host_opt = AdamFP16(on_host, **{**HYPER, "lr": lr}, fused=fused,
                        offload=lambda i, p: True, update_during_backward=during)
    train([opt, device_opt, host_opt], mixed, apart)
    # Each shard and its reference get the same gradients into the same
    # kernel (device or host), STEPS updates: the bound of tests/tolerance.py
    # for two programs that may only order their roundings apart (bitwise
    # equal on CPU), which lr x 1.001 exceeds.
    bound = tolerance.parity(torch.float32, terms=tolerance.ADAMW_ROUNDINGS,
                             steps=STEPS, lr=HYPER["lr"])
    ref_state = {**device_opt.state, **host_opt.state}
    close = all(tolerance.within(opt.state[p]["master"].float().cpu(),
                                 ref_state[q]["master"].float().cpu(), bound)
                for p, q in zip(mixed, apart))
    assert close == (bug is None)
    for p, q in zip(mixed, apart):
        assert opt.state[p]["step"] == ref_state[q]["step"] == STEPS
        # each state where its home keeps it
        assert opt.state[p]["master"].device == opt.state_device(p)
    assert all(opt.state_device(p) == torch.device("cpu") for i, p in
               enumerate(mixed) if i in host_positions)


def test_device_homes_share_one_kernel_launch(monkeypatch):
    """One fused launch for all device shards of a group and dtype, one per
    host shard: the launches of a step do not grow with the homes. On a GPU
    a bf16 device shard takes the one-pass kernel instead, one launch each
    (rounded_update's Limitations)."""
    from labml_zero.optimizers import rounded_update

    params = shards(torch.bfloat16)
    opt = AdamFP16(params, **HYPER, fused=True, offload={0})
    launches, one_pass = [], []
    fused, single = torch._fused_adamw_, rounded_update.one_pass
    monkeypatch.setattr(torch, "_fused_adamw_", lambda masters, *a, **k: (
        launches.append(len(masters)), fused(masters, *a, **k)))
    monkeypatch.setattr(rounded_update, "one_pass", lambda shard, *a: (
        one_pass.append(shard.numel()), single(shard, *a)))
    for p in params:
        LocalShard.of(p).grad = torch.ones(p.numel(), device=DEVICE)
    opt.step()
    if DEVICE.type == "cuda":
        assert launches == [1] and len(one_pass) == len(params) - 1
    else:
        assert sorted(launches) == [1, len(params) - 1] and not one_pass


def test_a_group_added_later_lives_on_the_device():
    first, later = shards(torch.float32)[:2]
    opt = AdamFP16([first], **HYPER, offload={0})
    opt.add_param_group({"params": [later]})
    assert isinstance(opt.homes.of[later], DeviceHome)
    for p in (first, later):
        LocalShard.of(p).grad = torch.ones(p.numel(), device=DEVICE)
    opt.step()
    assert opt.state[later]["step"] == opt.state[first]["step"] == 1
    assert opt.state[first]["master"].device.type == "cpu"


def test_a_loaded_state_goes_home():
    """`load_state_dict` (torch's format) leaves a host home's state on the
    host, its fp32 master not the shard itself."""
    p = shards(torch.float32)[0]
    opt = AdamFP16([p], **HYPER, offload={0})
    LocalShard.of(p).grad = torch.ones(p.numel(), device=DEVICE)
    opt.step()
    saved = opt.state_dict()
    fresh = AdamFP16([p], **HYPER, offload={0})
    fresh.load_state_dict(saved)
    master = fresh.state[p]["master"]
    assert master.device.type == "cpu" and master.data_ptr() != p.data_ptr()
    assert torch.equal(master, opt.state[p]["master"])
    assert fresh.state[p]["step"] == 1
