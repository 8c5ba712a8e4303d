"""
`AdamFP16(free_grads=True)`: each shard's gradient is freed once its early
update consumed it; the same training, bit for bit on CPU, as keeping it.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from tests.optimizers.test_offload import DEVICE, assert_same


def sharded(dtype, *, offload: bool, free: bool, first=None):
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    config = ZeroConfig(dtype=dtype, chunk_numel=200, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=DEVICE,
                                         config=config))
    shards = model.get_trainable_chunk()
    chosen = range(len(shards) // 2, len(shards)) if offload else None
    optimizer = AdamFP16(shards, lr=3e-3, weight_decay=0.01, offload=chosen,
                         update_during_backward=True, free_grads=free)
    if first is not None:
        # before the optimizer's callback, which frees the gradient
        model.runtime.on_grad_ready(first)
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return model, optimizer


def train(model, optimizer, steps) -> list[float]:
    from tests.zero3.models import batch

    losses = []
    for step in steps:
        x, y = batch(step, 4)
        loss = torch.nn.functional.mse_loss(
            model(x.to(DEVICE, model.chunks[0].dtype)).float(), y.to(DEVICE))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_freed_gradients_train_the_same(dtype, offload):
    kept, kept_opt = sharded(dtype, offload=offload, free=False)
    freed, freed_opt = sharded(dtype, offload=offload, free=True)
    gone: list[bool] = []
    # registered after the optimizer's callback: runs right after its update
    freed.runtime.on_grad_ready(lambda shard, *, after: gone.append(
        LocalShard.of(shard).grad is None and shard.grad is None))
    kept_losses = train(kept, kept_opt, range(4))
    freed_losses = train(freed, freed_opt, range(4))
    assert kept_losses == freed_losses
    n_trainable = len(freed_opt.param_groups[0]["params"])
    # every shard's gradient was gone right after its update, every step
    assert gone == [True] * (4 * n_trainable)
    for a, b in zip(kept.chunks, freed.chunks):
        assert_same(a.shard, b.shard)
    for p, q in zip(kept_opt.param_groups[0]["params"],
                    freed_opt.param_groups[0]["params"]):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert_same(kept_opt.state[p][key], freed_opt.state[q][key])


def test_free_grads_needs_updates_during_backward():
    with pytest.raises(ValueError, match="free_grads needs update_during_backward"):
        AdamFP16([torch.nn.Parameter(torch.ones(2))], free_grads=True)


def test_a_second_backward_is_still_refused():
    # accumulation would make new gradients after the first ones were used
    from tests.zero3.models import batch

    model, opt = sharded(torch.float32, offload=True, free=True)
    for _ in range(2):
        x, y = batch(0, 4)
        torch.nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE)).backward()
    with pytest.raises(RuntimeError, match="changed after its update"):
        opt.step()


def dtype_recorder(seen: set):
    """A grad-ready callback that notes the dtype of each final gradient."""
    return lambda shard, *, after: seen.add(LocalShard.of(shard).grad.dtype)


def one_step(model, optimizer) -> None:
    from tests.zero3.models import batch

    x, y = batch(0, 4)
    torch.nn.functional.mse_loss(
        model(x.to(DEVICE, model.chunks[0].dtype)).float(), y.to(DEVICE)).backward()
    optimizer.step()


@pytest.mark.parametrize("free", [False, True])
def test_one_rank_keeps_the_parameter_dtype_only_for_a_freed_gradient(free):
    # see the shard's Note: one rank keeps the parameter dtype
    seen: set = set()
    one_step(*sharded(torch.bfloat16, offload=False, free=free,
                      first=dtype_recorder(seen)))
    assert seen == {torch.bfloat16 if free else torch.float32}
    # an offloaded shard's gradient goes down to fp32 staging as before
    seen = set()
    one_step(*sharded(torch.bfloat16, offload=True, free=True,
                      first=dtype_recorder(seen)))
    assert seen == {torch.bfloat16, torch.float32}


def two_rank_gradient_dtypes(ctx) -> set:
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=200, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=ctx.device,
                                         config=config))
    opt = AdamFP16(model.get_trainable_chunk(), lr=3e-3,
                   update_during_backward=True, free_grads=True)
    seen: set = set()
    model.runtime.on_grad_ready(dtype_recorder(seen))
    model.runtime.on_grad_ready(opt.grad_ready)
    from tests.zero3.models import batch

    x, y = batch(ctx.rank, 4)
    torch.nn.functional.mse_loss(
        model(x.to(ctx.device, torch.bfloat16)).float(), y.to(ctx.device)).backward()
    opt.step()
    return seen


def test_two_ranks_keep_fp32_gradients():
    # a mean over ranks is a sum: it rounds in fp32
    from tests.distributed import run_distributed

    assert run_distributed(two_rank_gradient_dtypes, 2) == [{torch.float32}] * 2


def test_a_second_backward_into_a_narrow_gradient_is_refused():
    from tests.zero3.models import batch

    model, opt = sharded(torch.bfloat16, offload=False, free=True)
    for _ in range(2):
        x, y = batch(0, 4)
        torch.nn.functional.mse_loss(
            model(x.to(DEVICE, torch.bfloat16)).float(), y.to(DEVICE)).backward()
    with pytest.raises(RuntimeError, match="changed after its update"):
        opt.step()


def test_clipping_and_the_loss_scaler_refuse_freed_gradients():
    """Without the refusal clipping would scale nothing and the norm would count
    only the shards whose update had not yet freed them: silently wrong."""
    from labml_zero.optimizers.clip_grad import clip_grad_norm_, global_grad_norm
    from labml_zero.zero3.communication import Communicator

    model, optimizer = sharded(torch.float32, offload=False, free=True)
    train(model, optimizer, range(1))
    shards = model.get_trainable_chunk()
    comm = Communicator(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^clipping reads the gradients after "
                       r"backward\(\), but AdamFP16\(free_grads=True\) frees"):
        clip_grad_norm_(shards, 1.0, comm)
    with pytest.raises(ValueError, match="the gradient norm"):
        global_grad_norm(shards, comm)
    # kept gradients are read as before
    kept, kept_opt = sharded(torch.float32, offload=False, free=False)
    train(kept, kept_opt, range(1))
    clip_grad_norm_(kept.get_trainable_chunk(), 1.0, comm)
