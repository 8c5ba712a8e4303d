"""`bench/plan.py`: `bench.run --plan` prints the planner's setting and starts
nothing; `--auto` runs labml_zero's line with it and records the prediction;
flags given win; what the bench cannot run is refused in one line."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from bench import run as bench_run
from bench.pair import RunConfig
from bench.workloads import shrink
from bench.workloads import workloads as all_workloads
from labml_zero import launch
from labml_zero.planner.setting import Setting
from tests.tolerance import sum_error

TINY_AUTO = ["--auto", "--tiny", "--cpu", "--gpu", "h200", "--steps", "1",
             "--warmup", "1", "--no-profile"]


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a pair or a process started")
    monkeypatch.setattr(launch, "spawn", refuse)
    monkeypatch.setattr(bench_run, "run_pair", refuse)


@pytest.fixture
def ran(monkeypatch):
    """The workloads handed to `run_pair`, by engine and name; they still run."""
    seen = {}
    real = bench_run.run_pair

    def spy(engine, workload, *args, **kwargs):
        seen[engine, workload.name] = workload
        return real(engine, workload, *args, **kwargs)
    monkeypatch.setattr(bench_run, "run_pair", spy)
    return seen


def test_plan_prints_w1_and_l1_and_starts_nothing(capsys, nothing_starts):
    assert bench_run.main(["--workloads", "W1,L1", "--gpu", "h200", "--plan"]) == []
    out = capsys.readouterr().out
    plans = out.split("plan: ")[1:]
    assert [p.split(" ")[0] for p in plans] == ["W1", "L1"]
    for text, fusions in zip(plans, ("loss,rotary,norms,bias_gelu",
                                     "rms_norm,swiglu,rotary,loss")):
        # the workload's 8 sequences a GPU, one micro-batch (no accumulation),
        # and the job's `auto` kernels of each family
        assert "8 sequences of 2048 tokens a step, on 1 x h200" in text
        assert "setting: --batch-size 8 --grad-accum 1 " in text
        assert f"(kernels {fusions})" in text
        for part in ("device memory a rank: peak", "host memory a rank",
                     "step time:", "tokens/s, MFU"):
            assert part in text, text


def test_plan_keeps_the_flags_given(capsys, nothing_starts):
    bench_run.main(["--workloads", "W1", "--gpu", "h200", "--gpus", "2",
                    "--batch", "4", "--prefetch-depth", "2", "--compile", "no",
                    "--kernels", "none", "--plan"])
    out = capsys.readouterr().out
    assert "8 sequences of 2048 tokens a step, on 2 x h200" in out
    setting = out.splitlines()[1]
    assert setting.startswith("setting: --batch-size 4 --grad-accum 1 ")
    assert "--prefetch-depth 2" in setting and "--compile" not in setting
    assert "(kernels none)" in setting


def test_recompute_is_a_pin_of_the_plan_and_a_knob_of_the_run(capsys, nothing_starts):
    """`--recompute yes` pins the planner's recomputation (W1 fits without,
    so it would not choose it), and without --plan/--auto sets the workload's."""
    for given in ("yes", "no"):
        bench_run.main(["--workloads", "W1", "--gpu", "h100", "--plan",
                        "--recompute", given])
        setting = capsys.readouterr().out.splitlines()[1]
        assert ("--activation-checkpointing" in setting) == (given == "yes"), setting
    args = bench_run.parse_args(["--workloads", "W1,W2-1", "--recompute", "no",
                                 "--cuda-graph", "--warmup", "3"])
    assert args.recompute == "no"  # W2-1 recomputes unless told: graphable now
    with pytest.raises(SystemExit, match="W1 recomputes"):
        bench_run.parse_args(["--workloads", "W1", "--recompute", "yes",
                              "--cuda-graph", "--warmup", "3"])


def settings_run(workload) -> str:
    """The workload's knobs as the fine-tune's flags, as the plan prints them."""
    return Setting(workload.batch, 1,
                   checkpointing=workload.activation_checkpointing,
                   offload_fraction=workload.offload or 0.0,
                   prefetch_depth=workload.prefetch_depth,
                   compile=workload.compile).flags()


@pytest.mark.distributed
def test_auto_runs_the_planned_setting_and_peers_as_given(capsys, ran):
    # W2-1 recomputes as given; on an H200 its tiny copy needs no recomputation
    lines = bench_run.main([*TINY_AUTO, "--workloads", "W4,W2-1",
                            "--engines", "labml_zero,ddp", "--world-size", "1"])
    out = capsys.readouterr().out
    printed = dict(re.findall(r"^(\S+): --auto: (.*?) \(predicted", out, re.M))
    assert list(printed) == ["W4", "W2-1"]
    by = {(line["engine"], line["workload"]): line for line in lines}
    for name in ("W4", "W2-1"):
        ours, peer = by["labml_zero", name], by["ddp", name]
        assert ours["status"] == "ok" and peer["status"] == "ok", (ours, peer)
        assert ours["auto"] is True and "auto" not in peer
        workload = ran["labml_zero", name]
        # the workload run is the one printed and recorded
        assert settings_run(workload) == printed[name] == ours["planned_flags"]
        chosen = ours["planned_setting"]
        assert (chosen["batch"], chosen["micro_batches"]) == (2, 1)
        assert (ours["batch_per_gpu"], ours["compiled"], ours["prefetch_depth"],
                ours["activation_checkpointing"], ours["offload"] or 0.0) == (
            chosen["batch"], chosen["compile"], chosen["prefetch_depth"],
            chosen["activation_checkpointing"], chosen["offload_fraction"])
        assert workload.chunk_numel == 8192  # --tiny's fixed chunk stays
        assert ours["planned_peak_gib"] > 0 and ours["planned_step_s"] > 0
        assert ours["planned_tokens_per_s"] == pytest.approx(
            chosen["batch"] * 32 / ours["planned_step_s"],
            rel=sum_error(torch.float64, 2))
        assert ours["planned_for"].startswith("1 x h200")
        # the table's predicted peak is the planner's, which the line ran on
        row = bench_run.table([ours]).splitlines()[-1]
        assert row.split("|")[8].strip() == f"{ours['planned_peak_gib']:.1f}"
    # the peer runs W2-1 as given, recomputing; ours without
    assert by["ddp", "W2-1"]["activation_checkpointing"] is True
    assert by["labml_zero", "W2-1"]["activation_checkpointing"] is False


@pytest.mark.distributed
def test_auto_keeps_the_flags_given(capsys, ran):
    [line] = bench_run.main([*TINY_AUTO, "--workloads", "W4",
                             "--engines", "labml_zero", "--prefetch-depth", "2"])
    out = capsys.readouterr().out
    assert "kept as given: --prefetch-depth" in out
    assert line["status"] == "ok", line
    assert line["prefetch_depth"] == line["planned_setting"]["prefetch_depth"] == 2
    assert ran["labml_zero", "W4"].prefetch_depth == 2


@pytest.mark.parametrize("argv, says", [
    (["--workloads", "W1", "--gpu", "h200", "--plan", "--auto"],
     "give --plan or --auto, not both"),
    (["--workloads", "W1", "--gpu", "h200", "--global-batch", "16", "--plan"],
     "give --batch, not --global-batch"),
    (["--workloads", "W1", "--gpu", "h200"], "--gpu needs --plan or --auto"),
    (["--workloads", "W1", "--gpu", "h200", "--engines", "ddp", "--auto"],
     "add labml_zero to --engines"),
    (["--workloads", "W3R", "--gpu", "h200", "--plan"],
     "workload W3R: the planner does not model resident frozen chunks"),
    (["--workloads", "W6", "--gpu", "h100", "--gpus", "1", "--host-gib", "64",
      "--plan"], "workload W6: nothing fits"),
    # the planner compiles W1, whose first step would then be timed
    (["--workloads", "W1", "--gpu", "h200", "--cpu", "--auto", "--warmup", "0"],
     "needs --warmup >= 1 (or pin --compile no)"),
    # the plan's ranks are the run's
    (["--workloads", "W4", "--tiny", "--gpu", "h200", "--cpu", "--gpus", "4",
      "--auto"], "--auto runs 2 ranks here"),
])
def test_refusals_are_one_line_before_any_start(nothing_starts, argv, says):
    with pytest.raises(SystemExit) as refused:
        bench_run.main(argv)
    message = str(refused.value)
    assert says in message and "\n" not in message, message


def test_the_command_exits_2_with_one_line(nothing_starts, capsys):
    """`python -m bench.run`'s refusals exit 2, as argparse's do, one line."""
    with pytest.raises(SystemExit) as refused:
        bench_run.command(["--workloads", "W1", "--gpu", "h200"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err == "bench.run: error: --gpu needs --plan or --auto\n", err


def test_a_plan_takes_a_graph_on_a_recomputing_workload(nothing_starts, capsys):
    """The planner pins recomputation off for a recorded step, under --plan as
    under --auto: the plan is printed, not refused for the workload's own
    recomputation."""
    bench_run.main(["--plan", "--gpu", "h200", "--gpus", "1", "--workloads",
                    "W2-1", "--cuda-graph", "--warmup", "3", "--engines",
                    "labml_zero"])
    assert "W2-1" in capsys.readouterr().out


def test_workload_takes_an_offload_fraction():
    w4 = shrink(all_workloads()["W4"])
    assert replace(w4, offload=0.25).offload == 0.25
    for wrong in (0.0, 1.5, "yes"):
        with pytest.raises(ValueError, match="a fraction in \\(0, 1\\]"):
            replace(w4, offload=wrong)


@pytest.mark.distributed
def test_a_planned_offload_fraction_runs_on_labml_zero():
    """`--auto`'s fraction: static, no probe (which needs the automatic one)."""
    workload = replace(shrink(all_workloads()["W4"]), offload=0.5)
    line = bench_run.run_pair("labml_zero", workload,
                              RunConfig(steps=1, warmup=1, profile=False),
                              world_size=2, backend="gloo", timeout_s=120)
    assert line["status"] == "ok" and line["loss_finite"], line
    assert line["offload"] == 0.5 and "offloaded_fraction" not in line.get("info", {})
