r"""
---
title: One benchmark pair
summary: An (engine, workload) pair in its own group of processes, each rank
  measured, the ranks' records merged into one JSON line; failures as lines.
---

# One benchmark pair

`run_pair(engine, workload, run, ...)` is what [the command
line](run.html) calls for each pair. The parent process spawns one process per
GPU ([`launch.spawn`](../labml_zero/launch/spawn.html)), and each of them

1. builds the engine (timed as `init_s`),
2. runs `warmup` untimed and `steps` timed training steps
   ([measure](measure.html)), the GPU's clock and power sampled over the timed
   ones ([gpu_clocks](gpu_clocks.html)),
3. runs one more step under the profiler to measure communication,
4. writes its own record to a file.

The parent merges the ranks' records into one JSON line: step time is the
slowest rank's mean, memory the largest rank's peak, the loss the mean over
ranks. Then the processes are gone, with their memory, NCCL communicators and
CUDA contexts, before the next pair starts: one engine's out-of-memory error
cannot disturb the next.

## Failures

* **Out of memory** (`torch.OutOfMemoryError`, in the build or in a step): the
  rank writes `"status": "oom"` and ends its process at once with `os._exit(1)`,
  skipping the process group's teardown, which could block on the other rank;
  `torch.multiprocessing` then ends the other rank. The line says where.
* **Out of host memory**: every rank runs a [watchdog](host_memory.html) that
  does the same, with `"where": "host"`, when the host has less than
  `--host-reserve-gib` available (offloading engines on W5), before the
  kernel's out-of-memory killer would pick a process.
* **Engine unavailable** (DeepSpeed or torchao not installed): `"status":
  "skipped"` with the reason; no process is spawned if the module cannot even
  be found.
* **Anything else**: `"status": "error"` with the last line of the traceback; the
  remaining pairs still run.

## Limitations

* One process per GPU of one host; no multi-node runs.
* A rank that hangs (rather than fails) blocks the run until the process
  group's timeout (`--timeout`, seconds) ends it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labml_zero import launch

from .bounds import BOUNDS, unavailable
from .gpu_clocks import CLOCK_FIELDS, ClockWatch, gpu_id
from .host_memory import HostMemoryWatch, exit_on_exhausted, rss_peak
from .workloads import Workload, mfu

ENGINES = ("labml_zero", "fsdp2", "fsdp2_float8", "ddp", "deepspeed")
# the engines whose builders honour `workload.compile`
COMPILED_ENGINES = ("labml_zero", "fsdp2", "fsdp2_float8", "ddp")
# the engines that keep the optimizer state layout `--optimizer-states` names;
# every other keeps fp32 master weights and moments, and its line says "fp32"
STATE_ENGINES = ("labml_zero", "update_floor")
# the engines whose matrix products always run in fp8 (labml_zero's do with
# `--kernels fp8`): their lines also have `mfu_fp8`
FP8_ENGINES = ("fsdp2_float8",)
# an optional engine's module: without it the pair is skipped, no process spawned
OPTIONAL_MODULES = {"deepspeed": "deepspeed", "fsdp2_float8": "torchao"}
GIB = 2**30


@dataclass(frozen=True)
class RunConfig:
    """
    ## Settings shared by every pair
    """

    steps: int = 10
    """Timed steps; the mean and standard deviation are over these."""
    warmup: int = 3
    """Untimed steps before them."""
    profile: bool = True
    """Profile one extra step for the communication share."""
    seed: int = 0
    """Initialisation seed (the same on every rank) and data seed (plus rank)."""
    trace_dir: str | None = None
    """Keep rank 0's profiler trace here, as `trace_<workload>_<engine>_b<batch>.json`
    (the input of [the kernel summary](kernels.html) and the timeline)."""
    host_reserve_gib: float = 8.0
    """End the run as out of memory when the host has less than this available
    ([host memory](host_memory.html))."""
    host_watch_s: float | None = None
    """Seconds between the host-memory watchdog's samples (`--host-watch-s`);
    `None`: 0.1 for workloads that offload to the host, 1.0 otherwise. The
    watchdog is a Python thread: each sample takes the interpreter lock from
    the main thread, which then waits up to the switch interval (5 ms) to get
    it back, so a host-bound step sees every sample."""
    gc_freeze: bool = True
    """Freeze the objects alive after the warm-up out of the garbage
    collector's walks ([measure](measure.html)); `--no-gc-freeze` turns it off."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.host_watch_s is not None and self.host_watch_s <= 0:
            raise ValueError(f"host_watch_s must be > 0, got {self.host_watch_s}")
        if self.host_reserve_gib < 0:
            raise ValueError(f"host_reserve_gib must be >= 0, got "
                             f"{self.host_reserve_gib}")


def builder(engine: str):
    """The builder function of `engine` (imported late: each pulls its own deps)."""
    from . import baselines, bounds, engine as ours, float8_peer

    if engine in BOUNDS:
        return lambda ctx, workload: bounds.build_bound(engine, ctx, workload)
    return {
        "labml_zero": ours.build_labml_zero,
        "fsdp2": baselines.build_fsdp2,
        "fsdp2_float8": float8_peer.build_fsdp2_float8,
        "ddp": baselines.build_ddp,
        "deepspeed": baselines.build_deepspeed,
    }[engine]


# ## One rank


def measure_rank(ctx: launch.DistContext, engine: str, workload: Workload,
                 run: RunConfig, progress: dict) -> dict:
    """
    ### Build, time and profile one engine on this rank

    Returns this rank's record; `progress["phase"]` says how far it got, for the
    report of a failure.
    """
    from .engine import random_batches
    from .measure import peak_memory, profile_comm, time_steps

    progress["phase"] = "build"
    torch.manual_seed(run.seed)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    start = time.perf_counter()
    built = builder(engine)(ctx, workload)
    init_s = time.perf_counter() - start
    # device memory the caching allocator does not count (peer memory)
    uncounted = built.uncounted_device_bytes
    build_peak = peak_memory(ctx.device, uncounted=uncounted)
    batches = random_batches(workload, ctx, count=2, seed=run.seed)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    if built.counter is not None:
        built.counter.reset()
    progress["phase"] = "train"
    # only rank 0's GPU is sampled: its fields are the line's (see `merge`)
    with ClockWatch(gpu_id(ctx.device) if ctx.rank == 0 else None) as clocks:
        timed = time_steps(built.step, batches, warmup=run.warmup, steps=run.steps,
                           device=ctx.device, gc_freeze=run.gc_freeze)
    train_peak = peak_memory(ctx.device, uncounted=uncounted)
    steps_run = run.warmup + run.steps
    if built.measured_report is not None and ctx.rank == 0:
        print("\n".join(built.measured_report(steps_run)), flush=True)
    record = {
        # Asked here, not in the parent: a CUDA context in the parent would hold
        # memory on GPU 0 for the whole run.
        "device": (torch.cuda.get_device_name(ctx.device)
                   if ctx.device.type == "cuda" else "cpu"),
        "init_s": init_s,
        "step_mean_s": timed.mean_s,
        "step_std_s": timed.std_s,
        "step_times_s": list(timed.times_s),
        "host_s": list(timed.host_s),
        "gc_collections": timed.gc_collections,
        "gc_ms": timed.gc_ms,
        "loss": timed.loss,
        "peak_build": build_peak,
        "peak_train": train_peak,
        "host_rss_peak": rss_peak(),
        "memory_model": built.memory_model,
        "memory_formula": built.memory_formula,
        "psi_trainable": built.psi_trainable,
        "psi_frozen": built.psi_frozen,
        "info": built.info,
        **(clocks.during(*timed.wall_window) or {}),
    }
    if built.counter is not None:
        record["comm_bytes_per_step"] = {
            kind: nbytes // steps_run for kind, nbytes in built.counter.bytes.items()
        }
    if run.profile:
        progress["phase"] = "profile"
        keep = None
        if run.trace_dir and ctx.rank == 0:
            keep = os.path.join(run.trace_dir, f"trace_{workload.name}_{engine}"
                                f"_b{workload.batch}.json")
        share = profile_comm(built.step, batches[0], device=ctx.device,
                             keep_trace=keep, exchange=exchange_objects)
        record.update(comm_total=share.comm_total, comm_exposed=share.comm_exposed,
                      comm_exposed_transfer=share.comm_exposed_transfer,
                      gpu_idle=share.gpu_idle, profiled_step_s=share.step_s,
                      device_ops=share.device_ops)
    return record


def exchange_objects(mine: dict) -> list[dict]:
    """Every rank's `mine`, in rank order (an all-gather of Python objects)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def worker(ctx: launch.DistContext, engine: str, workload: Workload, run: RunConfig,
           out_dir: str) -> None:
    """
    ### The body of each spawned process

    Writes `rank<r>.json` into `out_dir`; see Failures above.
    """
    from .baselines import EngineUnavailable

    path = os.path.join(out_dir, f"rank{ctx.rank}.json")
    progress = {"phase": "start"}
    exhausted = exit_on_exhausted(lambda record: write_json(
        path, {**record, "phase": progress["phase"], "rank": ctx.rank}))
    interval = run.host_watch_s or (0.1 if workload.offload else 1.0)
    watch = HostMemoryWatch(reserve=int(run.host_reserve_gib * GIB),
                            on_exhausted=exhausted, interval_s=interval)
    try:
        with watch:
            record = {"status": "ok",
                      **measure_rank(ctx, engine, workload, run, progress)}
        record["host_used_peak"] = watch.used_peak
    except torch.OutOfMemoryError as error:
        write_json(path, {"status": "oom", "phase": progress["phase"],
                          "rank": ctx.rank, "error": first_line(error)})
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a return: the teardown of the process group may wait on the peer.
        os._exit(1)
    except EngineUnavailable as error:
        record = {"status": "skipped", "reason": str(error)}
    write_json(path, record)
    end_process()


def end_process() -> None:
    """
    #### End a rank whose record is written, without the interpreter's teardown

    After the work is done, a gloo rank sometimes aborts as its process exits,
    in the C++ teardown after the interpreter's, with no Python frame left
    ("terminate called without an active exception"; more often on a loaded
    host), which the launcher reports as a rank dead by `SIGABRT`. So the
    rank destroys its process group, flushes its output and ends here, as
    the engine's distributed tests do (`tests/distributed.py`). Without a
    process group this is no spawned rank (a test calling `worker` in its own
    process), and it returns.
    """
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_json(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# ## The parent: one pair


def describe(engine: str, workload: Workload, world_size: int, backend: str) -> dict:
    model = workload.model
    return {
        "engine": engine,
        "workload": workload.name,
        "world_size": world_size,
        "backend": backend,
        "torch": torch.__version__,
        "batch_per_gpu": workload.batch,
        "seq": workload.seq,
        "finetune": workload.finetune,
        "compiled": workload.compile,
        "activation_checkpointing": workload.activation_checkpointing,
        "offload": workload.offload,
        "cuda_graph": workload.cuda_graph and engine == "labml_zero",
        "prefetch_depth": workload.prefetch_depth,
        "peer_gather": workload.peer_gather,
        "peer_reduce": workload.peer_reduce,
        "kernels": ("none" if engine == "deepspeed" else workload.kernels.names()),
        "optimizer_states": (workload.optimizer_states
                             if engine in STATE_ENGINES else "fp32"),
        "attention": getattr(workload.kernels, "attention", None),
        "model": {"n_layers": model.n_layers, "d_model": model.d_model,
                  "n_heads": model.n_heads, "n_vocab": model.n_vocab},
    }


def computes_in_fp8(engine: str, workload: Workload) -> bool:
    """Whether the line's matrix products run in fp8: the fp8 peer's always,
    labml_zero's with the `fp8` kernel."""
    return engine in FP8_ENGINES or bool(getattr(workload.kernels, "fp8", False))


def merge(line: dict, records: list[dict], workload: Workload, world_size: int,
          run: RunConfig) -> dict:
    """One line from the ranks' records (see the introduction)."""
    statuses = [r["status"] for r in records]
    for status in ("oom", "skipped"):
        if status in statuses:
            bad = next(r for r in records if r["status"] == status)
            return {**line, **bad}
    if len(records) < world_size:
        return {**line, "status": "error",
                "error": f"{len(records)} of {world_size} ranks wrote a result"}

    step_s = max(r["step_mean_s"] for r in records)
    tokens_per_s = world_size * workload.tokens_per_gpu / step_s
    losses = [r["loss"] for r in records]
    finite = all(math.isfinite(x) for x in losses)
    first = records[0]
    peaks = [r["peak_train"] for r in records]
    build_peaks = [r["peak_build"] for r in records]
    host_used = [r.get("host_used_peak") for r in records]
    merged = {
        **line,
        "status": "ok",
        "device": first["device"],
        "steps": run.steps,
        "warmup": run.warmup,
        "tokens_per_s": tokens_per_s,
        "step_time_mean_s": step_s,
        "step_time_std_s": max(r["step_std_s"] for r in records),
        # rank 0's: each step's time, the host's issue time of each
        "step_times_s": first["step_times_s"],
        "host_s": first["host_s"],
        "host_s_mean": sum(first["host_s"]) / len(first["host_s"]),
        "gc_collections": max(r["gc_collections"] for r in records),
        "gc_ms": max(r["gc_ms"] for r in records),
        # rank 0's GPU (gpu_clocks): absent where nothing was sampled
        **{key: first[key] for key in CLOCK_FIELDS if key in first},
        "mfu": mfu(workload, tokens_per_s, world_size, first["device"]),
        # the same FLOPs over the dense fp8 peak, for the engines computing in fp8
        **({"mfu_fp8": mfu(workload, tokens_per_s, world_size, first["device"],
                           dtype=torch.float8_e4m3fn)}
           if computes_in_fp8(line["engine"], workload) else {}),
        "init_s": max(r["init_s"] for r in records),
        "psi_trainable": first["psi_trainable"],
        "psi_frozen": first["psi_frozen"],
        # JSON has no NaN: a non-finite loss is null, with loss_finite false.
        "loss": sum(losses) / len(losses) if finite else None,
        "loss_finite": finite,
        "peak_mem_gib": None if None in peaks else max(peaks + build_peaks) / GIB,
        "peak_mem_train_gib": None if None in peaks else max(peaks) / GIB,
        "peak_mem_build_gib": None if None in build_peaks else max(build_peaks) / GIB,
        "host_rss_peak_gib": max(r["host_rss_peak"] for r in records) / GIB,
        "host_used_peak_gib": None if None in host_used else max(host_used) / GIB,
        "memory_model_gib": {k: v / GIB for k, v in first["memory_model"].items()},
        "memory_formula": first["memory_formula"],
        **({"info": first["info"]} if first["info"] else {}),
    }
    if "comm_bytes_per_step" in first:
        merged["comm_bytes_per_step"] = first["comm_bytes_per_step"]
    if run.profile:
        merged["comm_exposed"] = max(r["comm_exposed"] for r in records)
        merged["comm_total"] = max(r["comm_total"] for r in records)
        idle = [r["gpu_idle"] for r in records]
        merged["gpu_idle"] = None if None in idle else max(idle)
        transfer = [r["comm_exposed_transfer"] for r in records]
        merged["comm_exposed_transfer"] = None if None in transfer else max(transfer)
        merged["device_ops"] = first.get("device_ops")
    return merged


def run_pair(engine: str, workload: Workload, run: RunConfig, *, world_size: int,
             backend: str, timeout_s: float) -> dict:
    """Spawn `world_size` processes for one (engine, workload); return its line."""
    line = describe(engine, workload, world_size, backend)
    if workload.compile and engine not in COMPILED_ENGINES:
        return {**line, "status": "skipped",
                "reason": f"--compile is implemented for "
                f"{', '.join(COMPILED_ENGINES)} only"}
    if engine in BOUNDS:
        if (reason := unavailable(engine, workload)) is not None:
            return {**line, "status": "skipped", "reason": reason}
    module = OPTIONAL_MODULES.get(engine)
    if module is not None and importlib.util.find_spec(module) is None:
        return {**line, "status": "skipped",
                "reason": f"{module} is not installed (no module named {module})"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        error = None
        try:
            launch.spawn(worker, world_size, engine, workload, run, out_dir,
                         backend=backend, timeout_s=timeout_s)
        except Exception as caught:  # a rank failed; its record may say why
            error = caught
        records = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    records.append(json.load(f))
    if error is not None and not any(r["status"] == "oom" for r in records):
        tail = traceback.format_exception_only(type(error), error)[-1].strip()
        result = {**line, "status": "error", "error": tail.splitlines()[-1]}
    else:
        result = merge(line, records, workload, world_size, run)
    result["wall_s"] = time.perf_counter() - start
    return result
