"""The per-linear fp8 choice (`fp8_pays` in labml_zero/layers/float8.py):
set from the timings of bench/fp8_linears.py, and what it picks on the
benchmark's models."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from torch import nn

from bench.workloads import workloads
from labml_zero.layers import float8
from labml_zero.llama import activation_memory as llama_count
from labml_zero.llama import model as llama_model
from labml_zero.llama.config import LlamaConfig
from labml_zero.llama.kernels import LlamaKernels
from labml_zero.neox import layer_memory as neox_count
from labml_zero.neox import model as neox_model
from labml_zero.neox.kernels import ModelKernels

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
TIMINGS = RESULTS / "2026-12-06-run62-1xH100-fp8-linears.jsonl"
GPU_BOUND_TOKENS = 16384
"""The rows that set the rule: at fewer tokens a linear timed alone waits on
the host's launches (the rule's notes)."""


def timings() -> list[dict]:
    return [json.loads(line) for line in TIMINGS.read_text().splitlines() if line]


def test_every_linear_fp8_made_faster_alone_is_chosen():
    rows = [r for r in timings() if r["tokens"] == GPU_BOUND_TOKENS]
    assert len({(r["d_in"], r["d_out"]) for r in rows}) >= 12
    faster = [r for r in rows if r["speedup"] > 1]
    assert faster and all(float8.fp8_pays(r["d_in"], r["d_out"]) for r in faster)
    # and every shape of Pythia-160M, slower alone, is left in bf16
    small = [r for r in rows if r["model"] == "pythia-160m"]
    assert small and not any(float8.fp8_pays(r["d_in"], r["d_out"]) for r in small)
    assert all(r["speedup"] < 1 for r in small)


def speeds(name: str, workload: str) -> dict[str, float]:
    """labml_zero's compiled tokens/s in a results file: 'bf16' and 'fp8'."""
    path = RESULTS / name
    lines = [json.loads(t) for t in path.read_text().splitlines()
             if t.startswith("{")]
    out = {}
    for line in lines:
        if (line["workload"], line["engine"], line["compiled"]) == (
                workload, "labml_zero", True) and line["status"] == "ok":
            fp8 = "fp8" in line["kernels"].split(",")
            out["fp8" if fp8 else "bf16"] = line["tokens_per_s"]
    assert set(out) == {"bf16", "fp8"}, (name, workload)
    return out


def chosen_names(workload: str) -> tuple[set[str], set[str]]:
    """The linears of a layer the rule runs in fp8, and all of them."""
    config, layers = one_layer(workload)
    every = {n for n, m in layers[1].named_modules() if isinstance(m, nn.Linear)}
    return fp8_names(config, layers), every


def test_the_steps_measured_agree_with_the_rule():
    """Whole steps, one H100, fp8 against bf16 in the same lease. Files up to
    run61 ran every linear in fp8 (before the choice); run63 and later ran the
    rule."""
    pytest.importorskip("torchao.float8")
    # Pythia-160M with every linear in fp8 was slower than bf16 ...
    every_w4 = speeds("2026-12-06-run61-1xH100-W4-fp8.jsonl", "W4")
    assert every_w4["fp8"] < every_w4["bf16"]
    # ... so the rule takes none of its linears, and its fp8 step is bf16's
    assert chosen_names("W4")[0] == set()
    rule_w4 = speeds("2026-12-06-run63-1xH100-W4-fp8-per-linear.jsonl", "W4")
    assert rule_w4["fp8"] >= rule_w4["bf16"]
    # Pythia-1.4B: every linear faster than the MLP's two alone, and the rule
    # takes all four, so run57's line is the rule's setting
    every_w1 = speeds("2026-12-06-run57-1xH100-W1-L1-fp8.jsonl", "W1")
    mlp_w1 = speeds("2026-12-06-run63-1xH100-W1-fp8-mlp-only.txt", "W1")
    assert every_w1["fp8"] / every_w1["bf16"] > mlp_w1["fp8"] / mlp_w1["bf16"] > 1
    chosen, every = chosen_names("W1")
    assert chosen == every
    # Llama-3.2-1B with the rule's five of seven
    rule_l1 = speeds("2026-12-06-run64-1xH100-L1-fp8-per-linear.jsonl", "L1")
    assert rule_l1["fp8"] > rule_l1["bf16"]


def fp8_names(model, layers) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {name for layer in layers[1:-2] for name, m in layer.named_modules()
            if isinstance(m, Float8Linear)}


def one_layer(name: str):
    """The workload's model with one layer, on meta, asked for fp8."""
    config = replace(workloads()[name].model, n_layers=1)
    if isinstance(config, LlamaConfig):
        return config, llama_model.build_layers(
            config, device="meta", kernels=LlamaKernels(fp8=True))
    return config, neox_model.build_layers(
        config, device="meta", kernels=ModelKernels(fp8=True))


@pytest.mark.parametrize("name, expected", [
    ("W4", set()),  # Pythia-160M: none, so fp8 runs as bf16
    ("W1", {"attention.query_key_value", "attention.dense",
            "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}),
    ("L1", {"self_attn.q_proj", "self_attn.o_proj",  # not the narrow k, v
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}),
    ("W2-1", {"attention.query_key_value", "attention.dense",
              "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}),
])
def test_which_linears_each_model_runs_in_fp8(name, expected):
    pytest.importorskip("torchao.float8")
    config, layers = one_layer(name)
    assert fp8_names(config, layers) == expected
    # every linear fits the product's shape: the size alone decides
    assert all(float8.fp8_fits(m.in_features, m.out_features)
               for m in layers[1].modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("name", ["W4", "W1", "L1"])
def test_the_compiled_count_drops_only_the_chosen_inputs(name):
    """W4 keeps the bf16 count; W1 drops what every linear in fp8 drops (all
    four are chosen); L1 keeps RMS1's output, which its bf16 keys and values
    read, so every linear in fp8 (the probe's case) keeps less."""
    workload = workloads()[name]
    llama = isinstance(workload.model, LlamaConfig)
    family = llama_count if llama else neox_count
    kernels = (LlamaKernels if llama else ModelKernels)(fp8=True)

    def count(kernels, compiled):
        return family.layer_activation_bytes(
            workload.model, batch=workload.batch, seq=workload.seq,
            finetune="all", kernels=kernels, compiled=compiled)

    eager = count(kernels, False)
    chosen = count(kernels, True)
    every = count(replace(kernels, fp8_every_linear=True), True)
    n, d = workload.batch * workload.seq, workload.model.d_model
    if name == "W4":
        assert chosen == eager
        assert every < chosen
    elif name == "W1":
        assert chosen == every < eager
    else:  # RMS2(x) and SiLU(g)*u, bf16; RMS1(x) kept, and q's fp8 cast of it
        assert eager - chosen == 2 * (n * d + n * workload.model.d_ff) - n * d
        assert eager - every == eager - chosen + 2 * n * d + n * d
