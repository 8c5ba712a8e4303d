"""The benchmark: a tiny run of every engine on CPU, and the arithmetic it reports."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from bench import pair as bench_pair
from bench import run as bench_run
from bench.baselines import EngineUnavailable
from bench.measure import (
    after_arrival, classify, length, nccl_kernels, peer_copies, subtract, union,
)
from labml_zero.neox.activation_memory import activation_bytes
from bench.workloads import Workload, flops_per_token, mfu, shrink
from labml_zero.neox.family import matmul_parameters
from bench.workloads import workloads as all_workloads
from labml_zero.launch import DistContext
from labml_zero.neox.kernels import ModelKernels
from labml_zero.optimizers.early_update import EARLY_UPDATES_IN_FLIGHT
from labml_zero.planner.memory_model import zero_model_states


@pytest.mark.distributed
def test_tiny_run_of_each_engine(tmp_path):
    """
    `python -m bench.run --tiny` on two gloo processes: one JSON line per engine,
    a finite loss near ln(512), tokens per second, a communication share, and
    ours beside its memory model. W3 (bias-only) exercises frozen and trainable
    parameters together in every engine.
    """
    out, traces = tmp_path / "results.jsonl", tmp_path / "traces"
    lines = bench_run.main([
        "--tiny", "--cpu", "--workloads", "W3", "--engines", "labml_zero,fsdp2,ddp",
        "--steps", "2", "--warmup", "1", "--out", str(out),
        "--trace-dir", str(traces),
    ])
    written = [json.loads(text) for text in out.read_text().splitlines()]
    assert written == lines
    assert [line["engine"] for line in lines] == ["labml_zero", "fsdp2", "ddp"]
    for line in lines:
        assert line["status"] == "ok", line
        assert line["world_size"] == 2 and line["backend"] == "gloo"
        assert line["loss_finite"] and abs(line["loss"] - math.log(512)) < 1.0
        assert line["tokens_per_s"] > 0 and line["step_time_mean_s"] > 0
        assert line["mfu"] is None  # a CPU has no data-sheet peak
        assert 0 <= line["comm_exposed"] <= line["comm_total"] <= 1
        # bias-only: 2 layers x (3d + d + 4d) biases of width 64
        assert line["psi_trainable"] == 2 * 8 * 64
        assert line["peak_mem_gib"] is None  # no CUDA allocator on CPU
        assert "sm_clock_mhz_mean" not in line  # no GPU clock to sample

    for engine in ("labml_zero", "fsdp2", "ddp"):
        trace = json.loads((traces / f"trace_W3_{engine}_b2.json").read_text())
        assert any(e["name"].startswith("gloo:") for e in trace["traceEvents"])

    ours = lines[0]
    psi_t, psi_f = ours["psi_trainable"], ours["psi_frozen"]
    expected = zero_model_states(psi_t, psi_f, 2, param_bytes=2, grad_bytes=4,
                                 optimizer_bytes=12)
    assert ours["memory_model_gib"]["zero_states"] == expected / 2**30
    # Padding only adds to the formula.
    assert ours["memory_model_gib"]["layout_states"] >= expected / 2**30
    # the predicted peak: states, gathered chunks and the activation page's count
    tiny = shrink(all_workloads()["W3"])
    model = ours["memory_model_gib"]
    activations = activation_bytes(tiny.model, batch=tiny.batch, seq=tiny.seq,
                                   finetune="biases").total
    assert model["activations"] == activations / 2**30
    assert model["predicted_peak"] == pytest.approx(
        model["layout_states"] - model["shard_grads"] + model["gathered_peak"]
        + max(model["activations"],
              model["activations_beside_grads"] + model["early_update_grads"]))
    # Q fp32 gradient shards (two ranks) wait for their early update
    early = model["early_update_grads"] * 2**30
    assert early > 0 and early % (4 * EARLY_UPDATES_IN_FLIGHT) == 0
    # 4 bytes per trainable element of this rank's shards, padding included
    assert model["shard_grads"] >= 4 * psi_t / 2 / 2**30
    # Forward gathers every chunk in bf16, backward gathers again all but the
    # frozen embedding (nothing below it needs a gradient); the trainable chunks
    # are reduced in fp32.
    comm = ours["comm_bytes_per_step"]
    assert comm["all_gather"] > 2 * (psi_t + psi_f)
    assert comm["reduce_scatter"] >= 4 * psi_t


def test_deepspeed_is_skipped_when_missing(monkeypatch):
    """No process is started for an engine whose module cannot be found."""
    monkeypatch.setattr(bench_pair.importlib.util, "find_spec", lambda name: None)
    line = bench_pair.run_pair(
        "deepspeed", shrink(all_workloads()["W4"]), bench_run.RunConfig(),
        world_size=2, backend="gloo", timeout_s=10,
    )
    assert line["status"] == "skipped" and "deepspeed" in line["reason"]


def cpu_context() -> DistContext:
    return DistContext(0, 1, 0, torch.device("cpu"), "gloo")


def test_out_of_memory_is_reported_and_ends_the_process(monkeypatch, tmp_path):
    """The rank writes an `oom` record and leaves at once (os._exit), mid-build."""

    def build_too_big(ctx, workload):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")

    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(bench_pair, "builder", lambda engine: build_too_big)
    monkeypatch.setattr(os, "_exit", fake_exit)
    workload = shrink(all_workloads()["W4"])
    with pytest.raises(SystemExit) as exited:
        bench_pair.worker(cpu_context(), "ddp", workload, bench_pair.RunConfig(),
                         str(tmp_path))
    assert exited.value.code == 1
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["status"] == "oom" and record["phase"] == "build"
    assert "OutOfMemoryError" in record["error"]

    line = bench_pair.merge({"engine": "ddp"}, [record], workload, 2,
                           bench_run.RunConfig())
    assert line["status"] == "oom" and line["engine"] == "ddp"


def test_unavailable_engine_is_skipped_by_the_worker(monkeypatch, tmp_path):
    def unavailable(ctx, workload):
        raise EngineUnavailable("import deepspeed failed: ImportError('x')")

    monkeypatch.setattr(bench_pair, "builder", lambda engine: unavailable)
    bench_pair.worker(cpu_context(), "deepspeed", shrink(all_workloads()["W4"]),
                     bench_run.RunConfig(), str(tmp_path))
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record == {"status": "skipped",
                      "reason": "import deepspeed failed: ImportError('x')"}


def test_mfu_is_on_the_data_sheet_peak():
    """W2 at 19.2k tok/s over 2 H200s: F tokens/s per GPU over 989.4 TFLOP/s
    (the anchor's 52% was on a measured 790 TFLOP/s; 0.52 * 790 / 989.4)."""
    w2 = all_workloads()["W2"]
    expected = flops_per_token(w2) * 19.2e3 / 2 / 989.4e12
    assert mfu(w2, 19.2e3, 2, "NVIDIA H200") == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.52 * 790 / 989.4, abs=0.004)
    assert mfu(w2, 19.2e3, 2, "cpu") is None
    assert mfu(w2, 19.2e3, 2, "NVIDIA Some Future GPU") is None
    # Pythia-6.9B: 32 layers of 12 d^2 plus the 4096 x 50432 readout.
    assert matmul_parameters(w2.model) == 32 * 12 * 4096**2 + 4096 * 50432


def test_bias_only_skips_the_weight_gradients():
    w3 = all_workloads()["W3"]
    n = matmul_parameters(w3.model)
    attention = 12 * 44 * 128 * 6144
    assert flops_per_token(w3) == 4 * n + attention


def test_workload_checks_its_fields():
    w4 = all_workloads()["W4"]
    with pytest.raises(ValueError, match="finetune must be one of"):
        Workload("W9", w4.model, batch=1, seq=8, finetune="lora")
    with pytest.raises(ValueError, match="exceeds the model's max_position"):
        Workload("W9", w4.model, batch=1, seq=4096)
    with pytest.raises(ValueError, match="prefetch_depth must be >= 0"):
        Workload("W9", w4.model, batch=1, seq=8, prefetch_depth=-1)
    tiny = shrink(all_workloads()["W3"])
    assert tiny.finetune == "biases" and tiny.model.gelu_approximate == "tanh"


def test_interval_arithmetic():
    comm = union([(0, 10), (5, 12), (20, 30)])
    assert comm == [(0, 12), (20, 30)]
    compute = union([(2, 4), (11, 22), (25, 26)])
    # comm \ compute: [0,2) [4,11) [22,25) [26,30)
    assert subtract(comm, compute) == [(0, 2), (4, 11), (22, 25), (26, 30)]
    assert length(subtract(comm, compute)) == 2 + 7 + 3 + 4
    assert subtract(comm, []) == comm and subtract([], compute) == []


def test_gpu_trace_classification():
    """NCCL kernels are communication; other kernels, copies and memsets compute."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL",
         "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 5, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 20, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0,
         "dur": 40},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},
    ]
    comm, compute = classify(events, on_gpu=True)
    assert comm == [(0.0, 10.0)]
    assert sorted(compute) == [(5.0, 15.0), (20.0, 21.0)]
    assert length(subtract(union(comm), union(compute))) == 5.0


def test_waiting_for_a_late_peer_is_told_apart_from_transfer():
    """Rank 0 starts its all-gather at 0, rank 1 only at 6: rank 0's kernel spins
    for 6 µs, then both move data until 10. Cut at the later start, rank 0's
    exposed transfer is [6, 10) minus its compute."""
    def gather(ts, dur):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur,
                "name": "ncclDevKernel_AllGather_RING_LL"}
    rank0 = [gather(0, 10), gather(30, 2)]
    rank1 = [gather(6, 4), gather(29, 3)]
    mine, theirs = nccl_kernels(rank0), nccl_kernels(rank1)
    starts = [{n: [a for a, _ in v] for n, v in k.items()} for k in (mine, theirs)]
    assert after_arrival(mine, starts) == [(6.0, 10.0), (30.0, 32.0)]
    compute = [(8.0, 9.0)]
    assert length(subtract(union(after_arrival(mine, starts)), compute)) == 5.0
    # ranks that ran different collectives: no answer rather than a wrong one
    assert after_arrival(mine, [starts[0], {}]) is None


@pytest.mark.distributed
def test_prefetch_depth_reaches_the_engine(tmp_path):
    """`--prefetch-depth 2`: the line says so, and the gathered peak of the memory
    model covers three units instead of two."""
    lines = {
        depth: bench_run.main([
            "--tiny", "--cpu", "--workloads", "W4", "--engines", "labml_zero",
            "--steps", "1", "--warmup", "0", "--no-profile",
            "--prefetch-depth", str(depth)])[0]
        for depth in (1, 2)
    }
    for depth, line in lines.items():
        assert line["status"] == "ok" and line["prefetch_depth"] == depth
    with pytest.raises(SystemExit, match="--prefetch-depth must be >= 0"):
        bench_run.main(["--tiny", "--cpu", "--prefetch-depth", "-1"])
    gathered = {d: line["memory_model_gib"]["gathered_peak"]
                for d, line in lines.items()}
    assert gathered[2] > gathered[1]


def test_peer_gather_trace_classification():
    """With `--peer-gather`, copies from the other GPU and the symmetric-memory
    barriers are communication; a copy inside one GPU stays computation. Copies
    from a peer count as transfer whole: they start after their barrier."""
    events = [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 4,
         "name": "void c10d::symmetric_memory::barrier_kernel<...>"},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)",
         "ts": 4, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)",
         "ts": 14, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 8, "dur": 10},
    ]
    comm, compute = classify(events, on_gpu=True)
    assert sorted(comm) == [(0.0, 4.0), (4.0, 14.0)]
    assert sorted(compute) == [(8.0, 18.0), (14.0, 15.0)]
    assert peer_copies(events) == [(4.0, 14.0)]
    # exposed: [0, 8); of it transfer (the copy only): [4, 8)
    assert length(subtract(union(comm), union(compute))) == 8.0
    assert length(subtract(union(peer_copies(events)), union(compute))) == 4.0


@pytest.mark.distributed
def test_peer_gather_reaches_the_engine_and_trains_the_same():
    """`--peer-gather --peer-reduce`: the line says so, and the loss is the same as
    with gloo's all-gather (the gather copies bytes; the sums are unchanged)."""
    lines = {
        flag: bench_run.main([
            "--tiny", "--cpu", "--workloads", "W4", "--engines", "labml_zero",
            "--steps", "2", "--warmup", "0", "--no-profile", *flag])[0]
        for flag in ((), ("--peer-gather", "--peer-reduce"))
    }
    plain, peer = lines[()], lines[("--peer-gather", "--peer-reduce")]
    assert plain["status"] == peer["status"] == "ok"
    assert (plain["peer_gather"], peer["peer_gather"]) == (False, True)
    assert (plain["peer_reduce"], peer["peer_reduce"]) == (False, True)
    assert peer["loss"] == plain["loss"]


@pytest.mark.distributed
def test_kernels_reach_every_engine_and_the_line(tmp_path):
    """`--kernels loss,rotary`: the same losses as the plain model (fp32 on the
    CPU, within a few ulps), the line names the kernels, and the host's side
    of the step is there; a bad name stops before any process starts."""
    args = ["--tiny", "--cpu", "--workloads", "W4", "--engines", "labml_zero,ddp",
            "--steps", "2", "--warmup", "1", "--no-profile"]
    plain = bench_run.main(args)
    fused = bench_run.main(args + ["--kernels", "loss,rotary"])
    for a, b in zip(plain, fused):
        assert a["status"] == b["status"] == "ok"
        assert a["kernels"] == "none" and b["kernels"] == "loss,rotary"
        # fp32 sums in another order, through three Adam steps whose update
        # divides by sqrt(v): allow 2^10 units in the last place
        assert abs(a["loss"] - b["loss"]) <= 2**10 * 2**-23 * abs(a["loss"])
        assert len(b["host_s"]) == len(b["step_times_s"]) == 2
        assert b["gc_collections"] >= 0 and b["host_s_mean"] > 0
    # ours predicts its peak for the kernels it ran: the chunked loss holds no
    # logits
    tiny = shrink(all_workloads()["W4"])
    for line, names in ((plain[0], ""), (fused[0], "loss,rotary")):
        expected = activation_bytes(
            tiny.model, batch=tiny.batch, seq=tiny.seq, finetune=tiny.finetune,
            kernels=ModelKernels.from_names(names)).total
        assert line["memory_model_gib"]["activations"] == expected / 2**30
    assert (fused[0]["memory_model_gib"]["predicted_peak"]
            < plain[0]["memory_model_gib"]["predicted_peak"])
    with pytest.raises(SystemExit, match="unknown kernel.*bogus"):
        bench_run.main(["--tiny", "--cpu", "--kernels", "bogus"])
    with pytest.raises(SystemExit, match="attention"):
        bench_run.main(["--tiny", "--cpu", "--attention", "fastest"])


@pytest.mark.distributed
def test_cuda_graph_reaches_labml_zero_and_recomputation_is_refused():
    """`--cuda-graph`: labml_zero's line says so and trains as the eager one (on
    CPU the graph's twin re-runs the step); a workload that recomputes its
    activations and too few warm-up steps are refused before anything starts."""
    common = ["--tiny", "--cpu", "--workloads", "W4", "--engines", "labml_zero",
              "--steps", "1", "--no-profile"]
    eager, graphed = (bench_run.main(common + ["--warmup", "3"] + extra)[0]
                      for extra in ([], ["--cuda-graph"]))
    assert graphed["status"] == "ok" and graphed["cuda_graph"]
    assert not eager["cuda_graph"]
    # The same fp32 kernels on the same machine: a few units in the last place of
    # the fourth step's loss at most, where a wrong update moves it by far more.
    assert graphed["loss"] == pytest.approx(eager["loss"], rel=8 * 2.0 ** -23)
    with pytest.raises(SystemExit, match="workload W2-1 recomputes"):
        bench_run.main(["--tiny", "--cpu", "--workloads", "W4,W2-1",
                        "--cuda-graph", "--warmup", "3"])
    with pytest.raises(SystemExit, match="--cuda-graph needs --warmup >= 3"):
        bench_run.main(common + ["--cuda-graph", "--warmup", "2"])


@pytest.mark.distributed
def test_layers_sets_every_workloads_depth():
    """`--layers N`: the model runs with N layers, its line and its memory
    model say so, and the activations grow with the depth."""
    lines = {
        n: bench_run.main([
            "--tiny", "--cpu", "--workloads", "W2-1", "--engines", "labml_zero",
            "--steps", "1", "--warmup", "0", "--no-profile", "--layers", str(n)])[0]
        for n in (1, 3)
    }
    for n, line in lines.items():
        assert line["status"] == "ok" and line["model"]["n_layers"] == n
    assert (lines[3]["memory_model_gib"]["activations"]
            > lines[1]["memory_model_gib"]["activations"])
    with pytest.raises(SystemExit, match="--layers must be >= 1"):
        bench_run.main(["--tiny", "--cpu", "--layers", "0"])
