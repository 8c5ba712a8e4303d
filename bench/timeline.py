"""
Turn a torch.profiler Chrome trace of one training step into the notes' timeline.

The notes site draws `docs_src/figures/step_timeline.json`: events on the compute,
gather and reduce streams. On a GPU run the truth is in the kernels: NCCL's
all-gather and reduce-scatter kernels (on NCCL's streams) and everything else (on
the compute stream). This reads the kernels of a Chrome trace written by
`torch.profiler.profile(...).export_chrome_trace(path)`, classifies them, merges
neighbouring compute kernels into blocks so the figure stays readable, and writes
the JSON.

    python -m bench.timeline trace.json docs_src/figures/step_timeline.json \\
        --source "W4 on 2xH200, rank 0, commit abc123"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def classify(name: str) -> tuple[str, str]:
    """(stream, label) of a kernel, from its name."""
    lowered = name.lower()
    if "allgather" in lowered or "all_gather" in lowered:
        return "gather", "all-gather"
    if "reducescatter" in lowered or "reduce_scatter" in lowered:
        return "reduce", "reduce-scatter"
    if "nccl" in lowered:
        return "reduce", "all-reduce"
    return "compute", "compute"


def timeline(trace: dict, *, merge_gap_us: float = 50.0) -> list[dict]:
    """Events of the kernels in `trace`, compute kernels merged across small gaps."""
    kernels = [
        e for e in trace.get("traceEvents", [])
        if e.get("cat") == "kernel" and "ts" in e and "dur" in e
    ]
    if not kernels:
        raise ValueError(
            "the trace has no GPU kernels: profile with ProfilerActivity.CUDA"
        )
    kernels.sort(key=lambda e: e["ts"])
    origin = kernels[0]["ts"]
    events: list[dict] = []
    open_block: dict[str, dict] = {}
    for kernel in kernels:
        stream, label = classify(kernel["name"])
        start = (kernel["ts"] - origin) * 1e-6
        end = start + kernel["dur"] * 1e-6
        last = open_block.get(stream)
        if (
            last is not None
            and last["name"] == label
            and start - last["end"] <= merge_gap_us * 1e-6
        ):
            last["end"] = max(last["end"], end)
            continue
        block = {"name": label, "stream": stream, "start": start, "end": end}
        events.append(block)
        open_block[stream] = block
    for event in events:
        event["start"] = round(event["start"], 7)
        event["end"] = round(event["end"], 7)
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("trace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", required=True, help="what run produced the trace")
    args = parser.parse_args()
    events = timeline(json.loads(args.trace.read_text()))
    payload = {"source": args.source, "events": events}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(events)} events written to {args.out}")


if __name__ == "__main__":
    main()
