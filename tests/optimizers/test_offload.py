"""
Offloaded optimizer state: the same update as on the device, bit for bit on CPU.

`LABML_ZERO_TEST_DEVICE=cuda` runs the same tests with the shards on a GPU: the
pinned staging buffers, the copy streams and their events. There the host's and
the GPU's kernels may round differently, so "the same" is within fp32 rounding
for masters and moments, and one rounding step of the shard dtype for shards.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from tests import tolerance

DEVICE = torch.device(os.environ.get("LABML_ZERO_TEST_DEVICE", "cpu"))


# On a GPU the host's and the device's update kernels round in their own ways
# (tests/tolerance.py): fp32 values through at most STEPS_AT_MOST updates of
# ADAMW_ROUNDINGS roundings each (the longest run in this file); a 16-bit shard
# is its master rounded, so one master near a rounding boundary of the shard
# dtype may round the other way: one step of that dtype, eps relative.
STEPS_AT_MOST = 12
FP32_TOLERANCE = tolerance.parity(
    torch.float32, terms=tolerance.ADAMW_ROUNDINGS * STEPS_AT_MOST)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise on CPU; on a GPU within the rounding described above."""
    if DEVICE.type == "cpu":
        assert torch.equal(a, b)
        return
    a, b = a.detach(), b.detach()
    if not a.dtype.is_floating_point:
        # codes (8-bit moments): equal but where their values round apart
        bound = {"rtol": 0, "atol": 1}
    elif a.dtype == torch.float32:
        bound = FP32_TOLERANCE
    else:
        bound = {"rtol": torch.finfo(a.dtype).eps, "atol": FP32_TOLERANCE["atol"]}
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), **bound)


SIZES = (37, 5, 130, 64)
HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)


def gradients(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(n, generator=g).to(DEVICE) for n in SIZES]


def shards(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Flat shards as the engine leaves them: 16-bit ones carry `master_init`."""
    torch.manual_seed(0)
    out = []
    for n in SIZES:
        exact = torch.randn(n, device=DEVICE)
        master = exact.clone() if dtype != torch.float32 else None
        out.append(LocalShard(exact.to(dtype), trainable=True,
                              master_init=master).param)
    return out


def set_grad(shard: torch.Tensor, grad: torch.Tensor) -> None:
    """What the engine's reduce-scatter leaves: the shard's fp32 gradient."""
    LocalShard.of(shard).grad = grad


def grad_of(shard: torch.Tensor) -> torch.Tensor:
    return LocalShard.of(shard).grad


def train(opt: AdamFP16, params, steps: int, *, prefetch: bool = False) -> None:
    for step in range(steps):
        for p, g in zip(params, gradients(step)):
            set_grad(p, g)
            if prefetch:
                # what the engine does right after the shard's reduce-scatter
                opt.prefetch_grad(p)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_equals_device_bitwise(fused, dtype):
    on_device, on_host = shards(dtype), shards(dtype)
    device_opt = AdamFP16(on_device, **HYPER, fused=fused)
    # three of four shards on the host, one left on the "device": both paths
    # run in the same step
    host_opt = AdamFP16(on_host, **HYPER, fused=fused, offload={0, 2, 3})
    assert [p in host_opt.host for p in on_host] == [True, False, True, True]
    train(device_opt, on_device, 7)
    train(host_opt, on_host, 7, prefetch=True)
    for a, b in zip(on_device, on_host):
        assert_same(a, b)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert_same(device_opt.state[a][key], host_opt.state[b][key])
        assert device_opt.state[a]["step"] == host_opt.state[b]["step"] == 7


@pytest.mark.parametrize("fused", [True, False])
def test_offloaded_fp32_follows_adamw(fused):
    ours = shards(torch.float32)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = AdamFP16(ours, **HYPER, fused=fused, offload=lambda i, p: True)
    ref = torch.optim.AdamW(theirs, **HYPER)
    for step in range(12):
        for p, q, g in zip(ours, theirs, gradients(step)):
            set_grad(p, g.clone())
            q.grad = g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        # the same gradients into two kernels of the update, 12 steps
        torch.testing.assert_close(p.detach(), q.detach(), **tolerance.parity(
            torch.float32, terms=tolerance.ADAMW_ROUNDINGS, steps=12,
            lr=HYPER["lr"]))
        # an offloaded fp32 shard gets a master of its own, equal to it
        master = opt.state[p]["master"]
        assert master.data_ptr() != p.data_ptr()
        assert torch.equal(master.to(DEVICE), p.detach())


def test_gradient_changed_after_prefetch_is_copied_again():
    on_device, on_host = shards(torch.bfloat16), shards(torch.bfloat16)
    device_opt = AdamFP16(on_device, **HYPER)
    host_opt = AdamFP16(on_host, **HYPER, offload=range(len(SIZES)))
    for step in range(3):
        for a, b, g in zip(on_device, on_host, gradients(step)):
            set_grad(a, g.clone())
            set_grad(b, g.clone())
            host_opt.prefetch_grad(b)
            assert host_opt.host[b].holds(grad_of(b))
        # unscaling or clipping after the reduce-scatter works in place
        torch._foreach_mul_([grad_of(p) for p in on_device], 0.25)
        torch._foreach_mul_([grad_of(p) for p in on_host], 0.25)
        assert not any(host_opt.host[b].holds(grad_of(b)) for b in on_host)
        device_opt.step()
        host_opt.step()
    for a, b in zip(on_device, on_host):
        assert_same(a, b)
        assert_same(device_opt.state[a]["master"], host_opt.state[b]["master"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_during_backward_is_the_same_update(dtype):
    after, during = shards(dtype), shards(dtype)
    after_opt = AdamFP16(after, **HYPER, offload={0, 2, 3})
    during_opt = AdamFP16(during, **HYPER, offload={0, 2, 3},
                          update_during_backward=True)
    train(after_opt, after, 5, prefetch=True)
    for step in range(5):
        for p, g in zip(during, gradients(step)):
            set_grad(p, g)
            during_opt.prefetch_grad(p)
        # the offloaded shards' updates were handed to the worker at prefetch
        assert set(during_opt.early) == set(during_opt.host)
        during_opt.step()
        assert during_opt.early == {}
        during_opt.zero_grad()
    for a, b in zip(after, during):
        assert_same(a, b)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert_same(after_opt.state[a][key], during_opt.state[b][key])
        assert after_opt.state[a]["step"] == during_opt.state[b]["step"] == 5


def test_the_host_update_leaves_a_core_to_the_backward_pass():
    # the worker's kernels take the rank's share of the cores but one; the
    # thread that built it, and threads made later, keep the share
    from labml_zero.optimizers.host_offload import HostOffload, update_threads

    share = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        offload = HostOffload([], worker=True)
        assert offload.submit(torch.get_num_threads).result() == 2
        assert torch.get_num_threads() == 3
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [3]
    finally:
        torch.set_num_threads(share)
    assert [update_threads(n) for n in (1, 2, 16)] == [1, 1, 15]


def test_update_during_backward_refuses_a_gradient_changed_after():
    params = shards(torch.bfloat16)
    opt = AdamFP16(params, **HYPER, offload={1}, update_during_backward=True)
    for p, g in zip(params, gradients(0)):
        set_grad(p, g)
        opt.prefetch_grad(p)
    # clipping after the reduce-scatter: too late for the early update
    grad_of(params[1]).mul_(0.5)
    with pytest.raises(RuntimeError, match="changed after its update began"):
        opt.step()


def test_plain_grad_and_state_for_checkpoints():
    p = torch.nn.Parameter(torch.ones(6))
    p.grad = torch.ones(6)
    opt = AdamFP16([p], lr=0.1, offload={0})
    opt.step()
    assert (p < 1).all()
    # the keys and types checkpoint.py reads, as host tensors
    state = opt.state[p]
    assert isinstance(state["step"], int)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert state[key].device.type == "cpu" and state[key].dtype == torch.float32
    assert opt.state_device(p) == torch.device("cpu")


def test_loaded_state_is_moved_back_and_unaliased():
    # load_checkpoint installs an fp32 shard's master as the shard itself
    p = LocalShard(torch.randn(8), trainable=True).param
    opt = AdamFP16([p], lr=0.1, offload={0})
    opt.load_shard_state(p, {"step": 3, "master": p.data,
                             "exp_avg": torch.zeros(8), "exp_avg_sq": torch.ones(8)})
    set_grad(p, torch.ones(8))
    opt.step()
    assert opt.state[p]["step"] == 4
    assert opt.state[p]["master"].data_ptr() != p.data_ptr()
    assert torch.equal(opt.state[p]["master"], p.detach())


@pytest.mark.parametrize("offload", [set(), {0}])
def test_load_state_dict_keeps_a_bf16_shards_fp32_states(offload):
    """`torch.optim`'s loader would cast the master and moments to the shard's
    bf16; loaded into a fresh optimizer they must be the saved fp32 bits."""
    torch.manual_seed(0)
    first = LocalShard(torch.randn(64).bfloat16(), trainable=True).param
    opt = AdamFP16([first], lr=1e-3, offload=offload)
    for step in range(3):
        set_grad(first, torch.randn(64))  # the engine's fp32 gradient
        opt.step()
    saved = opt.state_dict()
    second = LocalShard(first.detach().clone(), trainable=True).param
    again = AdamFP16([second], lr=1e-3, offload=offload)
    again.load_state_dict(saved)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        got, want = again.state[second][key], opt.state[first][key]
        assert got.dtype == torch.float32 and torch.equal(got, want), key
        assert got.device == want.device, key


def test_bad_offload_position():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    with pytest.raises(ValueError, match="offload names parameter 3"):
        AdamFP16(params, offload={1, 3})


# ## With the engine and its checkpoints, on one local rank


def sharded(dtype, *, offload, during=False):
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    config = ZeroConfig(dtype=dtype, chunk_numel=200, align=4)
    # no process group: the engine runs on one local rank
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=DEVICE,
                                         config=config))
    shards = model.get_trainable_chunk()
    # the output half of the trainable chunks, as StaticPlacement(0.5) picks
    chosen = range(len(shards) // 2, len(shards)) if offload else None
    optimizer = AdamFP16(shards, lr=3e-3, weight_decay=0.01, offload=chosen,
                         update_during_backward=during)
    # what the fine-tune does: each chunk's reduction announces its gradient
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return model, optimizer


def run_steps(model, optimizer, steps) -> None:
    from tests.zero3.models import batch

    for step in steps:
        x, y = batch(step, 4)
        loss = torch.nn.functional.mse_loss(
            model(x.to(DEVICE, model.chunks[0].dtype)).float(), y.to(DEVICE))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_training_and_checkpoint_resume(tmp_path, dtype):
    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint

    plain, plain_opt = sharded(dtype, offload=False)
    model, opt = sharded(dtype, offload=True)
    assert 0 < len(opt.host) < len(opt.param_groups[0]["params"])
    initial = [c.shard.detach().clone() for c in model.chunks]
    for m, o in ((plain, plain_opt), (model, opt)):
        run_steps(m, o, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    for m, o in ((plain, plain_opt), (model, opt)):
        run_steps(m, o, range(3, 6))
    fresh, fresh_opt = sharded(dtype, offload=True)
    load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    run_steps(fresh, fresh_opt, range(3, 6))
    for a, b, c in zip(plain.chunks, model.chunks, fresh.chunks):
        # offloaded or not, resumed or not: the same shards, bit for bit (CPU)
        assert_same(a.shard, b.shard)
        assert torch.equal(b.shard, c.shard)
    assert all(not torch.equal(c.shard, i) for c, i in zip(model.chunks, initial)
               if c.trainable)
    for shard in fresh_opt.host:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert fresh_opt.state[shard][key].data_ptr() != shard.data_ptr()


def watch_grad_ready(model, began) -> list[bool]:
    """`began(shard)` right after each `grad_ready` the engine calls: whether the
    shard's update had started by then."""
    seen: list[bool] = []
    # registered after the optimizer's, so it runs right after it
    model.runtime.on_grad_ready(lambda shard, *, after: seen.append(began(shard)))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_updates_during_backward(dtype):
    plain, plain_opt = sharded(dtype, offload=False)
    model, opt = sharded(dtype, offload=True, during=True)
    started = watch_grad_ready(model, lambda p: p in opt.early and p in opt.host)
    for m, o in ((plain, plain_opt), (model, opt)):
        run_steps(m, o, range(4))
    # every offloaded shard's update began in the backward pass, every step
    assert started.count(True) == 4 * len(opt.host)
    for a, b in zip(plain.chunks, model.chunks):
        assert_same(a.shard, b.shard)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_shards_update_during_backward(dtype):
    """Without offload, `update_during_backward` updates each device shard as its
    chunk is reduced (on a side stream on a GPU): the same shards as updating
    after the backward pass, bit for bit, and every update began in backward."""
    plain, plain_opt = sharded(dtype, offload=False)
    model, opt = sharded(dtype, offload=False, during=True)
    early = watch_grad_ready(model, lambda p: p in opt.early)
    for m, o in ((plain, plain_opt), (model, opt)):
        run_steps(m, o, range(4))
    shards = opt.param_groups[0]["params"]
    assert early == [True] * (4 * len(shards))
    for a, b in zip(plain.chunks, model.chunks):
        assert_same(a.shard, b.shard)
    for p, q in zip(plain_opt.param_groups[0]["params"], shards):
        assert plain_opt.state[p]["step"] == opt.state[q]["step"] == 4
        assert_same(plain_opt.state[p]["master"], opt.state[q]["master"])


def test_device_update_during_backward_refuses_a_changed_gradient():
    """Clipping after the backward pass would change a gradient whose update
    already ran: `step()` says so instead of silently using the old one."""
    from tests.zero3.models import batch

    model, opt = sharded(torch.float32, offload=False, during=True)
    x, y = batch(0, 4)
    torch.nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE)).backward()
    grad_of(model.get_trainable_chunk()[0]).mul_(0.5)
    with pytest.raises(RuntimeError, match="changed after its update"):
        opt.step()
