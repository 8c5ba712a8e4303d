"""
---
title: Benchmark
summary: labml_zero against FSDP2, DDP and DeepSpeed ZeRO-3 on GPT-NeoX workloads.
---

# Benchmark

Tokens per second, MFU, peak memory beside the analytic memory model, and the
share of a step spent waiting on communication, for each engine and workload.
See `bench/README.md` for the command and the table.

Pages, in reading order:

* [Workloads](workloads.html): the four jobs and the FLOPs a token costs.
* [Engine](engine.html): what an engine hands the benchmark, and ours.
* [Baselines](baselines.html): FSDP2, DDP and DeepSpeed ZeRO-3.
* [Measure](measure.html): step time, memory, communication share.
* [One pair](pair.html): an engine and a workload in their own processes,
  failures as lines.
* [Run](run.html): the command line.
* [The planner's choice](plan.html): `--plan` and `--auto`, the fine-tune's
  planner asked for labml_zero's setting of each workload.
"""
