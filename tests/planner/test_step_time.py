"""`labml_zero/planner/step_time.py`: the roofline's constants are the
benchmark's measured lines, solved again here, and the model reproduces the
engine's whole measured steps of both families on one H200, each line's job
built as `bench.run --plan` builds it."""

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.predictions import (H100_FILES, H200_FILES, engine_lines, gpu_of,
                               job_setting, predictions)
from bench.workloads import workloads
from labml_zero.neox.family import NEOX
from labml_zero.planner.devices import (GPUS, H100_ELEMENTWISE_FACTOR,
                                        H100_HOST_UPDATE_RATE, Cluster)
from labml_zero.planner.setting import Job, Setting, budget_of
from labml_zero.planner.step_time import (COMPILED_ELEMENTWISE, ELEMENTWISE_BYTES,
                                          FP8_CAST_BYTES,
                                          HOST_UPDATE_RATE, LAYER_PASS_IDLE,
                                          MATMUL_EFFICIENCY, READOUT_BYTES,
                                          UPDATE_BANDWIDTH_SHARE,
                                          hardware_flops_per_token,
                                          matmul_params, model_flops_per_token,
                                          step_time)

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
BOUNDS = RESULTS / "2026-12-04-run49-1xH200-W2-1-W1-bounds.jsonl"
TABLE = RESULTS / "2026-12-04-run50-1xH200-table.jsonl"
COMPILED_PAIR = RESULTS / "2026-12-04-run51-1xH200-job-vs-bench-W1.jsonl"
# W1's eager step under the profiler, beside the one-rank lines
W1_IDLE = RESULTS / "2026-12-02-run31-1xH200-W1-rotary-tables.jsonl"
H200_LINES = [RESULTS / name for name in H200_FILES]
H100_LINES = [RESULTS / name for name in H100_FILES]
H200 = GPUS["h200"]
# A constant is the fit's solution rounded to about three figures.
ROUNDING = 0.01
# The whole step's prediction against the measurement, as issue 49 asks.
STEP_TOLERANCE = 0.10


def lines(path: Path, engine: str) -> list[dict]:
    return engine_lines(path, engine)


def timed(line: dict):
    """The model's `StepTime` of the line, on its own GPU's data-sheet rates."""
    job, setting = job_setting(line)
    gpu = gpu_of(line)
    b = budget_of(job, setting, world_size=1, device_bytes=gpu.memory_bytes)
    return step_time(job, setting, Cluster(gpu), b)


def predicted(line: dict) -> float:
    return timed(line).total


def error(line: dict) -> float:
    return predicted(line) / line["step_time_mean_s"] - 1


def layer_passes(line: dict) -> int:
    job, s = job_setting(line)
    return job.model.n_layers * (3 + s.checkpointing)


def twin_bytes(line: dict) -> float:
    """The bytes a token of the line moves in the plain twins of the fusions
    it left off (`labml_zero/layers/kernel_traffic.py`), its layers'
    unless compiled, and its loss's."""
    job, s = job_setting(line)
    u = job.family.unfused_bytes(job.model, job.kernels, batch=s.batch, seq=job.seq)
    layer = 0.0 if s.compile else u.layer_forward * (1 + s.checkpointing) + u.layer_backward
    return job.model.n_layers * layer + u.rest


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
    # the MFU's count is the fine-tune's, recomputation left out: frozen
    # matrices' weight gradients neither run nor count
    for finetune in ("biases", "lora", "ffn"):
        assert model_flops_per_token(NEOX, model, T, finetune) == (
            hardware_flops_per_token(NEOX, model, T, finetune=finetune,
                                     checkpointing=False))
    assert model_flops_per_token(NEOX, model, T, "lora") == 4 * n + 12 * L * T * d
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
    $\\tau$ is the profiler's idle of W4's graphed steps over their layer
    passes; $e$, $b_e$ and $b_V$ solve the model-only bounds of W1 and W2-1 and
    W4's graphed step less its update (least squares); $u$ is the engine's
    step less the bound, over the update's bytes; the compiled saving is W1
    compiled against eager, on the element-wise term.
    """
    graphed = [x for x in lines(TABLE, "labml_zero") if x["cuda_graph"]]
    assert {x["workload"] for x in graphed} == {"W4"}
    idle = [x["gpu_idle"] * x["step_time_mean_s"] / layer_passes(x)
            for x in graphed]
    assert LAYER_PASS_IDLE == pytest.approx(np.mean(idle), rel=ROUNDING)
    # W1's eager step, 2.6 times W4's width, idles as long a layer pass: the
    # gaps are the kernels', not the width's (within the spread of W4's lines)
    w1 = next(x for x in lines(W1_IDLE, "labml_zero") if not x["compiled"]
              and x["batch_per_gpu"] == 8)
    w1_idle = w1["gpu_idle"] * w1["step_time_mean_s"] / layer_passes(w1)
    assert min(idle) <= w1_idle <= max(idle)

    # the update: the W2-1 engine step less its bound, 28 bytes an element on
    # one rank (bf16 gradient and parameter, fp32 master and moments)
    engine = np.mean([x["step_time_mean_s"] for x in lines(BOUNDS, "labml_zero")
                      if x["workload"] == "W2-1"])
    bound = np.mean([x["step_time_mean_s"] for x in lines(BOUNDS, "model_only")
                     if x["workload"] == "W2-1"])
    psi = lines(BOUNDS, "labml_zero")[0]["psi_trainable"]
    share = psi * 28 / (engine - bound) / H200.memory_bandwidth
    assert UPDATE_BANDWIDTH_SHARE == pytest.approx(share, rel=ROUNDING)

    rows, seconds = [], []
    for line in lines(BOUNDS, "model_only") + graphed:
        job, s = job_setting(line)
        m, tokens = job.model, s.batch * job.seq
        flops = hardware_flops_per_token(job.family, m, job.seq,
                                         finetune=job.finetune,
                                         checkpointing=s.checkpointing)
        passes = 3 + s.checkpointing
        rows.append([flops / H200.peak_flops,
                     m.n_layers * m.d_model * passes / H200.memory_bandwidth,
                     m.n_vocab / H200.memory_bandwidth])
        rest = LAYER_PASS_IDLE * layer_passes(line)
        if line["engine"] == "labml_zero":
            rest += timed(line).update
        # the plain twins of the fusions a line left off (W4's ran the chunked
        # loss alone): their counted bytes are known, not fitted
        seconds.append((line["step_time_mean_s"] - rest) / tokens
                       - twin_bytes(line) / H200.memory_bandwidth)
    shapes = {(job_setting(x)[0].model.d_model, job_setting(x)[0].model.n_vocab)
              for x in lines(BOUNDS, "model_only") + graphed}
    assert len(shapes) == 3  # three widths: three unknowns
    inverse, element, readout = np.linalg.lstsq(np.array(rows), np.array(seconds),
                                                rcond=None)[0]
    assert MATMUL_EFFICIENCY == pytest.approx(1 / inverse, rel=ROUNDING)
    assert ELEMENTWISE_BYTES == pytest.approx(element, rel=ROUNDING)
    assert READOUT_BYTES == pytest.approx(readout, rel=ROUNDING)

    eager, compiled = (next(x for x in lines(COMPILED_PAIR, "labml_zero")
                            if x["compiled"] == c) for c in (False, True))
    job, s = job_setting(eager)
    m = job.model
    elementwise = (s.batch * job.seq * ELEMENTWISE_BYTES * m.n_layers * m.d_model
                   * 3 / H200.memory_bandwidth)
    # every fusion on: no twin's bytes that compiling would save besides
    assert twin_bytes(eager) == 0
    saved = eager["step_time_mean_s"] - compiled["step_time_mean_s"]
    assert COMPILED_ELEMENTWISE == pytest.approx(1 - saved / elementwise,
                                                 abs=ROUNDING)
    # the host's update: one chunk of W6, AdamW 90.8 ms and rounding 29.6 ms
    assert HOST_UPDATE_RATE == pytest.approx(314_639_360 / 0.1204, rel=ROUNDING)


# No line misses the goal: W4's graphed step with every fusion on an H200 of
# 12-06, 11% under the prediction while W4's fitted line was charged nothing
# for the plain twins it ran, is within it since.
STEP_MISSES: set = set()


# W4's graphed step on one H100 lease, the plain model, the chunked loss, and
# every fusion: in no fit
KERNEL_STEPS = RESULTS / "2026-12-06-run75-1xH100-W4-kernels-graphed-every-engine-best.jsonl"


# The plain model (`--kernels none`) of Llama-3.2-1B on one H100, eager and
# compiled
PLAIN_L1 = RESULTS / "2026-12-05-run56-1xH100-L1-every-engine.jsonl"
PLAIN_W1 = RESULTS / "2026-12-07-run76-1xH100-W1-kernels-none-every.jsonl"


def test_the_kernels_are_timed_by_their_twins_bytes():
    """
    W4's CUDA-graphed step of one lease, plain, with the chunked loss and with
    every fusion: each within the goal, in the measured order, where one
    element-wise count for every choice gave all three the same time (the
    plain step 19% short). The plain L1 compiled is within the goal too;
    eager, its layers' twins cost more than their bytes (each extra launch is a
    gap the host leaves, which the count does not time), a miss kept in sight,
    half of what it was (26% short).
    """
    graphed = {x["kernels"]: x for x in lines(KERNEL_STEPS, "labml_zero")
               if x["cuda_graph"] and not x["compiled"]}
    measured = {k: round(x["step_time_mean_s"] * 1e3, 1) for k, x in graphed.items()}
    assert measured == {"none": 55.3, "loss": 45.8,
                        "loss,rotary,norms,bias_gelu": 40.8}
    times = {k: predicted(x) for k, x in graphed.items()}
    assert times["none"] > times["loss"] > times["loss,rotary,norms,bias_gelu"]
    for kernels, line in graphed.items():
        assert error(line) == pytest.approx(0, abs=STEP_TOLERANCE), kernels
    plain = {x["compiled"]: x for x in lines(PLAIN_L1, "labml_zero")
             if x["kernels"] == "none"}
    assert error(plain[True]) == pytest.approx(0, abs=STEP_TOLERANCE)
    assert STEP_TOLERANCE < -error(plain[False]) < 1.5 * STEP_TOLERANCE
    # W1 eager, plain and every fusion, one H100 lease, measured after the
    # count was written: both within the goal, the plain one only with its
    # twins' bytes (timed as the fused model, it misses)
    w1 = {x["kernels"]: x for x in lines(PLAIN_W1, "labml_zero")}
    assert set(w1) == {"none", "loss,rotary,norms,bias_gelu"}
    for line in w1.values():
        assert error(line) == pytest.approx(0, abs=STEP_TOLERANCE), line["kernels"]
    fused = timed(w1["loss,rotary,norms,bias_gelu"]).total
    assert fused / w1["none"]["step_time_mean_s"] - 1 < -STEP_TOLERANCE


@pytest.mark.parametrize("path", H200_LINES,
                         ids=lambda p: p.name.split("-1xH200-")[1])
def test_whole_steps_are_predicted_within_ten_percent(path):
    # every engine line of the file, eager, compiled and graphed: only the
    # three lines of the fit's workloads above were fitted, and never whole;
    # a line of `STEP_MISSES` misses the goal, and by no more than a fifth
    found = lines(path, "labml_zero")
    assert found
    for line in found:
        key = (line["workload"], line["compiled"], line["cuda_graph"])
        if (path.name, *key) in STEP_MISSES:
            assert STEP_TOLERANCE < abs(error(line)) < 2 * STEP_TOLERANCE, key
            continue
        assert error(line) == pytest.approx(0, abs=STEP_TOLERANCE), (
            line["batch_per_gpu"], *key)


def test_the_lines_cover_both_families_and_every_way_of_running():
    found = [x for path in H200_LINES for x in lines(path, "labml_zero")]
    assert {x["workload"] for x in found} == {"W1", "W2-1", "W3", "W4", "W6",
                                              "L1", "L2"}
    assert {x["compiled"] for x in found} == {True, False}
    assert {x["cuda_graph"] for x in found} == {True, False}
    assert {x["batch_per_gpu"] for x in found if x["workload"] == "W2-1"} >= {8, 12, 16}
    assert {x["compiled"] for x in found if x["workload"] == "L1"} == {True, False}


def h100_bf16_lines() -> list[dict]:
    """The H100's bf16 lines of the fused kernels on the current engine (the
    prediction table's) with every state on the device, but W4's, whose
    steps varied by a quarter between leases (compiled: 37.9 to 48.1 ms)."""
    return [p.line for p in predictions() if "H100" in p.line["device"]
            and p.line["workload"] != "W4" and p.line["kernels"] != "none"
            and "fp8" not in p.line["kernels"].split(",")
            and p.line.get("offload") is None]


def h100_offloaded():
    """The H100's predictions of lines with optimizer state on the host."""
    return [p for p in predictions() if "H100" in p.line["device"]
            and p.line.get("offload") is not None]


def test_an_h100s_host_update_rate_is_the_bench_fit():
    r"""
    Where the host's update outlasts the backward pass $t_b$, the step is
    $a + F x$: $a$ the compute, the device's update, the link's time less
    $t_b$; $F$ the offloaded elements and $x = 1/R_h$. The least-squares $x$
    over those lines' relative errors is $\sum_i (F_i/m_i)(1 - a_i/m_i) /
    \sum_i (F_i/m_i)^2$. The other lines (eight sequences: the host hidden)
    say nothing of the rate.
    """
    h100 = GPUS["h100"]
    assert h100.host_update_rate == H100_HOST_UPDATE_RATE
    num = den = 0.0
    exposed = set()
    for p in h100_offloaded():
        t, m = p.step, p.line["step_time_mean_s"]
        if t.host_exposed <= 0:
            continue
        # the host term at an endless rate is the link's alone
        job, setting = job_setting(p.line, p.file)
        instant = replace(h100, host_update_rate=float("inf"))
        link = step_time(job, setting, Cluster(instant), p.budget).host
        backward = t.host - t.host_exposed
        offloaded = (t.host - link) * H100_HOST_UPDATE_RATE
        a = t.total - t.host_exposed + link - backward
        num += offloaded / m * (1 - a / m)
        den += (offloaded / m) ** 2
        exposed.add((p.line["batch_per_gpu"], p.line["activation_checkpointing"]))
    assert exposed == {(2, True), (4, True), (4, False)}
    assert H100_HOST_UPDATE_RATE == pytest.approx(den / num, rel=ROUNDING)


def test_an_h100s_offloaded_steps_are_within_the_goal():
    # At the H200's host rate the lines with the host exposed came out up to
    # 40% slow; at the H100's own, every one is within the goal
    found = h100_offloaded()
    assert len(found) >= 10
    assert [p.step_error for p in found
            if abs(p.step_error) > STEP_TOLERANCE] == []


def test_an_h100s_element_wise_rate_is_the_bench_fit():
    r"""
    The step at the H100's data-sheet bandwidth $W$ for every term is $a + b$,
    $b$ the element-wise and readout terms; at $W$ times a factor $f$ it is
    $a + b/f$. The least-squares $x = 1/f$ over the lines' relative errors is
    $\sum_i (b_i/m_i)(1 - a_i/m_i) / \sum_i (b_i/m_i)^2$, $m_i$ the measured
    step.
    """
    h100 = GPUS["h100"]
    assert h100.elementwise_bandwidth == H100_ELEMENTWISE_FACTOR * h100.memory_bandwidth
    found = h100_bf16_lines()
    assert {x["workload"] for x in found} == {"W1", "W3", "L1", "W2-1"}
    num = den = 0.0
    for x in found:
        t, m = timed(x), x["step_time_mean_s"]
        b = (t.elementwise + t.readout) * H100_ELEMENTWISE_FACTOR
        a = t.total - (t.elementwise + t.readout)
        num += b / m * (1 - a / m)
        den += (b / m) ** 2
    assert H100_ELEMENTWISE_FACTOR == pytest.approx(den / num, rel=ROUNDING)


def test_an_h100s_steps_are_within_the_goal():
    # at the data sheet's rate alone they came out up to 16.5% slow (W1
    # recomputed, eager): the element-wise kernels are the same as the
    # H200's, which has the bandwidth to spare
    for x in h100_bf16_lines():
        assert abs(error(x)) <= STEP_TOLERANCE, (x["workload"], error(x))
        slow = replace(GPUS["h100"], elementwise_bandwidth=None)
        job, setting = job_setting(x)
        b = budget_of(job, setting, world_size=1, device_bytes=slow.memory_bytes)
        assert step_time(job, setting, Cluster(slow), b).total > predicted(x)


# The compiled fp8 steps and the bf16 step of the same lease and model: W1 and
# W2-1's model at eight layers ran every linear in fp8, L1 the per-linear choice.
FP8_PAIRS = (("2026-12-06-run57-1xH100-W1-L1-fp8.jsonl", "W1", 24),
             ("2026-12-06-run60-1xH100-W2-1-by-depth-fp8.jsonl", "W2-1", 8),
             ("2026-12-06-run64-1xH100-L1-fp8-per-linear.jsonl", "L1", 16))
# The fit's residuals: the measured fp8-over-bf16 speed-up against the model's.
FP8_RATIO_TOLERANCE = 0.05


def fp8_pair(name: str, workload: str, depth: int):
    """(fp8 line's StepTime, bf16 line's StepTime, measured bf16/fp8 ratio)."""
    found = [x for x in lines(RESULTS / name, "labml_zero")
             if (x["workload"], x["compiled"], x["model"]["n_layers"])
             == (workload, True, depth)]
    fp8, = [x for x in found if "fp8" in x["kernels"].split(",")]
    bf16, = [x for x in found if "fp8" not in x["kernels"].split(",")]

    def model(line):
        job, setting = job_setting(line, name)
        gpu = gpu_of(line)
        b = budget_of(job, setting, world_size=1, device_bytes=gpu.memory_bytes)
        return step_time(job, setting, Cluster(gpu), b)
    return model(fp8), model(bf16), bf16["step_time_mean_s"] / fp8["step_time_mean_s"]


def test_fp8_cast_bytes_are_the_bench_fit():
    # each pair asks the fp8 prediction to be the bf16 one over the measured
    # speed-up; the casts' term is what is left, linear in FP8_CAST_BYTES
    widths, left = [], []
    for pair in FP8_PAIRS:
        fp8, bf16, ratio = fp8_pair(*pair)
        assert fp8.casts > 0 and bf16.casts == 0
        widths.append(fp8.casts / FP8_CAST_BYTES)
        left.append(bf16.total / ratio - (fp8.total - fp8.casts))
    fit = np.dot(widths, left) / np.dot(widths, widths)
    assert FP8_CAST_BYTES == pytest.approx(fit, rel=ROUNDING)


def test_fp8_steps_are_as_much_faster_as_measured():
    for pair in FP8_PAIRS:
        fp8, bf16, ratio = fp8_pair(*pair)
        assert bf16.total / fp8.total == pytest.approx(ratio, rel=FP8_RATIO_TOLERANCE), pair
        # without the casts' term the speed-up is overstated past the tolerance
        # on the narrowest model
    fp8, bf16, ratio = fp8_pair(*FP8_PAIRS[0])
    assert bf16.total / (fp8.total - fp8.casts) > ratio * (1 + FP8_RATIO_TOLERANCE)


def test_a_wrong_constant_misses_the_measurement():
    # the tolerance is tight enough to catch a model off by a quarter of the
    # products' efficiency, or without the readout's term (W4's vocabulary,
    # 5.5 times its layers' L d) or the kernels' gaps (W3's 44 layers of 2,048
    # tokens)
    line = next(x for x in lines(BOUNDS, "labml_zero") if x["workload"] == "W1")
    t = timed(line)
    slower = t.total + 0.25 * t.matmul
    assert slower / line["step_time_mean_s"] - 1 > STEP_TOLERANCE
    for workload, term in (("W4", "readout"), ("W3", "idle")):
        line = next(x for x in lines(TABLE, "labml_zero") if x["workload"] == workload)
        t = timed(line)
        without = t.total - getattr(t, term)
        assert 1 - without / line["step_time_mean_s"] > STEP_TOLERANCE, (workload, term)


def test_l1_checks_the_readout_term():
    """L1, whose vocabulary (128,256) no fitted line has, within half the goal
    of its measured step with $b_V$, and outside that without it: the term is
    the readout's, not W4's alone. (With W4's fitted line charged for its
    plain twins' counted bytes, $b_V$ is smaller, and L1's steps come out a
    few percent short: what a Llama layer moves beyond GPT-NeoX's count.)"""
    found = lines(RESULTS / "2026-12-05-run54-1xH200-L1.jsonl", "labml_zero")
    assert {x["workload"] for x in found} == {"L1"} and len(found) == 2
    for line in found:
        measured = line["step_time_mean_s"]
        t = timed(line)
        assert abs(t.total / measured - 1) < STEP_TOLERANCE / 2, line["compiled"]
        assert abs((t.total - t.readout) / measured - 1) > STEP_TOLERANCE / 2, (
            line["compiled"])


# The LoRA fine-tune of GPT-NeoX-20B that `--auto` planned and ran on one H100
LORA_20B = RESULTS / "2026-12-06-run66-1xH100-job-lora-gpt-neox-20b.txt"


def test_a_lora_step_counts_its_adapters():
    """The job's own measured step (the log's closing tokens/s, 8 sequences
    of 2,048 a step) within the goal of the plan's setting, 1 x 8 compiled;
    without the adapters' bytes it misses the goal."""
    from labml_zero.finetune.config import FinetuneConfig
    from labml_zero.finetune.planning import job_of

    text = LORA_20B.read_text()
    assert "--batch-size 1 --grad-accum 8 --prefetch-depth 1 --compile" in text
    rate = float(re.search(r"\(after \d+ warm-up\): ([\d,]+)", text)[1]
                 .replace(",", ""))
    measured = 8 * 2048 / rate
    config = FinetuneConfig(model="gpt-neox-20b", finetune="lora", seq_len=2048)
    job = job_of(config, global_batch=8)
    setting = Setting(batch=1, micro_batches=8, compile=True)
    gpu = GPUS["h100"]
    b = budget_of(job, setting, world_size=1, device_bytes=gpu.memory_bytes)
    t = step_time(job, setting, Cluster(gpu), b)
    assert abs(t.total / measured - 1) <= STEP_TOLERANCE
    # the same FLOPs and no adapter: only the biases train
    bare = step_time(replace(job, finetune="biases"), setting, Cluster(gpu), b)
    assert abs(bare.total / measured - 1) > STEP_TOLERANCE


def test_a_hybrid_step_sends_only_its_all_reduce_across_hosts():
    """Two hosts of eight, shard groups of one host: the collectives' time is
    the hybrid page's formula (all-gathers and reduce-scatter over NVLink,
    the shards' all-reduce over the NICs), within the chunks' padding; timed
    as a ring over all sixteen ranks at the NIC's pace it is several times
    that."""
    from labml_zero.finetune.config import FinetuneConfig
    from labml_zero.finetune.planning import job_of
    from labml_zero.planner.hybrid_memory import hybrid_step_seconds

    gpu = GPUS["h200"]
    cluster = Cluster(gpu, gpus_per_node=8, nodes=2)
    config = FinetuneConfig(model="pythia-1.4b", seq_len=2048)
    flat = job_of(config, global_batch=16 * 8)
    hybrid = replace(flat, shard_group_size=8)
    setting = Setting(batch=8, micro_batches=1)
    b = budget_of(hybrid, setting, world_size=16, device_bytes=gpu.memory_bytes)
    comm = step_time(hybrid, setting, cluster, b).comm
    formula = hybrid_step_seconds(b.psi_trainable, 16, 8,
                                  bandwidth_in=gpu.peer_bus_bandwidth,
                                  bandwidth_out=gpu.node_bus_bandwidth)
    # the padding is gathered twice and reduced once, as every element
    assert comm >= formula
    assert comm / formula - 1 <= b.padding / b.psi_trainable + 1e-9
    # sharded over all sixteen, every collective crosses the hosts
    flat_budget = budget_of(flat, setting, world_size=16,
                            device_bytes=gpu.memory_bytes)
    assert step_time(flat, setting, cluster, flat_budget).comm > 4 * comm
