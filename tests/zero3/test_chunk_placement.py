"""
Where chunks live: the same training with parameter shards in host memory, and
with frozen chunks resident (gathered once), as with neither.

Two ranks (gloo, or NCCL with `LABML_ZERO_TEST_BACKEND=nccl`): a host shard's
gather copies it into its slice of the full buffer and all-gathers in place.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.planner.placement import (
    Placement,
    StaticPlacement,
    resident_bytes,
    shard_specs,
)
from labml_zero.planner.placement_probe import apply_placement
from tests.distributed import run_distributed
from tests.zero3.models import batch, tiny_layers


def train(ctx, dtype, param_fraction: float, steps: int = 4, resident=False):
    config = ZeroConfig(dtype=dtype, chunk_numel=96, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=ctx.device,
                                         config=config))
    shards = shard_specs(model)
    # every optimizer state on the host, as parameter offload requires
    placement = StaticPlacement(optimizer_cpu_fraction=1.0,
                                param_cpu_fraction=param_fraction).place(shards)
    if resident:
        frozen = frozenset(i for i, s in enumerate(shards) if not s.trainable)
        placement = Placement(resident=frozen)
    apply_placement(model, placement)
    counter = model.runtime.comm.counter
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
        if step == 0:
            counter.reset()
    split = resident_bytes(placement, shards, param_bytes=2 if dtype != torch.float32
                           else 4)
    return {"losses": losses,
            "shards": [c.shard.detach().clone() for c in model.chunks],
            "on_host": on_host, "host_positions": sorted(placement.param_on_host),
            "full_is_shard": [c.full_is_shard for c in model.chunks],
            "split": tuple(split),
            "gathered_per_step": counter.bytes.get("all_gather", 0) // (steps - 1),
            "frozen_bytes": sum(c.numel * c.full.element_size()
                                for c in model.chunks if not c.trainable)}


def run(param_fraction: float, resident: bool = False, world_size: int = 2):
    return run_distributed(train, world_size, torch.bfloat16, param_fraction, 4,
                           resident)


@pytest.mark.parametrize("world_size", [1, 2])
def test_parameter_shards_on_the_host_train_alike(world_size):
    plain, offloaded = run(0.0, world_size=world_size), run(0.6, world_size=world_size)
    for a, b in zip(plain, offloaded):
        assert b["host_positions"], "some parameter shards must be on the host"
        assert [i for i, h in enumerate(b["on_host"]) if h] == b["host_positions"]
        assert not any(a["on_host"])
        # one rank: every device shard is its chunk's full buffer, and a shard
        # moved to the host leaves that buffer to be gathered into
        assert a["full_is_shard"] == [world_size == 1] * len(a["on_host"])
        assert b["full_is_shard"] == [world_size == 1 and not h for h in b["on_host"]]
        # the same steps, bit for bit: only where the shard lives changed
        assert a["losses"] == b["losses"]
        for x, y in zip(a["shards"], b["shards"]):
            assert torch.equal(x, y)
        # and the model's device/host split says so: p bytes per element moved
        moved = a["split"][0] - b["split"][0]
        assert moved > 0 and b["split"][1] - a["split"][1] == moved


def test_resident_frozen_chunks_are_gathered_once():
    plain, resident = run(0.0), run(0.0, resident=True)
    for a, b in zip(plain, resident):
        assert a["losses"] == b["losses"]
        for x, y in zip(a["shards"], b["shards"]):
            assert torch.equal(x, y)
        # after the first step, frozen chunks are no longer all-gathered: the
        # notes' 2 (N - 1) S p bytes a step (forward and backward) are saved
        assert b["frozen_bytes"] > 0
        assert a["gathered_per_step"] - b["gathered_per_step"] == 2 * b["frozen_bytes"]


def test_only_frozen_chunks_stay_resident():
    from labml_zero.planner.placement import shard_specs as specs

    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=torch.device("cpu"),
                                         config=ZeroConfig(chunk_numel=96, align=4)))
    trainable = next(i for i, s in enumerate(specs(model)) if s.trainable)
    with pytest.raises(ValueError, match="is trainable"):
        model.chunks[trainable].keep_resident()
