r"""
---
title: Probe: NCCL's all-gather against copies from peer memory
summary: Ten gathers of one chunk, alone and beside matrix products, both ways.
---

# Probe: NCCL's all-gather against copies from peer memory

The measurement behind [peer memory](../labml_zero/zero3/peer_memory.html).
On the GPUs of one host, one process per GPU:

```bash
torchrun --nproc-per-node 2 -m bench.peer_gather_probe --out probe.json
```

For each chunk size it times, on rank 0's clock, with both ranks in step:

* ten gathers of the chunk alone, with NCCL's all-gather and with
  `pull_all_gather` (two barriers and one copy per rank);
* a run of bf16 matrix products alone ($2048 \times 6144 \times 24576$, the
  size of a GPT-NeoX-20B feed-forward product on 2048 tokens);
* both at once: the gathers on a side stream, the products on the compute
  stream, as in a training step. The time above the products alone is what
  the gathers cost the computation.

It also lists the names of the trace events of one peer gather, which
`bench.measure` classifies as communication.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from bench.measure import DEVICE_CATEGORIES, is_communication
from labml_zero.zero3.peer_memory import PeerBuffer, pull_all_gather

GATHERS = 10


def timed(fn, *, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs, every rank starting together."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(mib: int, *, device, side, reps: int) -> dict:
    world = dist.get_world_size()
    numel = mib * 2**20 // 2 // world  # bf16 elements of one rank's shard
    shards = PeerBuffer(numel, torch.bfloat16, device=device, group=None,
                        rank=dist.get_rank(), world_size=world, name="probe")
    shards.local.fill_(dist.get_rank() + 1)
    full = torch.empty(world * numel, dtype=torch.bfloat16, device=device)
    a = torch.randn(2048, 6144, device=device, dtype=torch.bfloat16)
    b = torch.randn(6144, 24576, device=device, dtype=torch.bfloat16)
    # about as many products as the gathers take beside them in a 20B layer
    products = max(1, round(mib / 906 * 120))

    def gathers(peer: bool):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GATHERS):
                if peer:
                    pull_all_gather(full, shards)
                else:
                    dist.all_gather_into_tensor(full, shards.local)

    def compute():
        for _ in range(products):
            torch.mm(a, b)

    def both(peer: bool):
        gathers(peer)
        compute()
        torch.cuda.current_stream().wait_stream(side)

    def alone(peer: bool):
        gathers(peer)
        torch.cuda.current_stream().wait_stream(side)

    result = {"chunk_mib": mib, "products": products}
    result["products_alone_s"] = timed(compute, reps=reps)
    for name, peer in (("nccl", False), ("peer", True)):
        result[f"{name}_alone_s"] = timed(lambda: alone(peer), reps=reps)
        result[f"{name}_beside_products_s"] = timed(lambda: both(peer), reps=reps)
        result[f"{name}_GBps"] = GATHERS * full.nbytes / result[f"{name}_alone_s"] / 1e9
    pull_all_gather(full, shards)
    torch.cuda.synchronize()
    expected = torch.arange(1, world + 1, device=device).repeat_interleave(numel)
    result["peer_gather_correct"] = bool((full == expected).all())
    return result


def trace_names(device) -> list[list]:
    """(category, name, counted as communication) of the device events of one
    small peer gather, as `bench.measure` reads them from a Chrome trace."""
    world = dist.get_world_size()
    shards = PeerBuffer(1 << 20, torch.bfloat16, device=device, group=None,
                        rank=dist.get_rank(), world_size=world, name="names")
    full = torch.empty(world << 20, dtype=torch.bfloat16, device=device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pull_all_gather(full, shards)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return sorted({(e["cat"], e["name"], is_communication(e["name"], e["cat"]))
                   for e in events if e.get("cat") in DEVICE_CATEGORIES})


def main() -> None:
    parser = argparse.ArgumentParser(
        description="NCCL all-gather against copies from peer memory")
    parser.add_argument("--sizes-mib", default="100,400,906")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    side = torch.cuda.Stream(device, priority=-1)
    results = [probe(int(m), device=device, side=side, reps=args.reps)
               for m in args.sizes_mib.split(",")]
    names = trace_names(device)
    if rank == 0:
        for line in results:
            print(json.dumps(line), flush=True)
        print("trace events of a peer gather:", names, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"results": results, "trace_events": names}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
