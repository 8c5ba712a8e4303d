"""Gathering from the peers' memory trains exactly as NCCL's/gloo's all-gather does.

On CPU the peers' shards are files in /dev/shm mapped by every process; on GPUs
(LABML_ZERO_TEST_BACKEND=nccl) CUDA symmetric memory read by the copy engines.
"""

from __future__ import annotations

import glob
import socket

import pytest
import torch
from torch import nn

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3 import ZeroConfig, Zero3Sequential, shard_model, zero3_layers
from labml_zero.zero3.communication import Communicator
from tests.distributed import run_distributed
from tests.zero3.models import batch, tiny_layers

ROWS = 3  # rows per rank per micro-batch


def build(ctx, *, peer: bool, dtype, early: bool, api: str):
    layers = tiny_layers()
    config = ZeroConfig(dtype=dtype, chunk_numel=96, align=4, peer_gather=peer)
    if api == "sequential":
        model = Zero3Sequential(zero3_layers(layers, device=ctx.device, config=config))
    else:
        model = shard_model(nn.Sequential(*layers), layers[1:4], device=ctx.device,
                            config=config)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3, weight_decay=0.01,
                         update_during_backward=early)
    model.runtime.grad_ready = optimizer.grad_ready
    return model, optimizer, layers


def peer_against_collective(ctx, dtype_name: str, early: bool, api: str):
    """Train the same model with both gathers side by side; report differences."""
    dtype = getattr(torch, dtype_name)
    runs = {peer: build(ctx, peer=peer, dtype=dtype, early=early, api=api)
            for peer in (False, True)}
    report = {"losses": {False: [], True: []}}
    for step in range(4):
        # step 2 accumulates two micro-batches with one reduce-scatter
        n_micro = 2 if step == 2 else 1
        x, y = batch(step, ROWS * ctx.world_size * n_micro)
        per = ROWS * n_micro
        x = x[ctx.rank * per:(ctx.rank + 1) * per].to(ctx.device, dtype)
        y = y[ctx.rank * per:(ctx.rank + 1) * per].to(ctx.device, dtype)
        for peer, (model, optimizer, _) in runs.items():
            for k in range(n_micro):
                part = slice(k * ROWS, (k + 1) * ROWS)
                loss = nn.functional.mse_loss(model(x[part]), y[part]) / n_micro
                if k < n_micro - 1:
                    with model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            report["losses"][peer].append(loss.item())
    finals = {}
    for peer, (model, _, layers) in runs.items():
        with model.runtime.gathered():
            finals[peer] = [p.detach().clone()
                            for p in nn.Sequential(*layers).parameters()]
    report["max_param_diff"] = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(finals[False], finals[True]))
    collective, peer_model = runs[False][0], runs[True][0]
    report["counts"] = {peer: dict(runs[peer][0].runtime.comm.counter.bytes)
                        for peer in (False, True)}
    chunks = peer_model.runtime.all_chunks()
    report["all_peer"] = all(c.peers is not None for c in chunks)
    report["none_peer"] = all(c.peers is None for c in collective.runtime.all_chunks())
    comm = peer_model.runtime.comm
    report["peer_bytes"] = comm.peer_bytes
    report["shard_bytes"] = sum(c.shard.numel() * c.shard.element_size()
                                for c in chunks)
    # every rank has unlinked its files once the model is built
    report["files_left"] = glob.glob(f"/dev/shm/labml_zero-{comm._peer_run}-*")
    return report


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,dtype,early,api", [
    (2, "float32", False, "sequential"),
    (2, "bfloat16", True, "generic"),
    (3, "bfloat16", False, "sequential"),
])
def test_peer_gather_trains_bit_for_bit_like_the_collective(world_size, dtype, early,
                                                            api):
    reports = run_distributed(peer_against_collective, world_size, dtype, early, api)
    for rank, report in enumerate(reports):
        assert report["losses"][True] == report["losses"][False], rank
        assert report["max_param_diff"] == 0.0, rank
        # the same chunks gathered as often: the counter sees no difference
        assert report["counts"][True] == report["counts"][False], rank
        assert report["all_peer"] and report["none_peer"], rank
        assert report["peer_bytes"] == report["shard_bytes"] > 0, rank
        assert report["files_left"] == [], rank


def offloaded_shards_fall_back(ctx):
    """A frozen shard moved to host memory leaves peer memory and is gathered
    the usual way; the model computes the same output."""
    outputs, report = [], {}
    for offload in (False, True):
        layers = tiny_layers()
        config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4,
                            peer_gather=True)
        model = Zero3Sequential(zero3_layers(layers, device=ctx.device,
                                             config=config))
        frozen = next(c for c in model.runtime.all_chunks() if not c.trainable)
        before = model.runtime.comm.peer_bytes
        if offload:
            frozen.offload_shard()
            report = {"peer_freed": before - model.runtime.comm.peer_bytes,
                      "shard_bytes": frozen.shard.numel() * 4,
                      "peers": frozen.peers}
        x, y = batch(0, ROWS)
        out = model(x.to(ctx.device))
        nn.functional.mse_loss(out, y.to(ctx.device)).backward()
        outputs.append(out.detach())
    report["same_output"] = torch.equal(outputs[0], outputs[1])
    return report


@pytest.mark.distributed
def test_offloaded_shard_leaves_peer_memory():
    for report in run_distributed(offloaded_shards_fall_back, 2):
        assert report["peers"] is None
        assert report["peer_freed"] == report["shard_bytes"] > 0
        assert report["same_output"]


def two_hosts(ctx):
    """Pretend each rank runs on its own host: peer memory must be refused."""
    real = socket.gethostname
    socket.gethostname = lambda: f"host{ctx.rank}"
    try:
        Communicator(ctx.device, peer_gather=True)
    except ValueError as error:
        return str(error)
    finally:
        socket.gethostname = real
    return None


@pytest.mark.distributed
def test_peer_gather_refuses_ranks_on_several_hosts():
    for message in run_distributed(two_hosts, 2):
        assert message == ("peer_gather needs every rank on one host; the ranks run "
                           "on ['host0', 'host1']")


def test_one_rank_needs_no_peer_memory():
    comm = Communicator(torch.device("cpu"), peer_gather=True)
    assert not comm.peer_gather
    shard, peers = comm.new_shard(5, torch.float32)
    assert peers is None and shard.tolist() == [0.0] * 5
