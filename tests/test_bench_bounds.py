"""
The one-device bounds of bench/bounds.py: the floor's update is AdamW on fp32
masters, and `bench.run` runs both bounds beside an engine, on one device only.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import run as bench_run
from bench.bounds import STATE_BYTES, FloorUpdate
from labml_zero.optimizers.rounded_update import one_pass_bytes
from labml_zero.planner.memory_model import zero_model_states
from tests import tolerance
from tests.optimizers.test_offload import DEVICE

STEPS = 8
HYPER = dict(lr=1e-2, betas=(0.8, 0.999), eps=1e-8, weight_decay=0.1)
FP32 = tolerance.parity(torch.float32, terms=tolerance.ADAMW_ROUNDINGS * STEPS)
SHAPES = ((7, 5), (11,), (3,))
GRADLESS = 2
"""The index of the parameter that never gets a gradient."""


def train(lr: float) -> tuple[list[torch.nn.Parameter], FloorUpdate, torch.optim.AdamW]:
    """`STEPS` steps of the floor on bf16 parameters and of `torch.optim.AdamW`
    at `lr` on fp32 copies of them, from the same bf16 gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=DEVICE).bfloat16())
              for shape in SHAPES]
    copies = [torch.nn.Parameter(p.detach().float()) for p in params]
    floor = FloorUpdate(params, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                        betas=HYPER["betas"], eps=HYPER["eps"])
    reference = torch.optim.AdamW(copies, lr=lr, betas=HYPER["betas"],
                                  eps=HYPER["eps"],
                                  weight_decay=HYPER["weight_decay"], foreach=False)
    for _ in range(STEPS):
        for i, (param, copy) in enumerate(zip(params, copies)):
            if i != GRADLESS:
                grad = torch.randn(param.shape, device=DEVICE).bfloat16()
                param.grad, copy.grad = grad, grad.float()
        floor.step()
        reference.step()
        reference.zero_grad(set_to_none=True)
    return params, floor, reference


def assert_floor_is(floor: FloorUpdate, reference: torch.optim.AdamW) -> None:
    for i, (master, exp_avg, exp_avg_sq) in enumerate(floor.states):
        if i == GRADLESS:
            continue
        copy = reference.param_groups[0]["params"][i]
        state = reference.state[copy]
        torch.testing.assert_close(master, copy.detach().view(-1), **FP32)
        torch.testing.assert_close(exp_avg, state["exp_avg"].view(-1), **FP32)
        torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"].view(-1), **FP32)


def test_the_floor_is_adamw_on_fp32_masters():
    params, floor, reference = train(HYPER["lr"])
    assert_floor_is(floor, reference)
    for i, (param, (master, _, _)) in enumerate(zip(params, floor.states)):
        # each weight is its master rounded, and its gradient is dropped
        assert torch.equal(param.detach().view(-1), master.bfloat16())
        assert param.grad is None
    # the parameter without a gradient kept its value and its zero moments
    gradless = floor.states[GRADLESS]
    assert torch.equal(gradless[0], params[GRADLESS].detach().float().view(-1))
    assert not gradless[1].any() and not gradless[2].any()
    # the tolerance still catches a wrong update: lr x 1.001
    _, _, wrong = train(HYPER["lr"] * 1.001)
    with pytest.raises(AssertionError):
        assert_floor_is(floor, wrong)


def test_the_figures_of_the_page():
    assert one_pass_bytes(2, 2) == 28
    assert STATE_BYTES == 3 * 4


def test_the_bounds_refuse_several_devices_before_any_process():
    with pytest.raises(SystemExit, match="--world-size 1, not 2"):
        bench_run.main(["--tiny", "--cpu", "--world-size", "2", "--workloads", "W1",
                        "--engines", "labml_zero,update_floor"])


@pytest.mark.distributed
def test_tiny_bounds_beside_ours(tmp_path):
    """
    Both bounds run a tiny W2-1 beside labml_zero on one gloo process: the
    model alone trains nothing, the floor trains; W6 offloads and is skipped.
    """
    out = tmp_path / "results.jsonl"
    lines = bench_run.main([
        "--tiny", "--cpu", "--world-size", "1", "--workloads", "W2-1,W6",
        "--engines", "labml_zero,model_only,update_floor", "--steps", "3",
        "--warmup", "1", "--no-profile", "--out", str(out)])
    assert [json.loads(text) for text in out.read_text().splitlines()] == lines
    by = {(line["workload"], line["engine"]): line for line in lines}
    for engine in ("labml_zero", "model_only", "update_floor"):
        line = by["W2-1", engine]
        assert line["status"] == "ok", line
        assert line["loss_finite"] and line["step_time_mean_s"] > 0
    ours, alone, floor = (by["W2-1", e] for e in ("labml_zero", "model_only",
                                                  "update_floor"))
    assert alone["psi_trainable"] == floor["psi_trainable"] == ours["psi_trainable"]
    psi_t, psi_f = floor["psi_trainable"], floor["psi_frozen"]
    assert floor["memory_model_gib"]["zero_states"] == zero_model_states(
        psi_t, psi_f, 1, param_bytes=2, grad_bytes=2, optimizer_bytes=12) / 2**30
    assert alone["memory_model_gib"]["zero_states"] == zero_model_states(
        psi_t, psi_f, 1, param_bytes=2, grad_bytes=2, optimizer_bytes=0) / 2**30
    # the same batches every step: the model alone keeps its loss, the floor
    # lowers it
    assert floor["loss"] < alone["loss"]
    for engine in ("model_only", "update_floor"):
        skipped = by["W6", engine]
        assert skipped["status"] == "skipped" and "offloads" in skipped["reason"]
