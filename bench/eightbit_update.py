r"""
---
title: Timing the 8-bit moments' update
summary: The one-pass update of a shard with 8-bit moments against its twin
  (decode, the fused fp32 kernel, encode, write-back) on one GPU, with their
  agreement after one step from the same state.
---

# Timing the 8-bit moments' update

`python -m bench.eightbit_update` updates one shard of `--numel` elements
(by default `NUMEL`, about the parameters of Pythia-1.4B) with
`states="8bit-moments"`, both ways `AdamFP16` can on a GPU:

* `twin`: [`blockwise_moments.update`](../labml_zero/optimizers/blockwise_moments.html)
  with the fused fp32 kernel, slice by slice, then the copy that rounds the
  master into the bf16 shard (and, with a bf16 gradient, its cast to fp32
  first);
* `one_pass`: `blockwise_moments.one_pass`, the compiled kernel.

It prints one JSON line: the median milliseconds of each over `--repeat`
steps (CUDA events, after a warm-up step that also compiles), the one pass's
bytes per element and the bandwidth they make, the peak memory each path
allocates above its inputs, the kernels one step of the one pass launches,
one replay of it captured as a CUDA graph, and how far the two paths' states
are apart after one step from the same state (the largest difference of the
masters, the fraction of codes that differ and by how much at most, the
largest relative difference of the scales).

## Limitations

* The shard alone: inside a training step the update competes with the
  backward pass's kernels (early updates) and starts from a cold L2 cache.
* One shard: a model's chunks are several, each a launch of its own.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Callable

import torch

from labml_zero.optimizers import blockwise_moments as bw
from labml_zero.optimizers import rounded_update
from labml_zero.optimizers.adam_fp16 import AdamFP16

NUMEL = 1_400_000_000
"""Elements of the timed shard by default."""

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)

GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def new_state(master: torch.Tensor) -> dict:
    """Master, zero moments (codes and scales) and the bf16 shard."""
    n = master.numel()
    return {"master": master.clone(), "shard": master.bfloat16(),
            "exp_avg": torch.full((n,), bw.SIGNED_LEVELS, dtype=torch.uint8,
                                  device=master.device),
            "exp_avg_absmax": master.new_zeros(bw.n_blocks(n)),
            "exp_avg_sq": torch.zeros(n, dtype=torch.uint8, device=master.device),
            "exp_avg_sq_absmax": master.new_zeros(bw.n_blocks(n))}


def moments(state: dict) -> tuple[torch.Tensor, ...]:
    return tuple(state[k] for k in ("exp_avg", "exp_avg_absmax", "exp_avg_sq",
                                    "exp_avg_sq_absmax"))


def twin_step(optimizer: AdamFP16) -> Callable[[dict, torch.Tensor, int], None]:
    """The path `AdamFP16` took before the one pass: decode, the fused fp32
    kernel, encode, then the write-back copy."""
    def step(state: dict, grad: torch.Tensor, t: int) -> None:
        kernel = functools.partial(optimizer._kernel, step=t, group_index=0,
                                   found_inf=None)
        bw.update(kernel, [state["master"]], [grad.float()],
                  [[m] for m in moments(state)])
        torch._foreach_copy_([state["shard"]], [state["master"]])
    return step


def coefficients_of(t: int, device: torch.device) -> torch.Tensor:
    """The step's coefficients as `AdamFP16` makes them on a GPU (the rate
    in fp32)."""
    return rounded_update.step_coefficients(
        torch.full((), float(t), device=device),
        torch.full((), HYPER["lr"], device=device),
        beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
        weight_decay=HYPER["weight_decay"])


def one_pass_update(state: dict, grad: torch.Tensor,
                    coefficients: torch.Tensor) -> None:
    bw.one_pass(state["master"], grad, moments(state), state["shard"],
                coefficients, None,
                rounded_update.Betas(*HYPER["betas"], HYPER["eps"]))


def one_pass_step(state: dict, grad: torch.Tensor, t: int) -> None:
    """`blockwise_moments.one_pass` and its coefficients, as `AdamFP16` runs
    them once a step."""
    one_pass_update(state, grad, coefficients_of(t, grad.device))


def timed(step: Callable, state: dict, grad: torch.Tensor, first: int,
          repeat: int) -> tuple[float, int]:
    """Median ms of `repeat` steps from step number `first`, and the peak
    bytes allocated above what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for t in range(first, first + repeat):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        step(state, grad, t)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def kernels_of(state: dict, grad: torch.Tensor, t: int) -> int:
    """CUDA kernels the one pass of a shard launches (the profiler's device
    events), its coefficients made before."""
    coefficients = coefficients_of(t, grad.device)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        one_pass_update(state, grad, coefficients)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA)


def captured_ms(state: dict, grad: torch.Tensor, t: int) -> float:
    """One step of the one pass captured as a CUDA graph (no host sync may
    happen inside), then the milliseconds of one replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            one_pass_step(state, grad, t)
    torch.cuda.current_stream().wait_stream(stream)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def agreement(ours: dict, theirs: dict) -> dict:
    """How far the one pass's state is from the twin's."""
    out = {"master_max_abs_diff":
           (ours["master"] - theirs["master"]).abs().max().item()}
    for key in ("exp_avg", "exp_avg_sq"):
        diff = (ours[key].int() - theirs[key].int()).abs()
        out[f"{key}_codes_max_diff"] = int(diff.max().item())
        out[f"{key}_codes_differ_fraction"] = (diff != 0).float().mean().item()
        scale, ref = ours[f"{key}_absmax"], theirs[f"{key}_absmax"]
        out[f"{key}_scales_max_rel_diff"] = (
            (scale - ref).abs() / ref.abs().clamp_min(torch.finfo(ref.dtype).tiny)
        ).max().item()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.eightbit_update")
    parser.add_argument("--numel", type=float, default=NUMEL,
                        help="elements of the shard (1.4e9 is read as such)")
    parser.add_argument("--grad-dtype", choices=sorted(GRAD_DTYPES),
                        default="fp32")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    numel = int(args.numel)
    if numel != args.numel or numel < 1:
        raise SystemExit(f"bench.eightbit_update: --numel must be a whole "
                         f"number of elements >= 1, got {args.numel:g}")
    if args.repeat < 1:
        raise SystemExit(f"bench.eightbit_update: --repeat must be >= 1, "
                         f"got {args.repeat}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.eightbit_update times CUDA kernels: no GPU here")
    device = torch.device("cuda")
    grad_dtype = GRAD_DTYPES[args.grad_dtype]
    torch.manual_seed(0)
    master = torch.randn(numel, device=device)
    grad = (torch.randn(numel, device=device) * 1e-3).to(grad_dtype)
    optimizer = AdamFP16([torch.nn.Parameter(torch.zeros(1, device=device))],
                         **HYPER, fused=True)
    twin = twin_step(optimizer)
    # the same state both ways, one step apart from the start: moments
    # that are not zero
    ours = new_state(master)
    del master
    one_pass_step(ours, grad, 1)
    theirs = {k: v.clone() for k, v in ours.items()}
    one_pass_step(ours, grad, 2)
    twin(theirs, grad, 2)
    torch.cuda.synchronize()
    line = {"bench": "eightbit_update", "device": torch.cuda.get_device_name(),
            "numel": numel, "grad_dtype": args.grad_dtype,
            **agreement(ours, theirs)}
    twin_ms, twin_peak = timed(twin, theirs, grad, 3, args.repeat)
    del theirs
    one_ms, one_peak = timed(one_pass_step, ours, grad, 3, args.repeat)
    t = 3 + args.repeat
    line["one_pass_kernels"] = kernels_of(ours, grad, t)
    line["captured_ms"] = captured_ms(ours, grad, t + 1)
    grad_bytes = grad.element_size()
    line.update({
        "twin_ms": twin_ms, "one_pass_ms": one_ms, "speedup": twin_ms / one_ms,
        "one_pass_bytes_per_element": bw.one_pass_bytes(2, grad_bytes),
        "one_pass_tb_per_s": bw.one_pass_bytes(2, grad_bytes) * numel
        / (one_ms * 1e-3) / 1e12,
        "twin_peak_extra_gib": twin_peak / 2**30,
        "one_pass_peak_extra_gib": one_peak / 2**30,
    })
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
