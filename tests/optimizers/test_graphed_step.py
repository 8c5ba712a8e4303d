"""
`GraphedStep`: the step recorded once and replayed trains as the eager step.

On CPU the twin re-runs the step in the captured mode (the optimizer reads the
learning rate and the step counts from device tensors, the host sets the counts
after each replay): bit for bit the eager training. `LABML_ZERO_TEST_DEVICE=cuda`
runs the same tests with a real CUDA graph, and `LABML_ZERO_TEST_BACKEND=nccl`
the two-rank one over NCCL.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16, NonFiniteGradient
from labml_zero.optimizers.graphed_step import (
    CaptureFailed,
    GraphedStep,
    capture_failed,
)
from tests.distributed import run_distributed
from tests.optimizers.test_offload import DEVICE, assert_same

STEPS = 7
WARMUP = 2


def built(dtype, *, early: bool, offload=None, device=DEVICE, states="fp32"):
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    config = ZeroConfig(dtype=dtype, chunk_numel=200, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=device,
                                         config=config))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3, betas=(0.8, 0.99),
                         weight_decay=0.01, offload=offload,
                         update_during_backward=early, free_grads=early,
                         states=states)
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return model, optimizer


def training_step(model, optimizer):
    """One whole step, as `GraphedStep` records it: batch `[B, 12]` holds the
    inputs (7) and the targets (5)."""
    def step(batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :7], batch[:, 7:]
        out = model(x.to(model.chunks[0].dtype)).float()
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return step


def batches(count: int, device=DEVICE, rank: int = 0) -> list[torch.Tensor]:
    from tests.zero3.models import batch

    out = []
    for i in range(count):
        x, y = batch(i + 100 * rank, 4)
        out.append(torch.cat([x, y], dim=1).to(device))
    return out


def schedule(optimizer, i: int) -> None:
    """A learning rate that changes every step, as a scheduler's does."""
    for group in optimizer.param_groups:
        group["lr"] = 3e-3 * (1 + i) / STEPS


def train(model, optimizer, step, data) -> list[torch.Tensor]:
    losses = []
    for i, batch in enumerate(data):
        schedule(optimizer, i)
        losses.append(step(batch))
    return losses


def assert_same_training(a, b) -> None:
    (model_a, opt_a, losses_a), (model_b, opt_b, losses_b) = a, b
    for x, y in zip(losses_a, losses_b):
        assert_same(x, y)
    for p, q in zip(model_a.chunks, model_b.chunks):
        assert_same(p.shard, q.shard)
    for p, q in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        assert opt_a.shard_state(p)["step"] == opt_b.shard_state(q)["step"] == STEPS
        for key in opt_a.layout.names:
            assert_same(opt_a.state[p][key], opt_b.state[q][key])


@pytest.mark.parametrize("states", ["fp32", "bf16-moments", "bf16-stochastic",
                                    "bf16-kahan", "8bit-moments"])
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_graphed_step_trains_as_the_eager_step(dtype, early, states):
    data = batches(STEPS)
    model, opt = built(dtype, early=early, states=states)
    eager = (model, opt, train(model, opt, training_step(model, opt), data))
    model, opt = built(dtype, early=early, states=states)
    graphed = GraphedStep(training_step(model, opt), opt, warmup=WARMUP)
    losses = train(model, opt, graphed, data)
    assert graphed.captured
    assert_same_training(eager, (model, opt, losses))
    # every shard was updated once a step, the replays included
    assert opt.capture.done == STEPS - WARMUP


def test_a_deliberately_wrong_step_count_is_caught():
    # the check above must see a replay that reuses the captured step count
    data = batches(STEPS)
    model, opt = built(torch.float32, early=True)
    eager = (model, opt, train(model, opt, training_step(model, opt), data))
    model, opt = built(torch.float32, early=True)
    graphed = GraphedStep(training_step(model, opt), opt, warmup=WARMUP)
    train(model, opt, graphed, data[:WARMUP + 1])
    opt.capture.done = 0  # every replay would bias-correct as the capture
    losses = train(model, opt, graphed, data[WARMUP + 1:])
    with pytest.raises(AssertionError):
        assert_same_training(eager, (model, opt, eager[2][:WARMUP + 1] + losses))


def graphed_ranks(ctx, dtype):
    device = ctx.device
    data = batches(STEPS, device, ctx.rank)
    model, opt = built(dtype, early=True, device=device)
    eager_losses = train(model, opt, training_step(model, opt), data)
    eager = [c.shard.detach().clone() for c in model.chunks]
    eager_counter = model.runtime.comm.counter
    model, opt = built(dtype, early=True, device=device)
    counter = model.runtime.comm.counter
    graphed = GraphedStep(training_step(model, opt), opt, warmup=WARMUP,
                          counter=counter)
    losses = train(model, opt, graphed, data)
    return {"eager_losses": eager_losses, "losses": losses, "eager": eager,
            "shards": [c.shard.detach().clone() for c in model.chunks],
            "calls": dict(counter.calls), "bytes": dict(counter.bytes),
            "eager_calls": dict(eager_counter.calls),
            "eager_bytes": dict(eager_counter.bytes),
            "captured": graphed.captured}


def test_two_ranks_train_as_the_eager_step():
    for rank in run_distributed(graphed_ranks, 2, torch.bfloat16):
        assert rank["captured"]
        for a, b in zip(rank["eager_losses"], rank["losses"]):
            assert_same(a, b)
        for a, b in zip(rank["eager"], rank["shards"]):
            assert_same(a, b)
        # the replays' collectives are counted as the capture's, and the
        # capture, which ran nothing, not at all: as many as the eager steps
        assert rank["calls"] == rank["eager_calls"]
        assert rank["bytes"] == rank["eager_bytes"]
        assert rank["calls"] and all(n % STEPS == 0 for n in rank["calls"].values())


def test_a_non_finite_gradient_in_a_replay_is_raised_and_drops_the_graph():
    model, opt = built(torch.float32, early=True)
    graphed = GraphedStep(training_step(model, opt), opt, warmup=WARMUP)
    data = batches(WARMUP + 2)
    train(model, opt, graphed, data)
    assert graphed.captured
    poisoned = data[0].clone()
    poisoned[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradient):
        graphed(poisoned)
        # on a GPU the flags are read after the next replay is queued
        graphed(data[0])
    assert not graphed.captured


def test_what_cannot_be_recorded_is_refused_before_the_capture():
    model, opt = built(torch.float32, early=True, offload=[0])
    with pytest.raises(ValueError, match=r"1 shard\(s\) in host memory"):
        GraphedStep(training_step(model, opt), opt)
    model, opt = built(torch.float32, early=False)
    opt.fused = False
    with pytest.raises(ValueError, match="fused kernel"):
        GraphedStep(training_step(model, opt), opt)
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        GraphedStep(training_step(model, opt), opt, warmup=0)


def test_a_changed_batch_shape_or_frozen_hyperparameter_is_refused():
    model, opt = built(torch.float32, early=False)
    graphed = GraphedStep(training_step(model, opt), opt, warmup=1)
    data = batches(2)
    graphed(data[0])
    graphed(data[1])
    with pytest.raises(ValueError, match=r"recorded batches of shape \[4, 12\]"):
        graphed(data[0][:2])
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ValueError, match="weight_decay changed from 0.01 to 0.5"):
        graphed(data[0])
    assert not graphed.captured


def record_a_step_with_a_host_sync() -> None:
    """Run in a process of its own: a failed capture leaves CUDA's random
    generator in its capture state for the rest of the process."""
    model, opt = built(torch.float32, early=False)
    plain = training_step(model, opt)
    graphed = GraphedStep(lambda batch: plain(batch).item() * torch.ones(()),
                          opt, warmup=1)
    data = batches(2)
    graphed(data[0])
    with pytest.raises(CaptureFailed, match="operation not permitted when "
                       "stream is capturing"):
        graphed(data[1])
    assert not graphed.captured
    print("refused as expected")


def test_a_failed_capture_names_the_first_error_of_its_chain():
    """The CPU twin of the test below: the capture's own errors, raised while
    handling the step's, are not the cause the user is shown."""
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing\n"
                               "second line")
        except RuntimeError:
            raise RuntimeError("the capture was invalidated")
    except RuntimeError as failure:
        error = capture_failed(failure)
    assert isinstance(error, CaptureFailed)
    assert ("(RuntimeError: operation not permitted when stream is capturing); "
            in str(error))
    assert "invalidated" not in str(error) and "second line" not in str(error)


@pytest.mark.gpu
def test_a_host_sync_in_the_step_names_its_cause():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", "from tests.optimizers.test_graphed_step import "
         "record_a_step_with_a_host_sync as run; run()"],
        cwd=root, env={**os.environ, "LABML_ZERO_TEST_DEVICE": DEVICE.type},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused as expected" in done.stdout


@pytest.mark.parametrize("load", ["checkpoint", "state_dict"])
def test_a_load_ends_the_captured_step(tmp_path, load):
    """A run rolled back to an earlier step while its step is captured: the
    load forgets the capture, the next calls warm up and record again, and
    the training goes on from the loaded step as an eager run loaded from it
    would (not from the capture's count, $t_c + r$)."""
    import copy

    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint

    data = batches(WARMUP + 6)
    saved_at = WARMUP + 1
    model, opt = built(torch.bfloat16, early=False)
    graphed = GraphedStep(training_step(model, opt), opt, warmup=WARMUP)
    for batch in data[:saved_at]:
        graphed(batch)
    save_checkpoint(tmp_path / "ckpt", model, opt)
    shards = [c.shard.detach().clone() for c in model.chunks]
    state_dict = copy.deepcopy(opt.state_dict())
    for batch in data[saved_at:saved_at + 3]:
        graphed(batch)
    assert graphed.captured
    if load == "checkpoint":
        load_checkpoint(tmp_path / "ckpt", model, opt)
    else:
        for chunk, shard in zip(model.chunks, shards):
            chunk.shard.detach().copy_(shard)
        opt.load_state_dict(state_dict)
    assert not graphed.captured
    # warm-up, capture and replays again, each a step from the loaded one
    rest = data[saved_at:]
    losses = [graphed(batch) for batch in rest]
    assert graphed.captured and opt.capture.done == len(rest) - WARMUP

    ref, ref_opt = built(torch.bfloat16, early=False)
    load_checkpoint(tmp_path / "ckpt", ref, ref_opt)
    eager = training_step(ref, ref_opt)
    for loss, batch in zip(losses, rest):
        assert_same(loss, eager(batch))
    for p, q in zip(model.chunks, ref.chunks):
        assert_same(p.shard, q.shard)
    for p, q in zip(opt.param_groups[0]["params"],
                    ref_opt.param_groups[0]["params"]):
        assert (opt.shard_state(p)["step"] == ref_opt.shard_state(q)["step"]
                == saved_at + len(rest))
        for key in opt.layout.names:
            assert_same(opt.state[p][key], ref_opt.state[q][key])
