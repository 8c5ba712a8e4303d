"""
Parameter shards in host memory: the same training as with device shards.

Two ranks (gloo, or NCCL with `LABML_ZERO_TEST_BACKEND=nccl`): the gather copies
the host shard into its slice of the full buffer and all-gathers in place.
"""

from __future__ import annotations

import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3 import ZeroConfig, Zero3Sequential, zero3_layers
from labml_zero.zero3.placement import (
    StaticPlacement,
    offload_parameters,
    resident_bytes,
    shard_specs,
)
from tests.distributed import run_distributed
from tests.zero3.models import batch, tiny_layers


def train(ctx, dtype, param_fraction: float, steps: int = 4):
    config = ZeroConfig(dtype=dtype, chunk_numel=96, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=ctx.device,
                                         config=config))
    shards = shard_specs(model)
    # every optimizer state on the host, as parameter offload requires
    placement = StaticPlacement(optimizer_cpu_fraction=1.0,
                                param_cpu_fraction=param_fraction).place(shards)
    offload_parameters(model, placement)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3, weight_decay=0.01,
                         offload=placement.optimizer_offload(shards))
    on_host = [c.shard.device.type == "cpu" and c.shard_on_host for c in model.chunks]
    losses = []
    for step in range(steps):
        x, y = batch(step, 2 * ctx.world_size)
        rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
        out = model(x[rows].to(ctx.device, dtype)).float()
        loss = torch.nn.functional.mse_loss(out, y[rows].to(ctx.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    split = resident_bytes(placement, shards, param_bytes=2 if dtype != torch.float32
                           else 4)
    return {"losses": losses, "shards": [c.shard.detach().clone() for c in model.chunks],
            "on_host": on_host, "host_positions": sorted(placement.param_on_host),
            "split": tuple(split)}


def run(param_fraction: float):
    return run_distributed(train, 2, torch.bfloat16, param_fraction)


def test_parameter_shards_on_the_host_train_alike():
    plain, offloaded = run(0.0), run(0.6)
    for a, b in zip(plain, offloaded):
        assert b["host_positions"], "some parameter shards must be on the host"
        assert [i for i, h in enumerate(b["on_host"]) if h] == b["host_positions"]
        assert not any(a["on_host"])
        # the same steps, bit for bit: only where the shard lives changed
        assert a["losses"] == b["losses"]
        for x, y in zip(a["shards"], b["shards"]):
            assert torch.equal(x, y)
        # and the model's device/host split says so: p bytes per element moved
        moved = a["split"][0] - b["split"][0]
        assert moved > 0 and b["split"][1] - a["split"][1] == moved
