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
from labml_zero.zero3.shard import LocalShard
from labml_zero.planner.sharding import shard_model, zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.communication import Communicator
from labml_zero.zero3.peer_memory import PeerMemory
from labml_zero.zero3.transport import CollectiveGather, CollectiveReduce, Transports
from tests import tolerance
from tests.distributed import run_distributed
from tests.zero3.models import TINY_TERMS, batch, tiny_layers

ROWS = 3  # rows per rank per micro-batch


def tiny_model(ctx, *, dtype, api: str = "sequential", **peer_flags):
    """The tiny test model, sharded; `peer_flags` go to `ZeroConfig`."""
    layers = tiny_layers()
    config = ZeroConfig(dtype=dtype, chunk_numel=96, align=4, **peer_flags)
    if api == "sequential":
        model = Zero3Sequential(zero3_layers(layers, device=ctx.device, config=config))
    else:
        model = shard_model(nn.Sequential(*layers), layers[1:4], device=ctx.device,
                            config=config)
    return model, layers


def build(ctx, *, peer: str, dtype, early: bool, api: str):
    """`peer`: '' (collectives), 'gather', 'reduce' or 'gather+reduce'."""
    model, layers = tiny_model(ctx, dtype=dtype, api=api,
                               peer_gather="gather" in peer,
                               peer_reduce="reduce" in peer)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3, weight_decay=0.01,
                         update_during_backward=early)
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return model, optimizer, layers


def peer_against_collective(ctx, dtype_name: str, early: bool, api: str, peer: str):
    """Train the same model with collectives and through peer memory side by
    side; report the differences."""
    dtype = getattr(torch, dtype_name)
    runs = {on: build(ctx, peer=peer if on else "", dtype=dtype, early=early,
                      api=api)
            for on in (False, True)}
    report = {"losses": {False: [], True: []}}
    for step in range(4):
        # step 2 accumulates two micro-batches with one reduce-scatter
        n_micro = 2 if step == 2 else 1
        x, y = batch(step, ROWS * ctx.world_size * n_micro)
        per = ROWS * n_micro
        x = x[ctx.rank * per:(ctx.rank + 1) * per].to(ctx.device, dtype)
        y = y[ctx.rank * per:(ctx.rank + 1) * per].to(ctx.device, dtype)
        for on, (model, optimizer, _) in runs.items():
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
            report["losses"][on].append(loss.item())
    finals = {}
    for on, (model, _, layers) in runs.items():
        with model.runtime.gathered():
            finals[on] = [p.detach().clone()
                          for p in nn.Sequential(*layers).parameters()]
    report["max_param_diff"] = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(finals[False], finals[True]))
    collective, peer_model = runs[False][0], runs[True][0]
    report["counts"] = {on: dict(runs[on][0].runtime.comm.counter.bytes)
                        for on in (False, True)}
    chunks = peer_model.runtime.all_chunks()
    report["peer_chunks"] = sum(c.peers is not None for c in chunks)
    report["chunks"] = len(chunks)
    report["none_peer"] = all(c.peers is None for c in collective.runtime.all_chunks())
    memory = peer_model.transports.peer_memory
    report["peer_bytes"] = memory.bytes
    report["allocations"] = memory.allocations
    report["shard_bytes"] = sum(c.shard.numel() * c.shard.element_size()
                                for c in chunks)
    report["workspaces"] = len(memory.workspaces)
    report["workspace_bytes"] = sum(w.local.nbytes for w in memory.workspaces)
    # every rank has unlinked its files once the model is built
    report["files_left"] = glob.glob(f"/dev/shm/labml_zero-{memory.run_name}-*")
    return report


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,dtype,early,api,peer", [
    (2, "float32", False, "sequential", "gather"),
    (2, "bfloat16", True, "generic", "gather"),
    (3, "bfloat16", False, "sequential", "gather"),
    (2, "bfloat16", True, "sequential", "gather+reduce"),
    (3, "float32", False, "generic", "reduce"),
])
def test_peer_memory_trains_like_the_collectives(world_size, dtype, early, api, peer):
    reports = run_distributed(peer_against_collective, world_size, dtype, early, api,
                              peer)
    for rank, report in enumerate(reports):
        if peer == "reduce" and world_size > 2:
            # three summands: the order of the additions may differ in the
            # last bit, through 4 steps at lr 3e-3 (tests/tolerance.py)
            assert report["max_param_diff"] <= tolerance.max_error(
                tolerance.parity(getattr(torch, dtype), terms=TINY_TERMS, steps=4,
                                 lr=3e-3), 1.5), rank
        else:
            # copies, and on two ranks a + b in either order: bit for bit
            assert report["losses"][True] == report["losses"][False], rank
            assert report["max_param_diff"] == 0.0, rank
        counts = report["counts"]
        # the same chunks gathered as often: the counter sees no difference
        assert counts[True]["all_gather"] == counts[False]["all_gather"], rank
        if "reduce" in peer and dtype == "bfloat16":
            # bf16 gradients travel in bf16, except at the step that accumulated
            # two micro-batches (fp32); see `ChunkGrads.exact_dtype`
            assert counts[True]["reduce_scatter"] < counts[False]["reduce_scatter"]
        else:
            assert counts[True]["reduce_scatter"] == counts[False]["reduce_scatter"]
        assert report["none_peer"], rank
        gathers = "gather" in peer
        assert report["peer_chunks"] == (report["chunks"] if gathers else 0), rank
        assert report["peer_bytes"] == (report["shard_bytes"] if gathers else 0) \
            + report["workspace_bytes"], rank
        assert (report["workspace_bytes"] > 0) == ("reduce" in peer), rank
        # one buffer per chunk's shard, one per workspace, nothing else
        assert report["allocations"] == report["workspaces"] + (
            report["chunks"] if gathers else 0), rank
        assert report["files_left"] == [], rank


def exact_dtype_halves_the_bytes(ctx):
    """One bf16 step without accumulation: the reduction moves bf16; with two
    micro-batches accumulated it moves fp32. The averages are the same."""
    out = {}
    for peer in (False, True):
        model, _ = tiny_model(ctx, dtype=torch.bfloat16, peer_reduce=peer)
        counter = model.runtime.comm.counter
        x, y = batch(ctx.rank, 2 * ROWS)
        x, y = x.to(ctx.device, torch.bfloat16), y.to(ctx.device, torch.bfloat16)
        nn.functional.mse_loss(model(x), y).backward()
        single = counter.bytes["reduce_scatter"]
        grads = [LocalShard.of(s).grad.clone() for s in model.get_trainable_chunk()]
        model.zero_grad()
        counter.reset()
        with model.no_sync():
            nn.functional.mse_loss(model(x[:ROWS]), y[:ROWS]).backward()
        nn.functional.mse_loss(model(x[ROWS:]), y[ROWS:]).backward()
        out[peer] = {"single": single, "accumulated": counter.bytes["reduce_scatter"],
                     "grads": grads}
    return out


@pytest.mark.distributed
def test_peer_reduce_moves_bf16_gradients_in_bf16_and_sums_in_fp32():
    for out in run_distributed(exact_dtype_halves_the_bytes, 2):
        assert 2 * out[True]["single"] == out[False]["single"]
        assert out[True]["accumulated"] == out[False]["accumulated"]
        for ours, theirs in zip(out[True]["grads"], out[False]["grads"]):
            assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def offloaded_shards_fall_back(ctx):
    """A frozen shard moved to host memory leaves peer memory and is gathered
    the usual way; the model computes the same output."""
    outputs, report = [], {}
    for offload in (False, True):
        model, _ = tiny_model(ctx, dtype=torch.float32, peer_gather=True)
        frozen = next(c for c in model.runtime.all_chunks() if not c.trainable)
        memory = model.transports.peer_memory
        before = memory.bytes
        if offload:
            frozen.offload_shard()
            report = {"peer_freed": before - memory.bytes,
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
        PeerMemory(Communicator(ctx.device))
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
    config = ZeroConfig(peer_gather=True, peer_reduce=True)
    transports = Transports.for_config(Communicator(torch.device("cpu")), config)
    assert transports.peer_memory is None
    shard, gather = transports.new_shard(5, torch.float32)
    assert type(gather) is CollectiveGather
    assert shard.tolist() == [0.0] * 5
    assert type(transports.reduction(True)) is CollectiveReduce
    assert transports.reduction(False) is None


def too_big_for_shared_memory(ctx):
    # the CPU twin's check (on GPUs, CUDA's allocator refuses by itself)
    try:
        config = ZeroConfig(peer_gather=True)
        transports = Transports.for_config(Communicator(torch.device("cpu")), config)
        transports.new_shard(1 << 60, torch.float32)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_shared_memory_too_small_is_refused_in_one_line():
    for message in run_distributed(too_big_for_shared_memory, 2):
        assert message.startswith(f"peer memory needs {4 << 60} bytes in ")
        assert " free" in message and "\n" not in message
