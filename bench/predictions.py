r"""
---
title: The planner against the measurements
summary: Every one-GPU line of labml_zero that the benchmark measured on the
  current engine, beside what the planner predicts for the same setting: the
  peak device memory and the step time, and how far each is off.
---

# The planner against the measurements

The [planner](../labml_zero/planner/search.html) chooses a setting from two
predictions: the peak device memory of a rank (the [memory
budget](../labml_zero/planner/memory_budget.html)) and the time of a step (the
[roofline](../labml_zero/planner/step_time.html)). This page puts both beside
what the benchmark measured, line by line, for the same model, batch,
kernels, recomputation, offload and compilation. The error of a prediction
$p$ against a measurement $m$ is

$$\epsilon = \frac{p}{m} - 1,$$

positive where the planner expects more memory or a slower step than the GPU
showed. The goals are `MEMORY_GOAL` for the memory and `STEP_GOAL` for the
step; the results page draws the table from `MEASURED_FILES`, and the
step-time test checks the steps of the H200 files.

```bash
python -m bench.predictions
```

prints the same table in Markdown.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from labml_zero.planner.devices import GPU, GPUS, Cluster
from labml_zero.planner.memory_budget import Budget
from labml_zero.planner.memory_budget import budget as memory_budget
from labml_zero.planner.setting import Job, Setting, budget_inputs
from labml_zero.planner.step_time import StepTime, step_time

from .plan import job_of
from .workloads import workloads

__all__ = ["MEASURED_FILES", "H200_FILES", "H100_FILES", "KERNEL_CHOICE_FILES", "MEMORY_GOAL", "STEP_GOAL",
           "engine_lines", "gpu_of", "job_setting", "Prediction", "predict",
           "predictions", "prediction_markdown"]

MEMORY_GOAL = 0.03
"""Issue 49's bound on the peak device memory's error."""
STEP_GOAL = 0.10
"""Issue 49's bound on the step time's error, on one GPU."""

RESULTS = Path(__file__).resolve().parent / "results"
# Every file of one-GPU engine lines on one H200 since the one-rank alias
# (run43), the last change that moved these steps (W3's by a tenth): the
# engine the planner models. The earlier files time an older engine (W3 18%
# and W6 20% slower, W4's eager step held back by its host) and hold peaks
# of an older activation count.
H200_FILES = (
    "2026-12-03-run43-1xH200-table-one-rank-alias.jsonl",
    "2026-12-03-run44-1xH200-W2-1-batches.jsonl",
    "2026-12-03-run45-1xH200-table-one-pass-update.jsonl",
    "2026-12-04-run49-1xH200-W2-1-W1-bounds.jsonl",
    "2026-12-04-run50-1xH200-table.jsonl",
    "2026-12-04-run51-1xH200-job-vs-bench-W1.jsonl",
    "2026-12-05-run54-1xH200-L1.jsonl",
    "2026-12-05-run55-1xH200-L2-b2-b4.jsonl",
    "2026-12-06-run73-1xH200-every-engine-best-W4-W1-W2-1.jsonl")
H100_FILES = (
    "2026-12-05-run52-1xH100-table.jsonl",
    "2026-12-05-run53-1xH100-L1.jsonl",
    "2026-12-06-run57-1xH100-W1-L1-fp8.jsonl",
    "2026-12-06-run58-1xH100-L1-W4-every-engine-best.jsonl",
    "2026-12-06-run60-1xH100-W2-1-by-depth-fp8.jsonl",
    "2026-12-06-run61-1xH100-W4-fp8.jsonl",
    "2026-12-06-run63-1xH100-W4-fp8-per-linear.jsonl",
    "2026-12-06-run64-1xH100-L1-fp8-per-linear.jsonl",
    "2026-12-06-run65-1xH100-W1-grid.jsonl",
    "2026-12-06-run66-1xH100-W1-auto.jsonl",
    "2026-12-06-run67-1xH100-W2-1-narrow-states.jsonl",
    "2026-12-06-run68-1xH100-W2-1-stochastic-one-pass.jsonl",
    "2026-12-06-run68-1xH100-W1-graphed-stochastic.jsonl",
    "2026-12-06-run69-1xH100-W2-1-kahan-one-pass-stochastic-b4.jsonl",
    "2026-12-06-run70-1xH100-W2-1-peaks-by-depth-and-batch.jsonl",
    "2026-12-06-run71-1xH100-W2-1O-grid.jsonl",
    "2026-12-06-run71-1xH100-W2-1O-auto.jsonl",
    "2026-12-07-run77-1xH100-W1-W4-every-engine-best.jsonl",
    "2026-12-07-run77-1xH100-W1-grid.jsonl",
    "2026-12-07-run77-1xH100-W4-W3-W2-1-auto.jsonl")
# Lines of a layout without a master (`bf16-stochastic`, `bf16-kahan`) in
# these files ran its update as the twin on widened slices, before the one
# compiled pass: an engine the planner no longer models, left out.
TWIN_UPDATE_FILES = ("2026-12-06-run67-1xH100-W2-1-narrow-states.jsonl",)
NO_MASTER = ("bf16-stochastic", "bf16-kahan")
# fp8 lines from before the per-linear choice (`fp8_pays`): every linear of
# the layers ran in fp8, so they are predicted with `fp8_every_linear`. Lines
# since record how many linears ran in fp8 (`info.float8_linears`).
EVERY_LINEAR_FP8_FILES = (
    "2026-12-06-run57-1xH100-W1-L1-fp8.jsonl",
    "2026-12-06-run60-1xH100-W2-1-by-depth-fp8.jsonl",
    "2026-12-06-run61-1xH100-W4-fp8.jsonl")
# The plain model (`--kernels none`) and the kernels added in steps: the
# roofline adds the bytes each plain twin moves, counted from the code, to the
# element-wise count of every fusion on; these lines check it, in no fit. W4's
# CUDA-graphed step of one lease, plain, with the chunked loss and with every
# fusion, each within the goal
# (tested: tests/planner/test_step_time.py::test_the_kernels_are_timed_by_their_twins_bytes).
KERNEL_CHOICE_FILES = ("2026-12-05-run56-1xH100-L1-every-engine.jsonl",
                       "2026-12-06-run75-1xH100-W4-kernels-graphed-every-engine-best.jsonl",
                       "2026-12-07-run76-1xH100-W1-kernels-none-every.jsonl")
MEASURED_FILES = H200_FILES + H100_FILES + KERNEL_CHOICE_FILES


def engine_lines(path: Path, engine: str = "labml_zero") -> list[dict]:
    """The one-GPU lines of `engine` in a result file that ran (none of a
    tiny model)."""
    found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [d for d in found if d["engine"] == engine and d["status"] == "ok"
            and d["world_size"] == 1 and not d.get("tiny")]


def gpu_of(line: dict) -> GPU:
    """The GPU of the planner's table that the line's device name names."""
    return next(g for g in GPUS.values() if g.cuda_name in line["device"])


def job_setting(line: dict, file: str = "") -> tuple[Job, Setting]:
    """
    ### A measured line as the planner sees it

    The line's job as `bench.run --plan` builds it (its family's, its kernels
    resolved for a GPU, its optimizer states), at the line's batch and depth, and the
    setting the line ran: one micro-batch, its recomputation, the offloaded
    fraction the engine reported or was given, compiled or not.
    """
    workload = replace(workloads()[line["workload"]], batch=line["batch_per_gpu"],
                       seq=line["seq"],
                       optimizer_states=line.get("optimizer_states", "fp32"),
                       activation_checkpointing=line.get(
                           "activation_checkpointing",
                           workloads()[line["workload"]].activation_checkpointing))
    # a line of `bench.run --layers N` ran the model with its own depth
    workload = replace(workload, model=replace(workload.model,
                                               n_layers=line["model"]["n_layers"]))
    job = job_of(workload, world_size=1, kernels=line["kernels"])
    if file in EVERY_LINEAR_FP8_FILES and job.kernels.fp8:
        job = replace(job, kernels=replace(job.kernels, fp8_every_linear=True))
    # an automatic placement reports what it offloaded; a static one (a
    # planned `--auto` line's `offload`) is the fraction it was given
    given = line.get("offload")
    offloaded = line.get("info", {}).get(
        "offloaded_fraction", given if isinstance(given, float) else 0.0)
    return job, Setting(line["batch_per_gpu"], 1,
                        checkpointing=workload.activation_checkpointing,
                        offload_fraction=offloaded, compile=line["compiled"])


class Prediction(NamedTuple):
    """One measured line beside the planner's two predictions for it."""
    line: dict
    file: str
    budget: Budget
    """The planner's memory budget for the line."""
    step: StepTime
    """The planner's step, term by term."""

    @property
    def memory_gib(self) -> float:
        return self.budget.peak / 2 ** 30

    @property
    def step_s(self) -> float:
        return self.step.total

    @property
    def memory_error(self) -> float:
        return self.memory_gib / self.line["peak_mem_gib"] - 1

    @property
    def step_error(self) -> float:
        return self.step_s / self.line["step_time_mean_s"] - 1


def predict(line: dict, file: str = "") -> Prediction:
    """The planner's peak and step for a line, on its own GPU's data-sheet
    rates and memory."""
    job, setting = job_setting(line, file)
    gpu = gpu_of(line)
    inputs = budget_inputs(job, setting, world_size=1, device_bytes=gpu.memory_bytes)
    # the automatic placement's own chunks, where the line reports them
    offloaded = line.get("info", {}).get("offloaded_chunks")
    budget = memory_budget(replace(inputs, offloaded_chunks=offloaded))
    step = step_time(job, setting, Cluster(gpu), budget)
    return Prediction(line, file, budget, step)


@functools.lru_cache(maxsize=None)
def predictions(root: Path = RESULTS) -> tuple[Prediction, ...]:
    """Every measured line of `MEASURED_FILES`, one per distinct setting and
    file (a repeated line of one file says nothing new); each budget lays a
    model out on the meta device, so the table is made once a process."""
    out, seen = [], set()
    for name in MEASURED_FILES:
        for line in engine_lines(root / name):
            if name in TWIN_UPDATE_FILES and line.get("optimizer_states") in NO_MASTER:
                continue
            key = (name, line["workload"], line["model"]["n_layers"],
                   line["batch_per_gpu"], line["compiled"],
                   line.get("cuda_graph", False), line["kernels"],
                   line.get("optimizer_states", "fp32"),
                   line.get("activation_checkpointing"))
            if key not in seen:
                seen.add(key)
                out.append(predict(line, name))
    return tuple(out)


def _mark(error: float, goal: float) -> str:
    return f"{error:+.1%}" + ("" if abs(error) <= goal else " (missed)")


def prediction_markdown(root: Path = RESULTS) -> str:
    """
    ### The table

    One row per distinct setting of a file; the results page shows it under
    its own heading.
    """
    out = ["", "## The planner's predictions against the measurements", "",
           "For every one-GPU line of labml_zero on the current engine, the "
           "planner's peak device memory and step time for the same setting "
           f"(`python -m bench.predictions`). The goals: the peak within "
           f"{MEMORY_GOAL:.0%} and the step within {STEP_GOAL:.0%}; a row "
           "says where one is missed.", "",
           '<figure class="data">', "",
           "| workload | B | setting | GPU | peak predicted | measured | error "
           "| step predicted | measured | error | file |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in predictions(root):
        line = p.line
        setting = ", ".join(
            ["compiled" if line["compiled"] else "eager"]
            + (["CUDA graph"] if line.get("cuda_graph") else [])
            + (["recomputation"] if line.get("activation_checkpointing") else [])
            + [f"kernels {line['kernels']}"]
            + ([f"{line['optimizer_states']} states"]
               if line.get("optimizer_states", "fp32") != "fp32" else []))
        gpu = "H200" if "H200" in line["device"] else "H100"
        out.append(
            f"| {line['workload']} | {line['batch_per_gpu']} | {setting} | {gpu} "
            f"| {p.memory_gib:.2f} GiB | {line['peak_mem_gib']:.2f} GiB "
            f"| {_mark(p.memory_error, MEMORY_GOAL)} "
            f"| {p.step_s * 1e3:.1f} ms | {line['step_time_mean_s'] * 1e3:.1f} ms "
            f"| {_mark(p.step_error, STEP_GOAL)} | `{p.file}` |")
    return "\n".join(out + ["", "</figure>", ""])


if __name__ == "__main__":
    print(prediction_markdown())
