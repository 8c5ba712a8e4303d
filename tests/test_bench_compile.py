"""`--compile`: compiled transformer layers train like eager ones, compiled once.

On CPU the backend is `aot_eager` (see the engine page, Compiled layers): dynamo's
tracing and guards and AOT autograd's forward/backward split all run, Inductor's
code generation does not.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench import baselines, engine
from bench import run as bench_run
from bench.workloads import Workload, shrink, workloads
from labml_zero.launch import DistContext
from tests.distributed import run_distributed

STEPS = 3


def three_layers(name: str = "W4") -> Workload:
    """A tiny workload with three transformer layers: enough to see one graph
    shared."""
    tiny = shrink(workloads()[name])
    return replace(tiny, model=replace(tiny.model, n_layers=3))


def train(ctx: DistContext, build, workload: Workload) -> dict:
    """`STEPS` steps of one engine; its losses and what dynamo counted meanwhile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)  # the same initial weights for eager and compiled
    built = build(ctx, workload)
    batches = engine.random_batches(workload, ctx, count=STEPS, seed=0)
    losses = [built.step(batch).item() for batch in batches]
    return {"losses": losses,
            "counters": {kind: dict(counts) for kind, counts in counters.items()}}


def eager_and_compiled(ctx: DistContext) -> dict:
    """Each case trained eagerly and compiled, on this rank."""
    workload = three_layers()
    cases = {
        "labml_zero": (engine.build_labml_zero, workload),
        # the compiled forward runs again inside the recomputation in backward
        "labml_zero_recompute": (
            engine.build_labml_zero, replace(workload, activation_checkpointing=True)
        ),
        # Llama (L2 recomputes): its rotary entry made before the compiled
        # forward, or the recomputation traces another graph than the forward
        "labml_zero_llama_recompute": (engine.build_labml_zero,
                                       three_layers("L2")),
        "fsdp2": (baselines.build_fsdp2, workload),
        "ddp": (baselines.build_ddp, workload),
    }
    return {
        name: {
            "eager": train(ctx, build, w),
            "compiled": train(ctx, build, replace(w, compile=True)),
        }
        for name, (build, w) in cases.items()
    }


@pytest.mark.distributed
def test_compiled_layers_train_like_eager_and_compile_once():
    """
    Two gloo ranks, 3 layers, 3 steps. For our engine (with and without
    recomputation, GPT-NeoX and Llama), FSDP2 and DDP, the compiled layers give the losses of the eager
    ones, and dynamo makes **one** graph and one AOT forward/backward pair for
    all 3 layers and 3 steps: no compilation per layer (the parameters are
    inputs of the graph, not constants), none per step (the storage of our
    parameters is freed and regrown between calls, which dynamo does not
    guard on), and no graph break.
    """
    for rank in run_distributed(eager_and_compiled, 2):
        for name, case in rank.items():
            eager, compiled = case["eager"], case["compiled"]
            assert eager["counters"] == {}, name  # nothing compiled eagerly
            # aot_eager runs the same aten ops: equal up to summation order
            torch.testing.assert_close(compiled["losses"], eager["losses"],
                                       rtol=1e-5, atol=1e-5)
            counts = compiled["counters"]
            assert counts["stats"]["unique_graphs"] == 1, (name, counts)
            assert counts["aot_autograd"]["total"] == 1, (name, counts)
            assert not counts.get("graph_break"), (name, counts["graph_break"])
        # ours compiles the layer's forward only: one frame, no hook traced
        assert rank["labml_zero"]["compiled"]["counters"]["frames"]["total"] == 1


@pytest.mark.distributed
def test_compile_flag_runs_and_is_recorded(tmp_path):
    """
    `--compile` reaches the builders and every JSON line; DeepSpeed, without a
    compiled variant, is skipped without spawning.
    """
    out = tmp_path / "results.jsonl"
    lines = bench_run.main([
        "--tiny", "--cpu", "--compile", "--workloads", "W4",
        "--engines", "labml_zero,ddp,deepspeed", "--steps", "1", "--warmup", "1",
        "--no-profile", "--out", str(out),
    ])
    ours, ddp, deepspeed = lines
    for ran in (ours, ddp):
        assert ran["status"] == "ok" and ran["compiled"] is True, ran
        assert ran["loss_finite"]
    assert deepspeed["status"] == "skipped" and deepspeed["compiled"] is True
    assert "--compile" in deepspeed["reason"]
    assert bench_run.parse_args([]).compile is False


def test_eager_lines_say_so():
    line = bench_run.describe("labml_zero", shrink(workloads()["W4"]), 2, "gloo")
    assert line["compiled"] is False


def test_compile_needs_a_warmup_step():
    """The first step compiles; timing it would count the compilation."""
    with pytest.raises(SystemExit, match="--warmup"):
        bench_run.parse_args(["--compile", "--warmup", "0"])


def test_peer_layers_compiled_with_their_rotary_entry_made():
    """`module.compile()` traces the pre-hook too, so the peers' builders make
    the tables' entry before compiling: the compiled call then reads it."""
    from labml_zero.neox.model import TransformerLayer, build_layers

    workload = three_layers()
    layers = build_layers(workload.model)
    baselines.compile_calls(layers, workload, torch.device("cpu"))
    transformer = [m for m in layers if isinstance(m, TransformerLayer)]
    assert len(transformer) == 3
    tables = transformer[0].attention.rotary_tables
    assert all(m.attention.rotary_tables is tables for m in transformer)
    assert tables.keys() == [(workload.seq, torch.device("cpu"), torch.bfloat16)]


def test_compile_both_runs_each_engine_eager_then_compiled(monkeypatch):
    """`--compile both`: every engine's two settings side by side, each line
    saying which, so that each peer's best is measured in the same run."""
    ran = []

    def run_pair(engine, workload, run, **kwargs):
        ran.append((engine, workload.compile))
        return {"status": "skipped", "workload": workload.name, "engine": engine,
                "compiled": workload.compile, "reason": "recorded only"}

    monkeypatch.setattr(bench_run, "run_pair", run_pair)
    lines = bench_run.main(["--tiny", "--cpu", "--compile", "both", "--workloads",
                            "W4", "--engines", "labml_zero,fsdp2,ddp"])
    assert ran == [("labml_zero", False), ("labml_zero", True), ("fsdp2", False),
                   ("fsdp2", True), ("ddp", False), ("ddp", True)]
    assert [line["compiled"] for line in lines] == [False, True] * 3
    assert bench_run.parse_args(["--compile"]).compile_modes == [True]
    assert bench_run.parse_args(["--compile", "both"]).compile is True
