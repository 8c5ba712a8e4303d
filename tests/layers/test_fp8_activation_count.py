"""The activation counts of compiled fp8 layers (`fp8_inputs_recomputed` in
labml_zero/layers/float8.py) against what one layer of each family kept on a
GPU, eager and compiled, bf16 and fp8, at the benchmark's widths."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.workloads import workloads
from labml_zero.llama import activation_memory as llama_count
from labml_zero.llama.config import LlamaConfig
from labml_zero.llama.kernels import resolve_llama_kernels
from labml_zero.neox import layer_memory as neox_count
from labml_zero.neox.build import resolve_kernels

PROBE = (Path(__file__).resolve().parents[2] / "bench" / "results"
         / "2026-12-06-run59-1xH100-layer-saved-bytes.txt")
BF16 = 2


def probed() -> list[dict]:
    return [json.loads(line) for line in PROBE.read_text().splitlines()
            if line.startswith("{")]


def rotary_tables_bytes(model, seq: int) -> int:
    """The cos and sin tables, `[T, d_r]` bf16 each: the layer keeps them, but
    one pair serves every layer, so the counts leave them out as they leave
    out the parameters."""
    width = model.head_width if isinstance(model, LlamaConfig) else model.rotary_dim
    return 2 * seq * width * BF16


def count(line: dict) -> int:
    workload = workloads()[line["workload"]]
    llama = isinstance(workload.model, LlamaConfig)
    kernels = (resolve_llama_kernels if llama else resolve_kernels)(line["kernels"], "cuda")
    # the probe ran every linear in fp8, at widths where not all would be
    kernels = replace(kernels, fp8_every_linear=True)
    family = llama_count if llama else neox_count
    return family.layer_activation_bytes(
        workload.model, batch=workload.batch, seq=workload.seq, finetune="all",
        kernels=kernels, compiled=line["compiled"])


@pytest.mark.parametrize("line", probed(), ids=lambda line: "{workload}-{kernels}-{compiled}"
                         .format(**line))
def test_the_count_is_what_a_layer_kept_on_the_gpu(line):
    workload = workloads()[line["workload"]]
    assert count(line) + rotary_tables_bytes(workload.model, workload.seq) \
        == line["saved_bytes"]


def test_the_probe_has_every_case_and_fp8_compiled_keeps_less():
    lines = probed()
    cases = {(line["workload"], line["kernels"], line["compiled"]) for line in lines}
    assert cases == {(w, k, c) for w in ("W1", "L1") for k in ("auto", "auto,fp8")
                     for c in (False, True)}
    by_case = {(line["workload"], line["kernels"], line["compiled"]): count(line)
               for line in lines}
    for w in ("W1", "L1"):
        # eager fp8 and compiled bf16 keep the eager bf16 set; compiled fp8 less
        eager = by_case[(w, "auto", False)]
        assert by_case[(w, "auto", True)] == by_case[(w, "auto,fp8", False)] == eager
        assert by_case[(w, "auto,fp8", True)] < eager
