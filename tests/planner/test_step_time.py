"""`labml_zero/planner/step_time.py`: the roofline's constants are the
benchmark's measured lines, solved again here, and the model reproduces the
engine's whole measured steps on one H200."""

import json
from pathlib import Path

import numpy as np
import pytest

from bench.workloads import workloads
from labml_zero.neox.family import NEOX
from labml_zero.neox.kernels import ModelKernels
from labml_zero.planner.devices import GPUS, Cluster
from labml_zero.planner.setting import Job, Setting, budget_of
from labml_zero.planner.step_time import (COMPILED_ELEMENTWISE, ELEMENTWISE_BYTES,
                                          HOST_UPDATE_RATE, MATMUL_EFFICIENCY,
                                          UPDATE_BANDWIDTH_SHARE,
                                          hardware_flops_per_token,
                                          matmul_params, model_flops_per_token,
                                          step_time)

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
BOUNDS = RESULTS / "2026-12-04-run49-1xH200-W2-1-W1-bounds.jsonl"
TABLE = RESULTS / "2026-12-04-run50-1xH200-table.jsonl"
COMPILED_PAIR = RESULTS / "2026-12-04-run51-1xH200-job-vs-bench-W1.jsonl"
H200 = GPUS["h200"]
# A constant is the fit's solution rounded to about three figures.
ROUNDING = 0.01
# The whole step's prediction against the measurement, as issue 49 asks.
STEP_TOLERANCE = 0.10


def lines(path: Path, engine: str) -> list[dict]:
    found = [json.loads(line) for line in path.read_text().splitlines()]
    return [d for d in found if d["engine"] == engine and d["status"] == "ok"]


def job_setting(line: dict) -> tuple[Job, Setting]:
    workload = workloads()[line["workload"]]
    job = Job(workload.model, family=NEOX, seq=line["seq"],
              global_batch=line["batch_per_gpu"],
              finetune=line["finetune"],
              kernels=ModelKernels.from_names(line["kernels"]))
    offloaded = line.get("info", {}).get("offloaded_fraction", 0.0)
    return job, Setting(line["batch_per_gpu"], 1,
                        checkpointing=workload.activation_checkpointing,
                        offload_fraction=offloaded, compile=line["compiled"])


def predicted(line: dict) -> float:
    job, setting = job_setting(line)
    b = budget_of(job, setting, world_size=1, device_bytes=H200.memory_bytes)
    return step_time(job, setting, Cluster(H200), b).total


def test_flops_are_palm_count_and_the_hardwares():
    model = workloads()["W1"].model
    n, L, d, T = matmul_params(NEOX, model), model.n_layers, model.d_model, 2048
    assert n == L * (4 * d * d + 2 * d * model.ff_dim) + d * model.n_vocab
    assert model_flops_per_token(NEOX, model, T) == 6 * n + 12 * L * T * d
    assert hardware_flops_per_token(NEOX, model, T, finetune="all",
                                    checkpointing=False) == 6 * n + 12 * L * T * d
    # recomputation: one more forward; frozen matrices: no weight gradients
    assert hardware_flops_per_token(NEOX, model, T, finetune="all",
                                    checkpointing=True) == 8 * n + 16 * L * T * d
    assert hardware_flops_per_token(NEOX, model, T, finetune="biases",
                                    checkpointing=False) == 4 * n + 12 * L * T * d
    # the ffn tuner's weight gradients: the MLP's two products
    mlp = L * 2 * d * model.ff_dim
    assert hardware_flops_per_token(NEOX, model, T, finetune="ffn",
                                    checkpointing=False) == (4 * n + 2 * mlp
                                                             + 12 * L * T * d)


def test_a_llama_models_flops_are_its_familys():
    """Llama's count: $N$ with grouped-query attention's narrower K and V,
    the attention products $n_h d_h$ wide; the MFU's count is the family's
    own, and LoRA trains no product's weight."""
    from labml_zero.llama.config import llama_3_2_1b
    from labml_zero.llama.family import LLAMA

    model, T = llama_3_2_1b(), 2048
    d, L, h = model.d_model, model.n_layers, model.n_heads * model.head_width
    kv = model.n_kv_heads * model.head_width
    n = L * (2 * d * h + 2 * d * kv + 3 * d * model.d_ff) + d * model.n_vocab
    assert matmul_params(LLAMA, model) == n
    assert model_flops_per_token(LLAMA, model, T) == LLAMA.flops_per_token(model, T)
    assert hardware_flops_per_token(LLAMA, model, T, finetune="lora",
                                    checkpointing=False) == 4 * n + 12 * L * T * h


def test_constants_are_the_bench_fit():
    """
    $e$ and $b_e$ solve the model-only bounds of W1 and W2-1 (least squares);
    $u$ is the engine's step less the bound, over the update's bytes; the
    compiled saving is W1 compiled against eager, on the element-wise term.
    """
    rows, seconds = [], []
    for line in lines(BOUNDS, "model_only"):
        job, s = job_setting(line)
        m, tokens = job.model, s.batch * job.seq
        flops = hardware_flops_per_token(NEOX, m, job.seq, finetune=job.finetune,
                                         checkpointing=s.checkpointing)
        passes = 3 + s.checkpointing
        rows.append([flops / H200.peak_flops,
                     m.n_layers * m.d_model * passes / H200.memory_bandwidth])
        seconds.append(line["step_time_mean_s"] / tokens)
    assert {job_setting(x)[0].model.d_model for x in lines(BOUNDS, "model_only")
            } == {2048, 4096}  # two widths: two unknowns
    inverse, element = np.linalg.lstsq(np.array(rows), np.array(seconds),
                                       rcond=None)[0]
    assert MATMUL_EFFICIENCY == pytest.approx(1 / inverse, rel=ROUNDING)
    assert ELEMENTWISE_BYTES == pytest.approx(element, rel=ROUNDING)

    # the update: the W2-1 engine step less its bound, 28 bytes an element on
    # one rank (bf16 gradient and parameter, fp32 master and moments)
    engine = np.mean([x["step_time_mean_s"] for x in lines(BOUNDS, "labml_zero")
                      if x["workload"] == "W2-1"])
    bound = np.mean([x["step_time_mean_s"] for x in lines(BOUNDS, "model_only")
                     if x["workload"] == "W2-1"])
    psi = lines(BOUNDS, "labml_zero")[0]["psi_trainable"]
    share = psi * 28 / (engine - bound) / H200.memory_bandwidth
    assert UPDATE_BANDWIDTH_SHARE == pytest.approx(share, rel=ROUNDING)

    eager, compiled = (next(x for x in lines(COMPILED_PAIR, "labml_zero")
                            if x["compiled"] == c) for c in (False, True))
    job, s = job_setting(eager)
    m = job.model
    elementwise = (s.batch * job.seq * ELEMENTWISE_BYTES * m.n_layers * m.d_model
                   * 3 / H200.memory_bandwidth)
    saved = eager["step_time_mean_s"] - compiled["step_time_mean_s"]
    assert COMPILED_ELEMENTWISE == pytest.approx(1 - saved / elementwise,
                                                 abs=ROUNDING)
    # the host's update: one chunk of W6, AdamW 90.8 ms and rounding 29.6 ms
    assert HOST_UPDATE_RATE == pytest.approx(314_639_360 / 0.1204, rel=ROUNDING)


@pytest.mark.parametrize("path", [BOUNDS, TABLE, COMPILED_PAIR],
                         ids=lambda p: p.name.split("-1xH200-")[1])
def test_whole_steps_are_predicted_within_ten_percent(path):
    # W1, W2-1 and W6 (offloaded, its host update) of the engine, eager and
    # compiled: none of them was fitted whole
    checked = 0
    for line in lines(path, "labml_zero"):
        if line["workload"] not in ("W1", "W2-1", "W6"):
            continue
        measured = line["step_time_mean_s"]
        assert predicted(line) == pytest.approx(measured, rel=STEP_TOLERANCE), (
            line["workload"], line["compiled"])
        checked += 1
    assert checked >= 2


def test_a_wrong_constant_misses_the_measurement():
    # the tolerance is tight enough to catch a model off by the update or by
    # a quarter of the products' efficiency
    line = next(x for x in lines(BOUNDS, "labml_zero") if x["workload"] == "W1")
    job, s = job_setting(line)
    b = budget_of(job, s, world_size=1, device_bytes=H200.memory_bytes)
    t = step_time(job, s, Cluster(H200), b)
    slower = t.total + 0.25 * t.matmul
    assert slower / line["step_time_mean_s"] - 1 > STEP_TOLERANCE
