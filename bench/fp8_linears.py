r"""
---
title: Where fp8 products pay, linear by linear
summary: One linear's forward and backward, compiled, in bf16 and in fp8
  (torchao's Float8Linear, tensorwise), for the shapes of the benchmark's
  models: the measurement the per-linear fp8 choice is set from.
---

# Where fp8 products pay, linear by linear

```bash
python -m bench.fp8_linears --out bench/results/…-fp8-linears.jsonl
```

[fp8 products](../labml_zero/layers/float8.html) halve the time of a
linear's three matrix products and add passes over memory to cast their
operands. Which wins depends on the linear's shape $d_\text{in} \to
d_\text{out}$ and its $n$ tokens. This script times, on one GPU, one linear
alone: `torch.compile`d, forward and backward (the input's gradient and the
weight's), bf16 inputs and weights, once as `nn.Linear` and once swapped by
[`to_float8`](../labml_zero/layers/float8.html) with the per-linear choice
turned off (`every_linear=True`), so every shape is measured in fp8. One
JSON line per shape and $n$: the median milliseconds of each over `--repeat`
calls (CUDA events, after warm-up calls that also compile), their ratio, and
whether the per-linear rule (`fp8_pays`) chooses fp8 for it.

The shapes (`SHAPES`) are the linears of the benchmark's models: Pythia-160M
(W4), Pythia-1.4B (W1), Llama-3.2-1B (L1, whose keys and values are narrow),
Pythia-6.9B (W2-1) and GPT-NeoX-20B's narrowest (W3, W5); $n$ is 4096
and 16384 tokens, the micro-batches of W2-1 and of W1 and W4.

## Limitations

* The linear alone: inside a compiled transformer layer the casts can fuse
  with the norm or activation before them, so a layer may gain a little more
  than its linears do here.
* A warm L2 cache between calls, as in a step's steady state only for the
  smallest shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

from labml_zero.layers.float8 import to_float8

# (model, linear, d_in, d_out)
SHAPES = [
    ("pythia-160m", "qkv", 768, 2304), ("pythia-160m", "dense", 768, 768),
    ("pythia-160m", "up", 768, 3072), ("pythia-160m", "down", 3072, 768),
    ("pythia-1.4b", "qkv", 2048, 6144), ("pythia-1.4b", "dense", 2048, 2048),
    ("pythia-1.4b", "up", 2048, 8192), ("pythia-1.4b", "down", 8192, 2048),
    ("llama-3.2-1b", "k, v", 2048, 512),
    ("pythia-6.9b", "qkv", 4096, 12288), ("pythia-6.9b", "dense", 4096, 4096),
    ("pythia-6.9b", "up", 4096, 16384), ("pythia-6.9b", "down", 16384, 4096),
    ("gpt-neox-20b", "dense", 6144, 6144),
]
TOKENS = (4096, 16384)


def time_linear(d_in: int, d_out: int, n: int, fp8: bool, repeat: int) -> float:
    """Median ms of one compiled forward and backward of a bf16 linear."""
    holder = nn.Sequential(nn.Linear(d_in, d_out, bias=True))
    if fp8:
        assert to_float8(holder, every_linear=True) == ["0"]
    holder = holder.to("cuda", torch.bfloat16)
    step = torch.compile(holder)
    x = torch.randn(n, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, d_out, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # compiles, then warms
        step(x).backward(dy)
    times = []
    for _ in range(repeat):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        step(x).backward(dy)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch._dynamo.reset()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_linears")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.fp8_linears: needs a CUDA GPU with fp8 products")
    gpu = torch.cuda.get_device_name()
    for model, linear, d_in, d_out in SHAPES:
        for n in TOKENS:
            bf16 = time_linear(d_in, d_out, n, False, args.repeat)
            fp8 = time_linear(d_in, d_out, n, True, args.repeat)
            row = {"gpu": gpu, "model": model, "linear": linear, "d_in": d_in,
                   "d_out": d_out, "tokens": n, "bf16_ms": round(bf16, 4),
                   "fp8_ms": round(fp8, 4), "speedup": round(bf16 / fp8, 4)}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
