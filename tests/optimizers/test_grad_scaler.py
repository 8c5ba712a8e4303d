"""The loss scaler against an optimizer that updates during the backward pass."""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.optimizers.grad_scaler import LossScaler
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from tests.zero3.models import batch, tiny_layers


def test_overflow_during_backward_changes_nothing_and_is_refused():
    """Issue #20 item 6: fp16 with a scale that overflows every gradient. The
    updates queued as each chunk is reduced see the overflow and skip; no
    shard and no master changed; the scaler refuses such an optimizer."""
    config = ZeroConfig(dtype=torch.float16, chunk_numel=200, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu",
                                         config=config))
    shards = model.get_trainable_chunk()
    optimizer = AdamFP16(shards, lr=1e-2, update_during_backward=True)
    model.runtime.on_grad_ready(optimizer.grad_ready)
    shards_before = [s.detach().clone() for s in shards]
    masters_before = [c.local.master_init.clone() for c in model.chunks
                      if c.trainable]
    scaler = LossScaler(model.runtime.comm, init_scale=2.0**60)
    x, y = batch(0, 4)
    loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
    scaler.scale(loss).backward()
    # every early update began, and skipped its non-finite gradient
    assert set(optimizer.early) == set(shards)
    assert all(torch.equal(a, b) for a, b in zip(shards, shards_before))
    masters = [optimizer.shard_state(s)["master"] for s in shards]
    assert all(torch.equal(a, b) for a, b in zip(masters, masters_before))
    scaler.unscale_(shards)
    assert scaler.found_inf
    with pytest.raises(ValueError, match="update_during_backward"):
        scaler.step(optimizer)


def test_fp16_flushes_what_the_scale_keeps():
    """The page's premise: fp16's smallest magnitude, a subnormal, is about
    6e-8; a gradient below half of it rounds to zero, and the same gradient
    times the default initial scale is representable."""
    from labml_zero.zero3.communication import Communicator

    # the fp16 number whose bits are 0x0001: the first above zero
    smallest = torch.tensor([1], dtype=torch.int16).view(torch.float16).item()
    assert f"{smallest:.0e}" == "6e-08"
    assert torch.tensor(smallest).half().item() == smallest
    grad = torch.tensor(smallest / 4)
    assert grad.half().item() == 0.0
    scaler = LossScaler(Communicator(torch.device("cpu")))
    scaled = (grad * scaler.scale_value).half()
    assert scaled.item() != 0.0 and torch.isfinite(scaled)
    assert scaled.float() / scaler.scale_value == pytest.approx(grad.item(), rel=1e-3)
