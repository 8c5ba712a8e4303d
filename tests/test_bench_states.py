"""
`bench.run --optimizer-states`: labml_zero (and the update floor) run once per
state layout named, each line saying its layout and counting its $K$; the
peers keep fp32 and say so; an unknown name stops everything in one line;
the planner plans with the layout given.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from bench import bounds
from bench import run as bench_run
from bench.pair import ENGINES, STATE_ENGINES, describe
from bench.plan import plan_workload
from bench.workloads import shrink
from bench.workloads import workloads as all_workloads
from labml_zero import launch
from labml_zero.launch import DistContext
from labml_zero.optimizers import blockwise_moments
from labml_zero.optimizers.rounded_update import (Betas, adamw_rounded_,
                                                  step_coefficients)
from labml_zero.planner.devices import GPUS, Cluster
from labml_zero.planner.memory_model import zero_model_states
from labml_zero.planner.search import Pinned
from labml_zero.zero3.state_layout import (BF16_MOMENTS, EIGHT_BIT_MOMENTS,
                                           FP32_STATES, LAYOUTS)

GIB = 2**30
WORLD = 2


@pytest.mark.distributed
def test_each_choice_runs_with_its_own_k():
    """Every layout on a tiny W2-1 over two gloo ranks: labml_zero's line says
    its layout, and its memory model and predicted peak count that layout's
    $K$ (`state_layout`'s); FSDP2 runs once and says fp32."""
    names = list(LAYOUTS)
    lines = bench_run.main([
        "--tiny", "--cpu", "--workloads", "W2-1", "--engines", "labml_zero,fsdp2",
        "--optimizer-states", ",".join(names), "--steps", "1", "--warmup", "0",
        "--no-profile"])
    assert [(line["engine"], line["optimizer_states"]) for line in lines] == [
        *(("labml_zero", name) for name in names), ("fsdp2", "fp32")]
    ours = {line["optimizer_states"]: line for line in lines[:-1]}
    for name, line in ours.items():
        assert line["status"] == "ok", line
        k = LAYOUTS[name].bytes_per_element()
        # the optimizer's own layout, as the formula names it
        assert f"with K = {k:g} ({name} states)" in line["memory_formula"]
        psi_t, psi_f = line["psi_trainable"], line["psi_frozen"]
        model = line["memory_model_gib"]
        assert model["zero_states"] * GIB == zero_model_states(
            psi_t, psi_f, WORLD, param_bytes=2, grad_bytes=4, optimizer_bytes=k)
        assert model["predicted_peak"] == pytest.approx(
            model["layout_states"] - model["shard_grads"] + model["gathered_peak"]
            + max(model["activations"], model["activations_beside_grads"]
                  + model["early_update_grads"]), rel=1e-12)
    assert lines[-1]["status"] == "ok"
    # bf16 moments: 4 bytes an element less, over this rank's share of Ψt
    fp32, bf16 = (ours[n]["memory_model_gib"] for n in ("fp32", "bf16-moments"))
    saved = FP32_STATES.bytes_per_element() - BF16_MOMENTS.bytes_per_element()
    assert saved == 4
    share = math.ceil(ours["fp32"]["psi_trainable"] / WORLD)
    assert (fp32["zero_states"] - bf16["zero_states"]) * GIB == saved * share
    # the real layout: the same 4 bytes of each trainable shard element,
    # padding included, and the predicted peak lower by as much
    layout_saved = (fp32["layout_states"] - bf16["layout_states"]) * GIB
    assert layout_saved >= saved * share and layout_saved % saved == 0
    assert (fp32["predicted_peak"] - bf16["predicted_peak"]) * GIB == \
        pytest.approx(layout_saved, rel=1e-9)
    assert "| W2-1 | labml_zero (bf16-moments) |" in bench_run.table(lines)


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a pair or a process started")
    monkeypatch.setattr(launch, "spawn", refuse)
    monkeypatch.setattr(bench_run, "run_pair", refuse)


def test_an_unknown_name_is_refused_in_one_line(capsys, nothing_starts):
    for value in ("fp32,bf16", "", "fp32,,8bit-moments"):
        with pytest.raises(SystemExit) as refused:
            bench_run.main(["--tiny", "--cpu", "--optimizer-states", value])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1
        assert "--optimizer-states" in err and ",".join(LAYOUTS) in err
    assert bench_run.parse_args(["--optimizer-states", "bf16-moments,fp32,"
                                 "bf16-moments"]).states_list == [
        "bf16-moments", "fp32"]
    assert bench_run.parse_args([]).states_list == ["fp32"]


def test_only_labml_zero_and_the_floor_keep_the_layout():
    workload = replace(shrink(all_workloads()["W2-1"]),
                       optimizer_states="bf16-moments")
    for engine in ENGINES + bounds.BOUNDS:
        said = describe(engine, workload, 1, "gloo")["optimizer_states"]
        assert said == ("bf16-moments" if engine in STATE_ENGINES else "fp32")
    with pytest.raises(ValueError, match="optimizer_states must be one of"):
        replace(workload, optimizer_states="bf16")


def floor_states(layout, seed: int = 0):
    """A floor of `layout` over two bf16 parameters, one with a partial
    8-bit block, each with a bf16 gradient."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape).bfloat16())
              for shape in ((3, 100), (7,))]
    floor = bounds.FloorUpdate(params, lr=1e-2, weight_decay=0.1, states=layout)
    grads = [torch.randn(p.shape).bfloat16() for p in params]
    return params, floor, grads


@pytest.mark.parametrize("layout", [FP32_STATES, BF16_MOMENTS, EIGHT_BIT_MOMENTS])
def test_the_floor_keeps_the_layout_and_takes_its_pass(layout):
    """The floor's states are the layout's, dtype and length; one step is the
    library's pass of that layout on the same operands, bit for bit (the
    same function), which the fp32 pass on the same operands is not."""
    params, floor, grads = floor_states(layout)
    for p, state in zip(params, floor.states):
        assert [(t.dtype, t.numel()) for t in state] == [
            (s.dtype, s.numel(p.numel())) for s in layout.tensors]
    before = [tuple(t.clone() for t in state) for state in floor.states]
    for p, g in zip(params, grads):
        p.grad = g
    floor.step()
    coefficients = step_coefficients(torch.tensor(1.0), torch.tensor(1e-2),
                                     beta1=0.9, beta2=0.999, weight_decay=0.1)
    betas = Betas(0.9, 0.999, 1e-8)
    for p, g, state, mine in zip(params, grads, before, floor.states):
        shard = torch.empty(p.numel(), dtype=torch.bfloat16)
        if layout.blockwise:
            master, *moments = state
            blockwise_moments.one_pass(master, g.view(-1), tuple(moments), shard,
                                       coefficients, None, betas)
        else:
            adamw_rounded_(shard, state, g.view(-1), coefficients, None, betas)
        assert all(torch.equal(a, b) for a, b in zip(state, mine))
        assert torch.equal(shard, p.detach().view(-1)) and p.grad is None
    if layout is not FP32_STATES:
        # a first step reads zero moments; the second reads the stored ones,
        # narrower than fp32, which move the master by about lr x 2^-9 of a
        # rounding, hundreds of its ulps (not always its bf16 shard)
        masters = {}
        for kept in (layout, FP32_STATES):
            params, floor, grads = floor_states(kept)
            for _ in range(2):
                for p, g in zip(params, grads):
                    p.grad = g
                floor.step()
            masters[kept.name] = [state[0] for state in floor.states]
        assert not all(torch.equal(a, b) for a, b in zip(*masters.values()))


def test_the_floor_line_counts_the_layout_and_skips_no_master():
    cpu = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    tiny = shrink(all_workloads()["W2-1"])
    torch.manual_seed(0)
    built = bounds.build_bound("update_floor", cpu,
                               replace(tiny, optimizer_states="bf16-moments"))
    k = BF16_MOMENTS.bytes_per_element()
    assert f"K = {k:g} (bf16-moments states)" in built.memory_formula
    assert built.memory_model["zero_states"] == zero_model_states(
        built.psi_trainable, built.psi_frozen, 1, param_bytes=2, grad_bytes=2,
        optimizer_bytes=k)
    for name, layout in LAYOUTS.items():
        reason = bounds.unavailable("update_floor",
                                    replace(tiny, optimizer_states=name))
        assert (reason is None) == (layout.master is not None)
        # the model alone has no optimizer to skip
        assert bounds.unavailable("model_only",
                                  replace(tiny, optimizer_states=name)) is None
    with pytest.raises(ValueError, match="no master"):
        bounds.FloorUpdate([torch.nn.Parameter(torch.zeros(4).bfloat16())],
                           lr=1e-3, weight_decay=0.0, states=LAYOUTS["bf16-kahan"])


def test_the_plan_is_made_with_the_layout_given(capsys, nothing_starts):
    """`--plan --optimizer-states fp32,bf16-moments`: one plan per layout,
    each for the layout named (the planner never chooses it); with every
    knob pinned, the two budgets differ by $K$'s 4 bytes an element."""
    bench_run.main(["--workloads", "W2-1", "--gpu", "h200", "--world-size", "1",
                    "--optimizer-states", "fp32,bf16-moments", "--plan"])
    out = capsys.readouterr().out
    assert "plan: W2-1 (labml_zero)" in out
    assert "plan: W2-1 (labml_zero, bf16-moments states)" in out
    w21 = all_workloads()["W2-1"]
    cluster = Cluster(GPUS["h200"], gpus_per_node=1)
    pinned = Pinned(batch=2, micro_batches=1, checkpointing=True,
                    offload_fraction=0.0, prefetch_depth=1, compile=False)
    plans = {name: plan_workload(replace(w21, optimizer_states=name), cluster,
                                 pinned, kernels="auto")
             for name in ("fp32", "bf16-moments")}
    assert {n: p.job.states for n, p in plans.items()} == {
        "fp32": "fp32", "bf16-moments": "bf16-moments"}
    fp32, bf16 = (plans[n].best.budget for n in ("fp32", "bf16-moments"))
    trainable = fp32.optimizer_device / FP32_STATES.bytes_per_element()
    assert fp32.optimizer_device - bf16.optimizer_device == 4 * trainable
    assert fp32.peak - bf16.peak == 4 * trainable
