r"""
---
title: Running the benchmark
summary: The benchmark's command line: which pairs of engine and workload run,
  with which settings, one JSON line each and a table at the end.
---

# Running the benchmark

```
python -m bench.run --workloads W1,W2,W3,W4 \
    --engines labml_zero,fsdp2,ddp,deepspeed --steps 10 --warmup 3 \
    --out results.jsonl
```

For each workload, for each engine, [one pair](pair.html) runs in its own group
of processes and prints one JSON line; at the end a Markdown table of all of
them.

`--compile` compiles each transformer layer with `torch.compile` (Inductor on
the GPUs), in ours ([compiled layers](../labml_zero/zero3/compiled.html)) and
in FSDP2 and DDP ([baselines](baselines.html)); every line says `"compiled"`,
and DeepSpeed is skipped. The compilation happens in the first step, so it needs
`--warmup` of at least 1 to stay out of the timing. `--compile both` runs each
engine eagerly and then compiled, one after the other, so that every engine's
best setting is measured in the same run: a comparison of engines is between
their best settings, each named (the [results page](../results.html) picks
them).

`--cuda-graph` records labml_zero's whole step as one CUDA graph after its
warm-up and replays it ([the step as one CUDA
graph](../labml_zero/optimizers/graphed_step.html)); the other engines run eagerly,
and the line says `"cuda_graph"`. On CPU the step's twin re-runs it.

`--optimizer-states fp32,bf16-moments` runs labml_zero (and the one-device
`update_floor`) once per [state layout](../labml_zero/zero3/state_layout.html)
named, the fine-tune's choices, as `--batch` does per batch; its line says
`"optimizer_states"` and its memory model counts that layout's $K$. The other
engines keep fp32 states: they run once, and their lines say `fp32`. An
unknown name stops the command in one line (exit status 2) before anything
starts.

`--plan` prints the setting the fine-tune's planner chooses for labml_zero on
each workload and starts nothing; `--auto` runs labml_zero's line with it and
records the prediction beside the measurement ([the planner's
choice](plan.html)).

`--tiny` shrinks every workload to two layers of width 64 so that the whole
matrix runs in seconds: on CPU (gloo, two processes, `--cpu` where GPUs exist)
it is the smoke test; on the GPUs it is a dry run of every code path, NCCL
included, before the real one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

from labml_zero.llama.config import LlamaConfig
from labml_zero.layers.float8 import check_fp8
from labml_zero.llama.kernels import LlamaKernels, resolve_llama_kernels
from labml_zero.neox.build import resolve_kernels
from labml_zero.neox.kernels import ATTENTION_BACKENDS, ModelKernels

from labml_zero.finetune.planning import (FLAG_DESTS, Request, add_plan_flags,
                                          auto_line, cluster_of, pop_request)
from labml_zero.planner.search import describe as plan_text
from labml_zero.zero3.state_layout import LAYOUTS as STATE_LAYOUTS

from .bounds import BOUNDS
from .plan import BENCH_PINS, applied, plan_workload, planned_fields, pinned_of
from .workloads import GRAPH_WARMUP, Workload, shrink, workloads
from .pair import (COMPILED_ENGINES, ENGINES, GIB, STATE_ENGINES, RunConfig,
                   builder, describe, measure_rank, merge, run_pair, worker)

__all__ = ["ENGINES", "COMPILED_ENGINES", "GIB", "RunConfig", "builder",
           "describe", "measure_rank", "merge", "run_pair", "worker",
           "parse_args", "table", "main"]

# ## Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Tokens/s, MFU, memory and communication share of labml_zero "
        "and its baselines on GPT-NeoX and Llama workloads.",
    )
    parser.add_argument("--workloads", default="W1,W2,W3,W4",
                        help="comma-separated subset of W1,W2,W3,W4,W5,W3R,W6,W2-1,W2-1O,L1,L2")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {','.join(ENGINES)}, "
                        f"or the one-device bounds {','.join(BOUNDS)} "
                        "(bench/bounds.py)")
    parser.add_argument("--batch", default=None,
                        help="comma-separated sequences per GPU, e.g. 2,4,8: each "
                        "workload runs once per value (default: the workload's)")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="every workload's model with N transformer layers, "
                        "the rest of its shape kept: lines at several N split a "
                        "measured peak or step into a part per layer and a fixed "
                        "part (default: the workload's)")
    parser.add_argument("--optimizer-states", default="fp32",
                        help="comma-separated state layouts of labml_zero's "
                        f"optimizer, from {','.join(STATE_LAYOUTS)}: each "
                        "workload runs once per name (update_floor keeps the "
                        "same; the other engines keep fp32)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes; default: every GPU, or 2 on CPU")
    parser.add_argument("--tiny", action="store_true",
                        help="shrink every workload to a tiny model (CPU smoke test)")
    parser.add_argument("--cpu", action="store_true",
                        help="run on CPU with gloo even where GPUs exist")
    parser.add_argument("--compile", nargs="?", const="yes", default="no",
                        choices=("no", "yes", "both"),
                        help="torch.compile each transformer layer "
                        f"({', '.join(COMPILED_ENGINES)}; others are skipped); "
                        "'both' runs every pair eagerly and then compiled")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="labml_zero replays its whole step as one CUDA graph "
                        f"(needs --warmup >= {GRAPH_WARMUP + 1}: "
                        f"{GRAPH_WARMUP} eager steps, then the capture)")
    parser.add_argument("--recompute", default=None, choices=("no", "yes"),
                        help="every workload with (yes) or without (no) "
                        "activation recomputation, where labml_zero's under "
                        "--auto is pinned to it (default: the workload's, or "
                        "the planner's choice)")
    parser.add_argument("--prefetch-depth", type=int, default=1,
                        help="labml_zero's units gathered ahead (default 1)")
    parser.add_argument("--peer-gather", action="store_true",
                        help="labml_zero gathers by copying from the peers' "
                        "memory (copy engines) instead of NCCL's all-gather")
    parser.add_argument("--peer-reduce", action="store_true",
                        help="labml_zero reduce-scatters through the peers' memory "
                        "(bf16 sent, fp32 sums) instead of NCCL's reduce-scatter")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the profiled step (no communication share)")
    parser.add_argument("--trace-dir", default=None,
                        help="keep rank 0's profiled-step Chrome trace of each "
                        "pair here (input of bench.timeline)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="process-group timeout in seconds")
    parser.add_argument("--host-reserve-gib", type=float, default=8.0,
                        help="end a pair as host OOM below this much available "
                        "host memory")
    parser.add_argument("--kernels", default="none",
                        help="the model's fused kernels, comma-separated from "
                        f"{','.join(ModelKernels.fusions())} (GPT-NeoX) or "
                        f"{','.join(LlamaKernels.fusions())} (Llama), or all, "
                        "none, or auto (all on the GPUs, none on CPU, as the job); "
                        "fp8 (never in auto; auto,fp8 adds it) runs the layers' "
                        "large linears in fp8 (GPUs of compute capability >= 8.9, torchao)")
    parser.add_argument("--attention", default=None,
                        help="pin the attention backend: "
                        f"{', '.join(ATTENTION_BACKENDS)} (default: PyTorch's choice)")
    parser.add_argument("--host-watch-s", type=float, default=None,
                        help="seconds between host-memory samples (default 0.1 "
                        "with offload, 1.0 without)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave the objects alive after the warm-up to the "
                        "garbage collector's walks")
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    # the fine-tune's --plan/--auto and its cluster flags (bench/plan.py)
    add_plan_flags(parser)
    return parser


def given_flags(argv: list[str] | None) -> set[str]:
    """The destinations of the flags on the command line: a second parse with
    every default suppressed leaves only those."""
    quiet = build_parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.given = given_flags(argv)

    known = workloads()
    args.workload_list = split_names(args.workloads, known, "--workloads")
    args.engine_list = split_names(args.engines, ENGINES + BOUNDS, "--engines")
    args.states_list = split_states(args.optimizer_states)
    try:
        args.request = plan_request(args)
    except ValueError as error:
        raise SystemExit(str(error))
    args.batch_list = [None] if args.batch is None else split_batches(args.batch)
    args.compile_modes = {"no": [False], "yes": [True],
                          "both": [False, True]}[args.compile]
    args.compile = True in args.compile_modes
    if args.compile and args.warmup < 1:
        raise SystemExit("--compile needs --warmup >= 1: the first step compiles")
    if args.cuda_graph and args.warmup < GRAPH_WARMUP + 1:
        raise SystemExit(f"--cuda-graph needs --warmup >= {GRAPH_WARMUP + 1}: "
                         f"{GRAPH_WARMUP} eager steps, then the capture")
    # Recomputation is known before the start; a shard placed in host memory
    # only once the placement has measured, and GraphedStep refuses it then.
    recomputed = [name for name in args.workload_list
                  if (known[name].activation_checkpointing
                      if args.recompute is None else args.recompute == "yes")]
    # under --plan and --auto labml_zero's recomputation is the planner's,
    # pinned off
    if (args.cuda_graph and "labml_zero" in args.engine_list and recomputed
            and args.request.mode is None):
        raise SystemExit(f"--cuda-graph: workload {recomputed[0]} recomputes its "
                         "activations, which the graph does not capture")
    if args.prefetch_depth < 0:
        raise SystemExit(f"--prefetch-depth must be >= 0, got {args.prefetch_depth}")
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {args.layers}")
    try:
        # `auto` as the job resolves it: every fusion on the GPUs, none on CPU
        device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
        listed = [known[name].model for name in args.workload_list]
        args.model_kernels, args.llama_kernels = family_kernels(
            args.kernels, args.attention, device, listed)
        # labml_zero's under --auto: the job's `auto` unless --kernels is given
        args.auto_kernels = args.kernels if "kernels" in args.given else "auto"
        args.auto_model_kernels, args.auto_llama_kernels = family_kernels(
            args.auto_kernels, args.attention, device, listed)
    except ValueError as error:
        raise SystemExit(f"--kernels/--attention: {error}")
    return args


def family_kernels(names: str, attention: str | None, device: str, listed: list):
    """Each family's kernels named by `names`, resolved for the workloads
    listed of it (`None` for a family none is of); fp8 refused here, before
    any pair starts, where it cannot run."""
    model_kernels = llama_kernels = None
    if any(not isinstance(m, LlamaConfig) for m in listed):
        model_kernels = replace(resolve_kernels(names, device), attention=attention)
    if any(isinstance(m, LlamaConfig) for m in listed):
        if attention is not None:
            raise ValueError("Llama's attention backend is PyTorch's choice")
        llama_kernels = resolve_llama_kernels(names, device)
    for kernels in (model_kernels, llama_kernels):
        check_fp8(kernels, device)
    return model_kernels, llama_kernels


def plan_request(args: argparse.Namespace) -> Request:
    """
    ### `--plan`/`--auto` and the cluster's flags, taken off `args`

    The benchmark has no gradient accumulation: its global batch is `--batch`
    times the ranks, never `--global-batch`; `--auto` plans labml_zero's line,
    which must be one of `--engines`.
    """
    flags = {name: getattr(args, name) for name in FLAG_DESTS if hasattr(args, name)}
    for name in flags:
        delattr(args, name)
    request = pop_request(flags)
    if "global_batch" in request.cluster:
        raise ValueError("bench.run: the global batch is --batch x ranks (no "
                         "gradient accumulation); give --batch, not --global-batch")
    if request.mode == "auto" and "labml_zero" not in args.engine_list:
        raise ValueError("--auto runs the planner's setting on labml_zero's line; "
                         "add labml_zero to --engines")
    return request


def split_names(value: str, known, flag: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown or empty {unknown or value!r}; "
                         f"choose from {','.join(known)}")
    return names


def split_states(value: str) -> list[str]:
    """The state layouts named, each once, in order; an unknown or empty
    name is refused in one line with exit status 2, before anything starts."""
    names = list(dict.fromkeys(n.strip() for n in value.split(",")))
    unknown = [name for name in names if name not in STATE_LAYOUTS]
    if unknown or not value.strip():
        print(f"bench.run: --optimizer-states: unknown or empty "
              f"{unknown or value!r}; choose from {','.join(STATE_LAYOUTS)}",
              file=sys.stderr, flush=True)
        raise SystemExit(2)
    return names


def split_batches(value: str) -> list[int]:
    try:
        batches = [int(b) for b in value.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batch: expected comma-separated integers >= 1, "
                         f"got {value!r}")
    return batches


def table(lines: list[dict]) -> str:
    """A markdown summary of the lines, for the README."""
    rows = ["| workload | engine | tok/s | step s | MFU | peak GiB | model GiB "
            "| predicted GiB | host GiB | comm exposed | loss |", "|" + " --- |" * 11]
    for r in lines:
        # a layout other than fp32 named beside the engine that kept it
        states = r.get("optimizer_states", "fp32")
        engine = r["engine"] + ("" if states == "fp32" else f" ({states})")
        if r["status"] != "ok":
            reason = r.get("error") or r.get("reason") or ""
            rows.append(f"| {r['workload']} | {engine} | {r['status']}: "
                        f"{reason[:60]} | | | | | | | | |")
            continue
        peak = "—" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        analytic = r["memory_model_gib"]
        model = analytic.get("layout_states", analytic["zero_states"])
        # a planned line's prediction is the planner's, which it ran on
        predicted = r.get("planned_peak_gib", analytic.get("predicted_peak"))
        exposed = r.get("comm_exposed")
        share = "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        rows.append(
            f"| {r['workload']} | {engine} | {r['tokens_per_s']:,.0f} "
            f"| {r['step_time_mean_s']:.3f} | {share} | {peak} "
            f"| {model:.1f} | "
            + ("—" if predicted is None else f"{predicted:.1f}")
            + f" | {r['host_rss_peak_gib']:.1f} | "
            + ("—" if exposed is None else f"{100 * exposed:.1f}%")
            + ("" if r.get("comm_exposed_transfer") is None
               else f" ({100 * r['comm_exposed_transfer']:.1f}% transfer)")
            + f" | {r['loss'] if r['loss'] is None else round(r['loss'], 3)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    run = RunConfig(steps=args.steps, warmup=args.warmup,
                    profile=not args.no_profile, trace_dir=args.trace_dir,
                    host_reserve_gib=args.host_reserve_gib,
                    gc_freeze=not args.no_gc_freeze,
                    host_watch_s=args.host_watch_s)
    cuda = torch.cuda.is_available() and not args.cpu
    backend = "nccl" if cuda else "gloo"
    world_size = args.world_size or (torch.cuda.device_count() if cuda else 2)
    bounds = [engine for engine in args.engine_list if engine in BOUNDS]
    if bounds and world_size != 1:
        raise SystemExit(f"--engines {bounds[0]}: the bounds run on one device; "
                         f"pass --world-size 1, not {world_size}")
    known = workloads()
    mode = args.request.mode
    # `--compile` given pins it; else the planner chooses (one labml_zero line)
    planned_compile = (args.compile_modes if "compile" in args.given else [None])

    def given_workload(name: str, batch: int | None, compiled: bool | None,
                       states: str = "fp32", *, auto: bool = False) -> Workload:
        workload = shrink(known[name]) if args.tiny else known[name]
        if args.layers is not None:
            workload = replace(workload, model=replace(workload.model,
                                                       n_layers=args.layers))
        llama = isinstance(workload.model, LlamaConfig)
        kernels = ((args.auto_llama_kernels if llama else args.auto_model_kernels)
                   if auto else
                   (args.llama_kernels if llama else args.model_kernels))
        if args.recompute is not None:
            workload = replace(workload,
                               activation_checkpointing=args.recompute == "yes")
        return replace(workload, compile=bool(compiled),
                       cuda_graph=args.cuda_graph,
                       prefetch_depth=args.prefetch_depth,
                       peer_gather=args.peer_gather,
                       peer_reduce=args.peer_reduce, kernels=kernels,
                       batch=workload.batch if batch is None else batch,
                       optimizer_states=states)

    plans = {}
    if mode is not None:
        # every plan made, and every refusal said, before any pair starts
        plan_world = world_size if mode == "auto" else args.world_size
        try:
            cluster = cluster_of(args.request, plan_world)
            # the layout is the user's, as the job's --optimizer-states: the
            # planner plans with it and never chooses it
            for name, batch, states, compiled in (
                    (name, batch, states, compiled)
                    for name in args.workload_list for batch in args.batch_list
                    for states in args.states_list
                    for compiled in planned_compile):
                workload = given_workload(name, batch, compiled, states,
                                          auto=True)
                given = {flag: value for flag, value in (
                    ("batch", workload.batch), ("compile", compiled),
                    ("prefetch_depth", args.prefetch_depth),
                    ("recompute", args.recompute == "yes"))
                    if flag in args.given}
                chosen = plan_workload(
                    workload, cluster,
                    pinned_of(workload, given, cuda_graph=args.cuda_graph),
                    kernels=args.auto_kernels)
                if (mode == "auto" and chosen.best.setting.compile
                        and run.warmup < 1):
                    raise ValueError(
                        f"--auto: the planner compiles workload {name}'s "
                        f"layers, which needs --warmup >= 1 (or pin "
                        f"--compile no)")
                plans[name, batch, states, compiled] = (workload, chosen)
        except ValueError as error:
            raise SystemExit(str(error))
        kept = [f"--{flag.replace('_', '-')}" for flag in BENCH_PINS
                if flag in args.given]
        for (name, _, states, _), (_, chosen) in plans.items():
            kept_states = "" if states == "fp32" else f", {states} states"
            if mode == "plan":
                print(plan_text(chosen,
                                model_name=f"{name} (labml_zero{kept_states})"),
                      flush=True)
            else:
                print(f"{name}{kept_states}: {auto_line(chosen, kept)}",
                      flush=True)
        if mode == "plan":
            return []
    lines = []
    # an engine's eager and compiled runs side by side, in the same lease;
    # under --auto, labml_zero's compilation is the planner's unless given;
    # an engine that keeps fp32 states whatever is named runs once, as fp32
    pairs = [(name, batch, engine, states, compiled)
             for name in args.workload_list
             for batch in args.batch_list for engine in args.engine_list
             for states in (args.states_list if engine in STATE_ENGINES
                            else ["fp32"])
             for compiled in (planned_compile
                              if mode == "auto" and engine == "labml_zero"
                              else args.compile_modes)]
    for name, batch, engine, states, compiled in pairs:
        planned = mode == "auto" and engine == "labml_zero"
        if planned:
            workload, chosen = plans[name, batch, states, compiled]
            workload = applied(workload, chosen)
        else:
            workload = given_workload(name, batch, compiled, states)
        result = run_pair(engine, workload, run, world_size=world_size,
                          backend=backend, timeout_s=args.timeout)
        result["tiny"] = args.tiny
        if planned:
            result.update(planned_fields(chosen))
        lines.append(result)
        text = json.dumps(result)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    print(table(lines), flush=True)
    return lines


def command(argv: list[str] | None = None) -> None:
    """`python -m bench.run`: a refused input (every `SystemExit` with a
    message is one, raised before anything starts) is one line on stderr and
    exit status 2, as argparse's own refusals."""
    try:
        main(argv)
    except SystemExit as refusal:
        if not isinstance(refusal.code, str):
            raise
        print(f"bench.run: error: {refusal.code}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    command()
