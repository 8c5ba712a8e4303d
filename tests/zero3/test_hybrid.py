"""Hybrid sharding: parity with an unsharded reference, bytes per rank and per
link, checkpoints across group shapes, the fine-tune's flag."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labml_zero.finetune.cli import main
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import shard_model
from labml_zero.zero3 import ZeroConfig
from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint
from labml_zero.zero3.communication import Communicator
from labml_zero.planner.hybrid_memory import (
    HYBRID_EXAMPLE,
    hybrid_prediction,
    flat_step_seconds,
    hybrid_model_states,
    hybrid_step_comm,
    hybrid_step_seconds,
    hybrid_wire_bytes,
)
from labml_zero.planner.memory_model import (
    layout_model_states,
    ring_wire_bytes,
    zero_model_states,
)
from labml_zero.zero3.transport import CollectiveReduce, HybridReduce, Transports
from tests import tolerance
from tests.distributed import run_distributed, skip_job_without_gpus
from tests.test_finetune import FINETUNE_LOSS_TOLERANCE, run_dirs, tracked
from tests.zero3.models import TINY_TERMS, batch, tiny_layers
from tests.zero3.test_memory_and_comm import held_bytes
from tests.zero3.test_sharded_model import gradient_mismatch

STEPS = 4
LR = 3e-3
# fp32 through `tiny_layers` (tests/tolerance.py): parameters after the steps,
# a gradient of one pass, and parameters after one step from the same state
PARAM_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, steps=STEPS, lr=LR), 1.5)
VALUE_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, scale=1.5), 1.5)
NEXT_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, steps=1, lr=LR), 1.5)
# the global batch, the same at every world size: each rank takes its rows
ROWS = 12
REPO = Path(__file__).resolve().parents[2]


def build(ctx, shard_group_size: int | None):
    layers = tiny_layers()
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4,
                        shard_group_size=shard_group_size)
    model = shard_model(nn.Sequential(*layers), layers[1:4], device=ctx.device,
                        config=config)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=LR, weight_decay=0.01)
    return layers, model, optimizer


def step_loss(ctx, model, step: int) -> torch.Tensor:
    x, y = (t.to(ctx.device) for t in batch(step, ROWS))
    per_rank = ROWS // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    return nn.functional.mse_loss(model(x[mine]), y[mine])


def gathered(model, layers) -> list[torch.Tensor]:
    with model.runtime.gathered():
        return [p.detach().clone() for p in nn.Sequential(*layers).parameters()]


def train_hybrid(ctx, shard_group_size: int, save_dir: str | None):
    """Train with hybrid sharding beside an unsharded AdamW reference; count one
    step's traffic; optionally save, then take one more step."""
    layers, model, optimizer = build(ctx, shard_group_size)
    reference = nn.Sequential(*copy.deepcopy(tiny_layers())).to(ctx.device)
    ref_optimizer = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad],
        lr=LR, weight_decay=0.01)
    comm, replicas = model.runtime.comm, model.transports.replicas
    report = {"group": (comm.rank, comm.world_size, replicas.rank, replicas.size),
              "replica_ranks": dist.get_process_group_ranks(replicas.group)}
    for step in range(STEPS):
        if step == 1:
            comm.counter.reset()
        step_loss(ctx, model, step).backward()
        x, y = (t.to(ctx.device) for t in batch(step, ROWS))
        nn.functional.mse_loss(reference(x), y).backward()
        if step == 0:
            report["grad_mismatch"] = gradient_mismatch(model, reference, ctx)
            report["kinds"] = {type(c.reduction).__name__ for c in model.chunks
                               if c.trainable}
            report["full_is_shard"] = {c.full_is_shard for c in model.chunks}
        optimizer.step()
        if step == 1:
            report["elements"] = dict(comm.counter.elements)
            report["bytes"] = dict(comm.counter.bytes)
            report["calls"] = dict(comm.counter.calls)
            report["held"] = held_bytes(model, optimizer)
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    report["layout"] = model.layout
    ours = gathered(model, layers)
    theirs = [p.detach() for p in reference.parameters()]
    report["max_diff"] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    try:
        bad = ZeroConfig(shard_group_size=ctx.world_size - 1)
        Communicator.for_config(ctx.device, bad)
    except ValueError as error:
        report["error"] = str(error)
    if save_dir is not None:
        save_checkpoint(Path(save_dir) / "ckpt", model, optimizer)
        report["saved"] = ours
        step_loss(ctx, model, STEPS).backward()
        optimizer.step()
        report["next"] = gathered(model, layers)
    return report


def load_and_step(ctx, shard_group_size: int | None, save_dir: str):
    """Load the hybrid checkpoint into another shape and take the same step."""
    layers, model, optimizer = build(ctx, shard_group_size)
    load_checkpoint(Path(save_dir) / "ckpt", model, optimizer)
    loaded = gathered(model, layers)
    step_loss(ctx, model, STEPS).backward()
    optimizer.step()
    return {"loaded": loaded, "next": gathered(model, layers)}


def check_traffic(report) -> None:
    """The counter's bytes per rank and step on each kind of link are the
    memory model's."""
    _, size, _, replicas = report["group"]
    layout = report["layout"]
    assert layout.world_size == size
    predicted = hybrid_step_comm(layout, replicas=replicas, param_bytes=4,
                                 grad_bytes=4, backward_groups=[1, 2, 3])
    intra, inter = predicted.intra, predicted.inter
    elements, nbytes = report["elements"], report["bytes"]
    assert elements["all_gather"] == (intra.forward_all_gather.numel
                                      + intra.backward_all_gather.numel)
    assert nbytes["all_gather"] == (intra.forward_all_gather.nbytes
                                    + intra.backward_all_gather.nbytes)
    assert nbytes["reduce_scatter"] == intra.reduce_scatter.nbytes
    assert elements["replica_all_reduce"] == inter.numel
    assert nbytes["replica_all_reduce"] == inter.nbytes
    assert report["calls"]["replica_all_reduce"] == inter.collectives
    # only shards cross groups: 1/K of what the reduce-scatter takes in
    assert inter.numel * size == layout.total_numel(trainable=True)
    # the rank's model states: ZeRO-3's over the K ranks of its group
    assert report["held"] == layout_model_states(
        layout, param_bytes=4, grad_bytes=4, optimizer_bytes=12,
        master_aliases_param=True)


@pytest.mark.distributed
def test_world_4_in_two_groups_of_2_trains_saves_and_reshards(tmp_path):
    reports = run_distributed(train_hybrid, 4, 2, str(tmp_path))
    assert [r["group"] for r in reports] == [(0, 2, 0, 2), (1, 2, 0, 2),
                                             (0, 2, 1, 2), (1, 2, 1, 2)]
    # the replicas of a shard are the ranks with the same place in each group
    assert [r["replica_ranks"] for r in reports] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, report in enumerate(reports):
        assert report["max_diff"] <= PARAM_ERROR, (rank, report["max_diff"])
        assert report["grad_mismatch"] <= VALUE_ERROR, (rank, report["grad_mismatch"])
        assert report["kinds"] == {"HybridReduce"}
        assert report["error"] == "shard_group_size 3 does not divide the world size 4"
        check_traffic(report)
    saved, expected = reports[0]["saved"], reports[0]["next"]
    # one checkpoint, written by the first group, as a world of 2 writes it
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()
                  if p.name.startswith("rank")) == [
        "rank-00000.pt", "rank-00000.safetensors",
        "rank-00001.pt", "rank-00001.safetensors"]
    for world, size in ((4, 4), (4, None), (2, None)):
        for loaded in run_distributed(load_and_step, world, size, str(tmp_path)):
            assert all(torch.equal(a, b) for a, b in zip(loaded["loaded"], saved))
            # the optimizer state came along: the next step agrees
            diff = max((a - b).abs().max().item()
                       for a, b in zip(loaded["next"], expected))
            assert diff <= NEXT_ERROR, (world, size, diff)


@pytest.mark.distributed
def test_world_6_in_three_groups_of_2_matches_the_reference():
    reports = run_distributed(train_hybrid, 6, 2, None)
    assert [r["group"][2] for r in reports] == [0, 0, 1, 1, 2, 2]
    for rank, report in enumerate(reports):
        assert report["max_diff"] <= PARAM_ERROR, (rank, report["max_diff"])
        assert report["grad_mismatch"] <= VALUE_ERROR, (rank, report["grad_mismatch"])
        assert report["error"] == "shard_group_size 5 does not divide the world size 6"
        check_traffic(report)


@pytest.mark.distributed
def test_world_2_in_groups_of_1_replicates_and_gathers_nothing():
    # groups of one: every rank holds the whole model (its full buffers are its
    # shards, nothing is gathered) and the replicas average the gradients
    for rank, report in enumerate(run_distributed(train_hybrid, 2, 1, None)):
        assert report["group"] == (0, 1, rank, 2)
        assert report["max_diff"] <= PARAM_ERROR, (rank, report["max_diff"])
        assert report["grad_mismatch"] <= VALUE_ERROR, (rank, report["grad_mismatch"])
        assert report["kinds"] == {"HybridReduce"}
        assert report["full_is_shard"] == {True}
        assert report["elements"].get("all_gather", 0) == 0


def hybrid_through_peer_memory(ctx):
    """Hybrid sharding with gathers and reductions through peer memory inside
    each shard group: the transports combine, and the gradient is the
    reference's."""
    layers = tiny_layers()
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4,
                        shard_group_size=2, peer_gather=True, peer_reduce=True)
    model = shard_model(nn.Sequential(*layers), layers[1:4], device=ctx.device,
                        config=config)
    reference = nn.Sequential(*copy.deepcopy(tiny_layers())).to(ctx.device)
    step_loss(ctx, model, 0).backward()
    x, y = (t.to(ctx.device) for t in batch(0, ROWS))
    nn.functional.mse_loss(reference(x), y).backward()
    trainable = [c for c in model.chunks if c.trainable]
    return {"gathers": {type(c.transport).__name__ for c in model.chunks},
            "reductions": {(type(c.reduction).__name__,
                            type(c.reduction.inner).__name__) for c in trainable},
            # one reduction for all the chunks, chosen once
            "shared": len({id(c.reduction) for c in trainable}),
            "peers": len(dist.get_process_group_ranks(
                model.transports.peer_memory.comm.group)),
            "grad_mismatch": gradient_mismatch(model, reference, ctx)}


@pytest.mark.distributed
def test_hybrid_combines_with_peer_memory_inside_each_group():
    for rank, report in enumerate(run_distributed(hybrid_through_peer_memory, 4)):
        assert report["gathers"] == {"PeerGather"}, rank
        assert report["reductions"] == {("HybridReduce", "PeerReduce")}, rank
        assert report["shared"] == 1, rank
        # peer memory spans the shard group only, not the world
        assert report["peers"] == 2, rank
        assert report["grad_mismatch"] <= VALUE_ERROR, (rank, report["grad_mismatch"])


def test_one_group_is_plain_zero3():
    assert not dist.is_initialized()
    comm = Communicator(torch.device("cpu"), shard_group_size=1)
    assert (comm.rank, comm.world_size) == (0, 1)
    assert Transports.for_config(comm, ZeroConfig(shard_group_size=1)).replicas is None
    with pytest.raises(ValueError, match="^shard_group_size 2 does not divide "
                       "the world size 1$"):
        Communicator(torch.device("cpu"), shard_group_size=2)
    # refused before the group is read: any process group of one's own
    with pytest.raises(ValueError, match="^shard_group_size splits the default "
                       "process group; it cannot be combined with a process group$"):
        Communicator(torch.device("cpu"), group=object(), shard_group_size=1)
    with pytest.raises(ValueError, match="shard_group_size must be positive"):
        ZeroConfig(shard_group_size=0)
    layers = tiny_layers()
    model = shard_model(nn.Sequential(*layers), layers[1:4], device="cpu",
                        config=ZeroConfig(dtype=torch.float32, chunk_numel=96,
                                          align=4))
    assert {type(c.reduction) for c in model.chunks if c.trainable} == {
        CollectiveReduce}
    assert not any(isinstance(c.reduction, HybridReduce) for c in model.chunks)
    # a frozen chunk has no gradients to reduce
    assert all(c.reduction is None for c in model.chunks if not c.trainable)


def test_hybrid_memory_and_time_formulas():
    psi = 10**9
    # bytes per rank: ZeRO-3's over the group, whatever the world size
    assert hybrid_model_states(psi, 0, 64, 8, grad_bytes=4) == zero_model_states(
        psi, 0, 8, grad_bytes=4)
    with pytest.raises(ValueError, match="shard_group_size 3 does not divide"):
        hybrid_model_states(psi, 0, 8, 3)
    # one host: hybrid is flat ZeRO-3
    one = dict(bandwidth_in=4e11, bandwidth_out=5e10)
    assert hybrid_step_seconds(psi, 8, 8, **one) == pytest.approx(
        flat_step_seconds(psi, 8, 8, **one))
    # two hosts: (7/8)·8Ψ/B_in + 2·(1/2)·4Ψ/8/B_out, against (15/16)·8Ψ/B_out
    assert hybrid_step_seconds(psi, 16, 8, **one) == pytest.approx(
        7 / 8 * 8e9 / 4e11 + 4e9 / 8 / 5e10)
    assert flat_step_seconds(psi, 16, 8, **one) == pytest.approx(15 / 16 * 8e9 / 5e10)
    # many hosts: the traffic across hosts tends to 2gΨ/K
    hosts = 1024
    assert hybrid_step_seconds(psi, 8 * hosts, 8, **one) == pytest.approx(
        7 / 8 * 8e9 / 4e11 + 2 * (hosts - 1) / hosts * 4e9 / 8 / 5e10)
    for hosts in (2, 4, 1024):
        assert (hybrid_step_seconds(psi, 8 * hosts, 8, **one)
                < flat_step_seconds(psi, 8 * hosts, 8, **one))


def test_prediction_table():
    """The hybrid page's table: one host is plain ZeRO-3; beyond, hybrid keeps
    one host's states per rank, (2 + 4 + 12)Ψ/8, and less time than flat."""
    example = HYBRID_EXAMPLE
    one = hybrid_prediction(1)
    assert one.flat_seconds == one.hybrid_seconds and one.flat_gb == one.hybrid_gb
    for hosts in (2, 16, 1024):
        row = hybrid_prediction(hosts)
        assert row.ranks == 8 * hosts
        assert row.hybrid_gb == pytest.approx((2 + 4 + 12) * example.psi / 8 / 1e9)
        assert row.flat_gb == pytest.approx(row.hybrid_gb / hosts)
        assert row.hybrid_seconds < row.flat_seconds
        assert row.markdown_row().startswith(f"| {hosts:,} | {8 * hosts:,} | ")
    # the optimizer's bytes the page states are the default
    assert hybrid_prediction(4) == hybrid_prediction(4, optimizer_bytes=12)


def test_wire_bytes_per_link():
    from labml_zero.zero3.chunk_layout import plan_chunks
    from labml_zero.zero3.unit_chunks import param_specs

    layers = tiny_layers()
    specs, _ = param_specs([m.named_parameters() for m in layers])
    layout = plan_chunks(specs, 96, 2, align=4)
    comm = hybrid_step_comm(layout, replicas=3, param_bytes=2, grad_bytes=4)
    inside, across = hybrid_wire_bytes(comm, 2, 3)
    assert inside == ring_wire_bytes(comm.intra.nbytes, 2) == comm.intra.nbytes // 2
    assert across == 2 * (comm.inter.nbytes * 2 // 3)
    assert math.isclose(comm.inter.nbytes * 2, layout.total_numel(trainable=True) * 4)
    assert hybrid_step_comm(layout, replicas=1).inter.numel == 0


def test_finetune_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--world-size", "4", "--shard-group-size", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--shard-group-size 3 does not divide the world size 4" in err


def finetune_losses(tmp: Path, *flags: str) -> dict[int, float]:
    """Three steps of the fine-tune at world 4; rank 0's training losses."""
    skip_job_without_gpus(4)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tmp.mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "labml_zero.finetune_neox", "--world-size", "4",
         *flags, "--batch-size", "1", "--seq-len", "16", "--steps", "3",
         "--valid-every", "3", "--sample-tokens", "0",
         "--out", str(tmp / "out"), "--log-dir", str(tmp / "logs")],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tracked(run_dirs(tmp)[0])["loss.train"]


@pytest.mark.distributed
def test_finetune_with_shard_group_size_2_trains_as_flat_zero3(tmp_path):
    hybrid = finetune_losses(tmp_path / "hybrid", "--shard-group-size", "2")
    flat = finetune_losses(tmp_path / "flat")
    assert sorted(hybrid) == sorted(flat) == [1, 2, 3]
    # the same fp32 gradient, summed in another order
    for step in (1, 2, 3):
        assert hybrid[step] == pytest.approx(flat[step], **FINETUNE_LOSS_TOLERANCE)
    assert hybrid[3] < hybrid[1]
