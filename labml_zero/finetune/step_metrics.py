r"""
---
title: What a step shows
summary: The numbers a fine-tuning user watches beside the loss: the learning
  rate, the gradient norm, tokens per second, MFU, peak memory and the loss scale.
---

# What a step shows

The loss says whether a run learns; these say whether it is healthy. Each is
printed on the step's line and recorded by [labml](tracking.html):

* `lr`: the [schedule](lr_schedule.html)'s rate at this step;
* `grad_norm`: the global gradient norm $\lVert g \rVert_2$ before clipping,
  over all ranks' shards. With fp16 or clipping the engine reduces it already
  (the [loss scaler](../optimizers/grad_scaler.html)'s overflow check, the
  [clip](../optimizers/clip_grad.html)); otherwise each rank's $\sum_i g_i^2$
  rides in the job's one all-reduce of the step's totals, so it costs no
  collective of its own either way. With hybrid sharding every shard is held by
  $N_d / K$ ranks, so that sum is divided by $N_d / K$;
* `tokens_per_s`: the step's tokens over all ranks, $B A N_d T$, over its wall
  time (the all-reduce of the totals syncs the host with the device, so the
  time is the device's);
* `mfu` (GPUs whose peak is known): model FLOPs utilisation, the model's FLOPs
  per second over the peak of all $N_d$ devices. A token costs about
  $6\Psi_m + 12 L d T$
  (tested: tests/finetune/test_step_metrics.py::test_flops_per_token)
  FLOPs in a forward and backward (PaLM's count): $2\Psi_m$
  forward and $4\Psi_m$ backward for the $\Psi_m$ weights of its matmuls (all
  but the input embedding, a lookup), plus attention's scores and values;
* `memory.peak`: this rank's peak device memory in GiB (the CUDA allocator's);
  on CPU, the process's peak resident memory;
* `loss_scale` (fp16): the loss scale after the step.

## Limitations

* MFU counts every weight's gradient, as PaLM does; with frozen weights (biases,
  LoRA) the hardware does about $4/6$ of those FLOPs, so MFU understates its use.
* Peak FLOPs are a table of dense bf16/fp16 and TF32 figures from the vendors'
  data sheets (`PEAK_FLOPS`); another GPU gets no MFU.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from labml_zero.optimizers.clip_grad import shard_grads

__all__ = ["PEAK_FLOPS", "flops_per_token", "peak_flops", "local_grad_squares",
           "StepClock", "peak_memory_gib", "StepMeter"]

# Dense peak FLOP/s per GPU from the vendors' data sheets (SXM parts):
# name fragment → (bf16/fp16 tensor cores, fp32 through TF32).
PEAK_FLOPS = {"H200": (989.4e12, 494.7e12), "H100": (989.4e12, 494.7e12),
              "A100": (312e12, 156e12)}


def flops_per_token(*, matmul_params: int, n_layers: int, d_model: int,
                    seq_len: int) -> float:
    r"""A token's forward and backward FLOPs, as in the introduction."""
    return 6.0 * matmul_params + 12.0 * n_layers * d_model * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """One device's peak FLOP/s for `dtype`, or `None` (CPU, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (half, single) in PEAK_FLOPS.items():
        if fragment in name:
            return single if dtype == torch.float32 else half
    return None


def local_grad_squares(shards: list[torch.Tensor]) -> torch.Tensor:
    r"""$\sum_i g_i^2$ over this rank's shard gradients, 0-dim fp64, no sync."""
    grads = shard_grads(shards)
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(grads)).double().square().sum()


def peak_memory_gib(device: torch.device) -> float:
    """This rank's peak memory: the CUDA allocator's, or the process's RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


class StepClock:
    """
    ## Wall time of each step, for `tokens_per_s` and `mfu`

    `lap()` returns the seconds since the previous call (or since creation);
    a validation or a save in between is excluded by calling `restart()` after
    it.
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

    * `token_flops`: `flops_per_token` of the model at `seq_len`;
    * `peak`: one device's peak FLOP/s, or `None` for no `mfu`.
    """

    def __init__(self, *, token_flops: float, peak: float | None, world_size: int,
                 device: torch.device):
        self.token_flops, self.peak = token_flops, peak
        self.world_size, self.device = world_size, device
        self.clock = StepClock()

    def indicators(self, totals, *, lr: float, scale: float | None) -> dict:
        """`totals` is the step's `Totals`; `scale` the fp16 loss scale."""
        rate = totals.tokens / max(self.clock.lap(), 1e-9)  # tokens/s, all ranks
        out = {"lr": lr, "grad_norm": totals.grad_norm, "tokens_per_s": rate,
               "memory.peak": peak_memory_gib(self.device)}
        if self.peak is not None:
            out["mfu"] = rate * self.token_flops / (self.peak * self.world_size)
        if scale is not None:
            out["loss_scale"] = scale
        return out
