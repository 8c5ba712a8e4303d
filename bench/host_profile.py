"""
Where the host's time goes in one engine's training step: `cProfile` over timed steps.

One rank (`nccl` on a GPU, else `gloo`), the workload's model and engine as
`bench.run` builds them, five warm-up steps, then `--steps` steps under the
profiler and as many without it (the profiler's own cost inflates Python-heavy
code), each started on an idle device as in `bench.run`. Writes the host time per
step with and without the profiler, Python calls per step, and the functions by
own time and by cumulative time.

    python -m bench.host_profile --workload W4 --engine labml_zero --kernels loss \\
        --out profile_W4.txt
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time
from dataclasses import replace

import torch

from labml_zero import launch
from labml_zero.neox.kernels import ModelKernels


def profile_rank(ctx: launch.DistContext, args: argparse.Namespace) -> None:
    from .engine import random_batches
    from .measure import synchronize
    from .pair import builder
    from .workloads import shrink, workloads

    workload = workloads()[args.workload]
    if args.tiny:
        workload = shrink(workload)
    workload = replace(workload, compile=args.compile,
                       kernels=ModelKernels.from_names(args.kernels))
    built = builder(args.engine)(ctx, workload)
    batches = random_batches(workload, ctx, count=2, seed=0)
    for i in range(5):
        built.step(batches[i % 2])
    synchronize(ctx.device)
    gc.collect()
    gc.freeze()  # as `bench.run` does after its warm-up
    profiler = cProfile.Profile()
    profiled = []
    for i in range(args.steps):
        synchronize(ctx.device)
        start = time.perf_counter()
        profiler.enable()
        built.step(batches[i % 2])
        profiler.disable()
        profiled.append(time.perf_counter() - start)
    plain = []
    for i in range(args.steps):
        synchronize(ctx.device)
        start = time.perf_counter()
        built.step(batches[i % 2])
        plain.append(time.perf_counter() - start)
    synchronize(ctx.device)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    calls = sum(entry[1] for entry in stats.stats.values()) / args.steps
    head = (f"{args.workload} {args.engine} kernels={args.kernels} "
            f"compiled={args.compile}: host per step "
            f"{1e3 * statistics.fmean(plain):.1f} ms (min {1e3 * min(plain):.1f}), "
            f"under cProfile {1e3 * statistics.fmean(profiled):.1f} ms; "
            f"Python calls per step {calls:.0f}\n")
    if ctx.rank == 0:
        with open(args.out, "w") as f:
            f.write(head + text.getvalue())
        print(head, end="")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.host_profile")
    parser.add_argument("--workload", default="W4")
    parser.add_argument("--engine", default="labml_zero")
    parser.add_argument("--kernels", default="none")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true",
                        help="the workload shrunk to a tiny model (CPU smoke test)")
    parser.add_argument("--out", default="host_profile.txt")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    launch.spawn(profile_rank, 1, args)


if __name__ == "__main__":
    main()
