r"""
---
title: The planner's choice, run by the benchmark
summary: `bench.run --plan` prints the setting the fine-tune's planner chooses
  for each workload; `--auto` runs labml_zero's line with it and records the
  prediction beside the measurement.
---

# The planner's choice, run by the benchmark

The fine-tune's `--plan` and `--auto` ([the fine-tune's
plan](../labml_zero/finetune/planning.html)) ask [the
planner](../labml_zero/planner/index.html) for the fastest setting that fits.
The benchmark asks the same planner the same question for labml_zero on each
workload, so that the choice can be measured and set beside a grid of the
settings it did not choose.

A workload fixes its sequences a GPU $B$; the benchmark has no gradient
accumulation, so the planner's global batch is

$$G = B \cdot N_d, \qquad A = 1,$$

$A$ pinned: the planner chooses recomputation, the offloaded share of the
optimizer state, the prefetch depth and compilation; its chunk size is the
search's. The kernels are the job's: `auto` (every fusion of the family on
the GPUs) unless `--kernels` is given.

`--plan` prints, for each workload, `--batch` and `--optimizer-states`, the
job's lines (setting, device and host memory, step time term by term,
tokens/s, MFU) and starts no process. `--auto` runs labml_zero's line with the choice (`applied`) and adds
to it `"auto": true`, the setting, and the prediction as `planned_peak_gib`,
`planned_step_s`, `planned_tokens_per_s`, `planned_mfu`; the other engines
run the workload as given. Flags given win, as in the job: `--batch`,
`--compile`, `--prefetch-depth`, `--kernels`; `--cuda-graph` pins one
micro-batch, no recomputation and no offload, as the job's recorded step does.

## Limitations

* A `--tiny` workload keeps its fixed chunk size (the search's grid is made for
  real widths), so its plan's chunk is not the one that runs; the plan is for
  the named GPU, the run on CPU.
* The planner models neither resident frozen chunks (W3R), which are refused,
  nor the peer-memory transfers (`--peer-gather`, `--peer-reduce`), which run
  as given.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from labml_zero.families import family_for_config
from labml_zero.planner.devices import GIB, Cluster
from labml_zero.planner.search import NoFit, Pinned, Plan, plan
from labml_zero.planner.setting import Job, gpu_kernels

from .workloads import Workload

__all__ = ["BENCH_PINS", "job_of", "pinned_of", "plan_workload", "applied",
           "planned_fields"]

# The benchmark's flags that pin a knob of the setting → the planner's pin.
BENCH_PINS = {"batch": "batch", "compile": "compile",
              "prefetch_depth": "prefetch_depth", "recompute": "checkpointing"}


def job_of(workload: Workload, *, world_size: int, kernels: str) -> Job:
    """
    ## The planner's job of a workload

    bf16 chunks, the workload's optimizer state layout (`--optimizer-states`,
    fp32 unless named: the planner plans with the layout given, as the job's
    `--plan` does, and never chooses one), no clipping nor loss scaling (so
    every shard is updated during the backward pass, as [our
    engine](engine.html) builds it); `kernels` named as the job's `--kernels`.
    """
    family = family_for_config(workload.model)
    return Job(model=workload.model, family=family, seq=workload.seq,
               global_batch=workload.batch * world_size,
               finetune=workload.finetune, states=workload.optimizer_states,
               param_dtype="bf16",
               kernels=gpu_kernels(family, kernels),
               update_during_backward=True)


def pinned_of(workload: Workload, given: dict[str, Any], *,
              cuda_graph: bool) -> Pinned:
    """
    ## The knobs kept: one micro-batch always, and the flags given

    `given` maps the benchmark's setting flags the user gave (`BENCH_PINS`) to
    this line's value of each.
    """
    pins: dict[str, Any] = {"batch": workload.batch, "micro_batches": 1}
    pins.update({BENCH_PINS[name]: value for name, value in given.items()})
    if cuda_graph:
        # a recorded step: nothing recomputed or offloaded
        pins.update(checkpointing=False, offload_fraction=0.0)
    return Pinned(**pins)


def plan_workload(workload: Workload, cluster: Cluster, pinned: Pinned, *,
                  kernels: str) -> Plan:
    """The planner's choice; a workload it cannot plan, or one nothing fits,
    is a `ValueError` of one line naming the workload."""
    if workload.resident:
        raise ValueError(f"workload {workload.name}: the planner does not model "
                         f"resident frozen chunks; run it without --plan/--auto")
    try:
        return plan(job_of(workload, world_size=cluster.world_size,
                           kernels=kernels), cluster, pinned)
    except NoFit as e:
        raise ValueError(f"workload {workload.name}: {e}") from None


def applied(workload: Workload, result: Plan) -> Workload:
    """
    ## The workload labml_zero runs under `--auto`

    The setting's knobs replace the workload's (its recomputation and offload
    too: W2-1's recomputation is the planner's to keep or drop); a fixed chunk
    size (`--tiny`) stays.
    """
    s = result.best.setting
    return replace(workload, batch=s.batch,
                   activation_checkpointing=s.checkpointing,
                   offload=s.offload_fraction or None,
                   prefetch_depth=s.prefetch_depth, compile=s.compile,
                   chunk_numel=(workload.chunk_numel
                                or result.best.budget.chunk_numel))


def planned_fields(result: Plan) -> dict[str, Any]:
    """
    ## What the line records beside the measurement

    The prediction is for `planned_for`, the named cluster: on another device
    (a `--tiny` run on CPU) only the setting is comparable.
    """
    s, b = result.best.setting, result.best.budget
    return {
        "auto": True,
        "planned_for": result.cluster.describe(),
        "planned_setting": {
            "batch": s.batch, "micro_batches": s.micro_batches,
            "activation_checkpointing": s.checkpointing,
            "offload_fraction": s.offload_fraction,
            "prefetch_depth": s.prefetch_depth, "compile": s.compile,
            "chunk_numel": b.chunk_numel,
            "kernels": result.job.kernels.names()},
        "planned_flags": s.flags(),
        "planned_peak_gib": b.peak / GIB,
        "planned_host_gib": result.best.host_bytes / GIB,
        "planned_step_s": result.best.time.total,
        "planned_tokens_per_s": result.tokens_per_s,
        "planned_mfu": result.mfu,
    }
