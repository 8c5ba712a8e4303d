r"""
---
title: What a step shows
summary: The numbers a fine-tuning user watches beside the loss: the learning
  rate, the gradient norm, tokens per second, MFU, peak memory and the loss scale.
---

# What a step shows

The loss says whether a run learns; these say whether it is healthy. Each is
printed on the step's line and recorded by [labml](tracking.html): `lr`, the
[schedule](lr_schedule.html)'s rate at this step; `grad_norm`, the global
gradient norm before clipping; `tokens_per_s`; `mfu`, model FLOPs utilisation,

$$\text{MFU} = \frac{F \cdot \text{tokens/s}}{N_d \, P}$$

with $F$ a token's FLOPs for what trains (the planner's
[`model_flops_per_token`](../planner/step_time.html): PaLM's count for a full
fine-tune, without the frozen matrices' weight gradients for biases and LoRA)
and $P$ one device's dense peak; `memory.peak`, the device's peak; on a GPU
`memory.host`, the rank process's peak resident set on the host (where
offloaded optimizer state lives, and what runs out first when too much of it
does); and `loss_scale` with fp16, the loss scale after the step.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

__all__ = ["PEAK_FLOPS", "peak_flops", "peak_flops_of", "mfu",
           "StepClock", "peak_memory_gib", "host_peak_gib", "StepMeter"]

# Dense (not 2:4 sparse) peak FLOP/s per GPU from the vendors' data sheets:
# name fragment → (bf16/fp16 tensor cores, fp32 through TF32, fp8 tensor
# cores or None). The fp8 figures are the NVIDIA H100 data sheet's FP8
# Tensor Core rows, given "with sparsity" and halved here to dense; the
# H200's sheet repeats the SXM row; the A100 has no fp8. The first fragment in
# the device's name wins, so a PCIe or NVL part (a card with a lower power
# limit, and its own sheet's lower rows) precedes its SXM twin. Another GPU gets no MFU. A large matrix product
# measured on the GPU reaches less than the data sheet's figure, so a share of
# that measured peak reads higher; it may be shown beside MFU, named as such,
# never instead of it.
PEAK_FLOPS = {"H200 NVL": (835.5e12, 417.5e12, 1670.5e12),
              "H200": (989.4e12, 494.7e12, 1978.9e12),
              "H100 NVL": (835.5e12, 417.5e12, 1670.5e12),
              "H100 PCIe": (756e12, 378e12, 1513e12),
              "H100": (989.4e12, 494.7e12, 1978.9e12),
              "A100": (312e12, 156e12, None)}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def peak_flops_of(name: str | None, dtype: torch.dtype) -> float | None:
    """
    #### A GPU's dense peak FLOP/s from its name

    `name` as `torch.cuda.get_device_name` gives it (`'NVIDIA H200'`); bf16 and
    fp16 run on the tensor cores at one rate, fp32 through TF32 at half of it,
    either fp8 (e4m3, e5m2) at twice it. `None` for a name not in `PEAK_FLOPS`
    (a CPU has none), or fp8 on a GPU without it.
    """
    known = (torch.bfloat16, torch.float16, torch.float32, *FP8_DTYPES)
    if not name or dtype not in known:
        return None
    for fragment, (half, single, fp8) in PEAK_FLOPS.items():
        if fragment in name:
            if dtype in FP8_DTYPES:
                return fp8
            return single if dtype == torch.float32 else half
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """One device's peak FLOP/s for `dtype`, or `None` (CPU, an unknown GPU)."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), dtype)


def mfu(*, token_flops: float, tokens_per_s: float, world_size: int,
        peak: float | None) -> float | None:
    r"""
    ### Model FLOPs utilisation

    The formula above: the model's FLOPs per second over the dense peak of all
    $N_d$ devices, $P$ the data sheet's bf16/fp16 figure (TF32 for fp32), as
    PaLM, Megatron-LM, torchtitan and LLM Foundry count it; the one function the
    job, the benchmark and the results page use. `None` where the peak is
    unknown.
    """
    if peak is None:
        return None
    return token_flops * tokens_per_s / (world_size * peak)


def host_peak_gib() -> float:
    """`memory.host`: this process's peak resident set in GiB (page-locked
    buffers are resident, so they count)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def peak_memory_gib(device: torch.device) -> float:
    """`memory.peak`: this rank's peak memory in GiB, the CUDA allocator's, or
    on CPU the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_peak_gib()


class StepClock:
    """
    ## Wall time of each step, for `tokens_per_s` and `mfu`

    `lap()` returns the seconds since the previous call (or since creation);
    a validation or a save in between is excluded by calling `restart()` after
    it. `tokens_per_s` is the step's tokens over all ranks, $B A N_d T$, over
    this time; the all-reduce of the totals syncs the host with the device, so
    the time is the device's.
    """

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        took, self.last = now - self.last, now
        return took

    def restart(self) -> None:
        self.last = time.perf_counter()


class StepMeter:
    """
    ## A step's indicators, from its totals, its rate and its time

    * `token_flops`: the planner's `model_flops_per_token` of the fine-tune;
    * `peak`: one device's peak FLOP/s, or `None` for no `mfu`;
    * `warmup`: the first steps, left out of the steady rate (`steady_line`):
      a compilation or a graph's recording is in them.

    The steady rate is the tokens of the later steps over their summed time,
    as the benchmark's tokens per second is its steps' tokens over their mean
    time, so the two compare directly.
    """

    def __init__(self, *, token_flops: float, peak: float | None, world_size: int,
                 device: torch.device, warmup: int = 0):
        self.token_flops, self.peak = token_flops, peak
        self.world_size, self.device = world_size, device
        self.clock = StepClock()
        self.warmup, self.steps = warmup, 0
        self.steady_tokens = self.steady_s = 0.0

    def indicators(self, totals, *, lr: float, scale: float | None) -> dict:
        """`totals` is the step's `Totals`; `scale` the fp16 loss scale."""
        took = max(self.clock.lap(), 1e-9)
        self.steps += 1
        if self.steps > self.warmup:
            self.steady_tokens += totals.tokens
            self.steady_s += took
        rate = totals.tokens / took  # tokens/s, all ranks
        out = {"lr": lr, "grad_norm": totals.grad_norm, "tokens_per_s": rate,
               "memory.peak": peak_memory_gib(self.device)}
        if self.device.type != "cpu":  # on a CPU `memory.peak` is the host's
            out["memory.host"] = host_peak_gib()
        share = mfu(token_flops=self.token_flops, tokens_per_s=rate,
                    world_size=self.world_size, peak=self.peak)
        if share is not None:
            out["mfu"] = share
        if scale is not None:
            out["loss_scale"] = scale
        return out

    def steady_line(self) -> str | None:
        """
        ### The rate after the warm-up, one line for the end of the run

        With the run's peak memory beside it: the device's, and off the CPU
        the host's. `None` when no step came after the warm-up.
        """
        if self.steps <= self.warmup:
            return None
        rate = self.steady_tokens / self.steady_s
        share = mfu(token_flops=self.token_flops, tokens_per_s=rate,
                    world_size=self.world_size, peak=self.peak)
        memory = f"; peak memory {peak_memory_gib(self.device):.2f} GiB"
        if self.device.type != "cpu":
            memory += f", host {host_peak_gib():.2f} GiB"
        return (f"tokens/s over steps {self.warmup + 1}..{self.steps} of this run "
                f"(after {self.warmup} warm-up): {rate:,.0f}"
                + ("" if share is None else f", MFU {100 * share:.1f}%") + memory)
