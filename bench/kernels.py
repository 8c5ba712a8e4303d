"""
---
title: Where a step's GPU time goes
summary: A profiled step's kernels summed by kind (matrix products, attention,
  optimizer, copies, collectives, the rest) and by stream, beside the step's wall time.
---

# Where a step's GPU time goes

A benchmark line says how fast a step is; this says why. It reads the Chrome
trace of one profiled step (`python -m bench.run --trace-dir DIR` keeps rank 0's)
and sums the kernels' durations by *kind*, from their names, and by stream:

* `matmul`: cuBLAS/CUTLASS matrix products, the $6N$ of the FLOPs;
* `attention`: the fused attention kernels (forward and backward);
* `optimizer`: the Adam kernels (fused, multi-tensor or ours);
* `copy`: copies and casts (the gradient casts are these);
* `collective`: NCCL kernels;
* `other`: layer norms, GELU, the loss and every other elementwise kernel.

`busy` is the time at least one kernel runs (the union over streams), `wall` the
span from the first kernel's start to the last one's end: `wall - busy` is the
GPU idle inside the step. Kinds add up to more than `busy` where streams
overlap.

    python -m bench.kernels DIR/trace_W2-1_labml_zero_b2.json [more traces]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (kind, substrings of lowered kernel names), first match wins
KINDS = (
    ("collective", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("adam",)),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm100_")),
    ("copy", ("copy", "memcpy", "cat_", "catarray")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of `[start, end)` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summary(trace: dict, top: int = 12) -> dict:
    """Milliseconds by kind and by stream, `busy` and `wall`, of a trace's kernels
    (and device copies, which the trace files under `gpu_memcpy`), and the `top`
    kernel names by time."""
    events = [e for e in trace.get("traceEvents", [])
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
              and "ts" in e and "dur" in e]
    if not events:
        raise ValueError("the trace has no GPU kernels: profile with "
                         "ProfilerActivity.CUDA")
    by_kind: dict[str, float] = {}
    by_stream: dict[str, float] = {}
    by_name: dict[str, float] = {}
    intervals = []
    for e in events:
        name = e["name"][:80]
        by_name[name] = by_name.get(name, 0.0) + e["dur"]
        kind = "copy" if e["cat"] != "kernel" else kind_of(e["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
        stream = str(e.get("args", {}).get("stream", "?"))
        by_stream[stream] = by_stream.get(stream, 0.0) + e["dur"]
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    wall = max(b for _, b in intervals) - min(a for a, _ in intervals)
    def ms(durations: dict[str, float]) -> dict[str, float]:
        """Microseconds to milliseconds, largest first."""
        return {k: round(v / 1e3, 3)
                for k, v in sorted(durations.items(), key=lambda kv: -kv[1])}

    busy = union_us(intervals)
    return {"wall_ms": round(wall / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "by_kind_ms": ms(by_kind), "by_stream_ms": ms(by_stream),
            "top_ms": dict(list(ms(by_name).items())[:top])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="GPU time of a profiled step by "
                                     "kernel kind and stream.")
    parser.add_argument("traces", type=Path, nargs="+")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(json.dumps({"trace": path.name, **summary(json.loads(path.read_text()))}))


if __name__ == "__main__":
    main()
