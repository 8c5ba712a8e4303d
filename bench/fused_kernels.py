r"""
---
title: Timing the model's fused kernels
summary: Each fused kernel against its plain twin on the GPU, forward and backward,
  at the shapes of W1 and W4, and the attention backends SDPA offers.
---

# Timing the model's fused kernels

`python -m bench.fused_kernels --out kernels.jsonl` times, for each of the
[fused kernels](../labml_zero/neox/kernels.html), one forward and backward
pass of the fused function and of its plain twin on the same random inputs,
at the shapes of one layer of W1 (Pythia-1.4B, 8 × 2048 tokens) and W4
(Pythia-160M, 16 × 1024), and prints one JSON line each: the median time
over `--repeat` passes (CUDA events, after warm-up passes that also compile),
the peak memory a pass allocates above its inputs, and the relative error of
each output and gradient against the twin computed in float64. Then the
same for `scaled_dot_product_attention` on each backend. The lines are what
the model's page and the README quote as each kernel's A/B alone; the whole
step's A/B is `python -m bench.run --kernels ...`.

## Limitations

* A kernel alone: inside a step it competes with nothing, and its inputs are
  not in the L2 cache from the previous kernel either.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labml_zero.neox import kernels as K
from labml_zero.neox.model import (NeoXConfig, RotaryTables, pythia_1_4b, pythia_160m,
                                   rotary_joint_fused, rotary_joint_plain)

SHAPES = {"W1": (pythia_1_4b(), 8, 2048), "W4": (pythia_160m(), 16, 1024)}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """$\\lVert out - ref \\rVert / \\lVert ref \\rVert$ in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.is_floating_point())
            for t in tensors]


def output_grads(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random output gradients, the same whatever the dtype: drawn in float64
    on the CPU, then cast."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, dtype=torch.float64, generator=generator)
            .to(o.device, o.dtype) for o in outs]


def outputs_and_grads(fn: Callable, inputs: list[torch.Tensor], seed: int,
                      grads: list[torch.Tensor] | None = None
                      ) -> list[torch.Tensor]:
    """`fn(*inputs)`, then backward with `grads` (by default `output_grads`)."""
    inputs = leaves(inputs)
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    if grads is None:
        grads = output_grads(outs, seed)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [i.grad for i in inputs
                                         if i.grad is not None]


def time_pass(fn: Callable, inputs: list[torch.Tensor], *, warmup: int,
              repeat: int) -> tuple[float, int]:
    """Median ms of forward + backward, and the peak bytes above the inputs."""
    # drawn once, outside the timed passes (a CPU draw is slower than the kernel)
    out = fn(*inputs)
    grads = output_grads(list(out) if isinstance(out, tuple) else [out], seed=0)
    del out
    for _ in range(warmup):
        outputs_and_grads(fn, inputs, seed=0, grads=grads)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        outputs_and_grads(fn, inputs, seed=0, grads=grads)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def cases(config: NeoXConfig, batch: int, seq: int, device: torch.device):
    """(name, plain, fused, inputs) for each kernel at one layer's shapes."""
    dtype = torch.bfloat16
    d, d_ff, n_h, d_h = config.d_model, config.ff_dim, config.n_heads, config.head_dim

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype) * scale

    x = randn(batch, seq, d)
    weight = randn(config.n_vocab, d, scale=config.init_std)
    targets = torch.randint(0, config.n_vocab, (batch, seq), device=device)

    def loss_plain(x, w, t):
        return K.plain_readout_loss(x, lambda h: F.linear(h, w), t)

    def loss_fused(x, w, t):
        return K.chunked_readout_loss(x, w, t, chunk_rows=2048)

    yield "loss", loss_plain, loss_fused, [x, weight, targets]

    # q and k as the model holds them: one strided view of the QKV output,
    # [2, B, n_h, T, d_h], and the model's tables, built before the timing
    qkv = randn(batch, seq, n_h, 3, d_h)
    tables = RotaryTables(config)
    tables(seq, device, dtype)

    def rot_plain(qkv):
        return rotary_joint_plain(qkv[:, :, :, :2].permute(3, 0, 2, 1, 4), config,
                                  tables)

    def rot_fused(qkv):
        return rotary_joint_fused(qkv[:, :, :, :2].permute(3, 0, 2, 1, 4), config,
                                  tables)

    yield "rotary", rot_plain, rot_fused, [qkv]

    w1, b1, w2, b2 = (randn(d, scale=0.1) + (1 if i % 2 == 0 else 0)
                      for i in range(4))
    eps = config.layer_norm_eps

    def norms_plain(x, w1, b1, w2, b2):
        return F.layer_norm(x, (d,), w1, b1, eps), F.layer_norm(x, (d,), w2, b2, eps)

    def norms_fused(x, w1, b1, w2, b2):
        return K.two_layer_norms_fused(x, w1, b1, w2, b2, eps)

    yield "norms", norms_plain, norms_fused, [x, w1, b1, w2, b2]

    w_up, b_up = randn(d_ff, d, scale=config.init_std), randn(d_ff, scale=0.1)
    approx = config.gelu_approximate

    def up_plain(x, w, b):
        return F.gelu(F.linear(x, w, b), approximate=approx)

    def up_fused(x, w, b):
        return K.linear_bias_gelu_fused(x, w, b, approx)

    yield "bias_gelu", up_plain, up_fused, [x, w_up, b_up]


def attention_cases(config: NeoXConfig, batch: int, seq: int, device: torch.device):
    shape = (batch, config.n_heads, seq, config.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    for backend in (None, *K.ATTENTION_BACKENDS):
        if backend == "math":
            continue  # materialises T × T scores: not a contender

        def run(q, k, v, backend=backend):
            return K.attention(q, k, v, backend)

        yield backend or "default", run, [q, k, v]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.fused_kernels")
    parser.add_argument("--shapes", default="W1,W4")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.fused_kernels times CUDA kernels: no GPU here")
    device = torch.device("cuda")
    lines = []

    def emit(line: dict) -> None:
        lines.append(line)
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")

    for shape in args.shapes.split(","):
        config, batch, seq = SHAPES[shape]
        for name, plain, fused, inputs in cases(config, batch, seq, device):
            ref = outputs_and_grads(plain, [t.double() if t.is_floating_point()
                                            else t for t in inputs], seed=1)
            errors = {}
            for label, fn in (("plain", plain), ("fused", fused)):
                got = outputs_and_grads(fn, inputs, seed=1)
                errors[label] = [relative_error(g, r) for g, r in zip(got, ref)]
            del ref, got
            timings = {label: time_pass(fn, inputs, warmup=args.warmup,
                                        repeat=args.repeat)
                       for label, fn in (("plain", plain), ("fused", fused))}
            emit({"shape": shape, "kernel": name,
                  "plain_ms": timings["plain"][0], "fused_ms": timings["fused"][0],
                  "plain_peak_mib": timings["plain"][1] / 2**20,
                  "fused_peak_mib": timings["fused"][1] / 2**20,
                  "plain_rel_err": errors["plain"],
                  "fused_rel_err": errors["fused"]})
        for backend, fn, inputs in attention_cases(config, batch, seq, device):
            try:
                ms, peak = time_pass(fn, inputs, warmup=args.warmup,
                                     repeat=args.repeat)
                emit({"shape": shape, "kernel": "attention", "backend": backend,
                      "ms": ms, "peak_mib": peak / 2**20})
            except RuntimeError as error:
                emit({"shape": shape, "kernel": "attention", "backend": backend,
                      "error": str(error).splitlines()[0][:200]})
    return lines


if __name__ == "__main__":
    main()
