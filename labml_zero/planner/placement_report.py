r"""
---
title: What the automatic placement decided, and what the step then measured
summary: A few printed lines for `--offload-optimizer auto`: the chunks and
  fraction offloaded, the host-link bytes each way, the predicted device and host
  peaks, and after the first steps the measured ones.
---

# What the automatic placement decided

The [automatic placement](placement.html) picks, from one measured forward and
backward, the fewest chunks whose optimizer state goes to host memory. A run
that uses it should say what it chose, before the first step, and then whether
the prediction held: the offloaded fraction, the host-link bytes and the
predicted peaks (`PlacementSummary`), then the measured ones.
"""

from __future__ import annotations

import resource
from typing import NamedTuple, Sequence

import torch

from .placement import AutoPlacement, ShardSpec, resident_bytes

__all__ = ["PlacementSummary", "summarize", "decision_lines", "measured_lines",
           "host_rss_peak"]

# Memory is printed in GiB, as the allocator's statistics are read; traffic over
# the host link in GB, as link bandwidths are quoted.
GIB = 1024**3
GB = 1e9


class PlacementSummary(NamedTuple):
    r"""
    ## The decision in numbers

    * `offloaded_chunks`, `trainable_chunks`: chunks with their optimizer state
      on the host, out of the trainable ones.
    * `offloaded_fraction`: $F / \Psi_t^{(r)}$ in elements, the offloaded
      elements $F$ over this rank's trainable shard elements $\Psi_t^{(r)}$.
    * `down`, `up`: host-link bytes per step and rank, $4F$ down (fp32
      gradients) and $pF$ up (rounded masters), from `offload_traffic`.
    * `device_peak`: the placement's own predicted device peak, bytes
      ($\text{measured\_peak\_other} + K_d \sum_{\text{on device}} S_c$).
    * `host_states`: model-state bytes in host memory (the offloaded optimizer
      states and their staging buffers, and any parameter shards there, from
      `resident_bytes`, for the state layout the placement was decided for);
      the process's own memory (Python, CUDA's host side, pinned pools) comes
      on top of it.
    """

    offloaded_chunks: int
    trainable_chunks: int
    offloaded_fraction: float
    down: int
    up: int
    device_peak: int
    host_states: int


def summarize(decided: AutoPlacement, shards: Sequence[ShardSpec], *,
              pinned: bool = False) -> PlacementSummary:
    """The numbers of the decision, for `shards` (`shard_specs(model)`);
    `pinned` where the staging buffers are page-locked (beside a GPU)."""
    placement = decided.placement
    trainable = [i for i, s in enumerate(shards) if s.trainable]
    total = sum(shards[i].numel for i in trainable)
    offloaded = sum(shards[i].numel for i in placement.optimizer_on_host)
    split = resident_bytes(placement, shards, states=decided.states,
                           pinned=pinned)
    return PlacementSummary(
        offloaded_chunks=len(placement.optimizer_on_host),
        trainable_chunks=len(trainable),
        offloaded_fraction=offloaded / total if total else 0.0,
        down=decided.traffic.down, up=decided.traffic.up,
        device_peak=decided.predicted_peak, host_states=split.host)


def decision_lines(decided: AutoPlacement, shards: Sequence[ShardSpec], *,
                   pinned: bool = False) -> list[str]:
    """
    ### The decision, as lines to print before the first step

    Returned, not printed (and so `measured_lines`), so the caller decides which
    rank prints (one, rank 0) and where (stdout, a logger).
    """
    s = summarize(decided, shards)
    lines = [
        f"automatic offload: optimizer states of {s.offloaded_chunks} of "
        f"{s.trainable_chunks} trainable chunks on the host "
        f"({100 * s.offloaded_fraction:.1f}% of the elements)",
        f"  host link per step: {s.down / GB:.2f} GB down (fp32 gradients), "
        f"{s.up / GB:.2f} GB up (rounded masters)",
        f"  predicted peaks: device {s.device_peak / GIB:.2f} GiB, host model "
        f"states {s.host_states / GIB:.2f} GiB (plus the process's own memory)",
    ]
    if decided.placement.resident:
        lines.append(f"  frozen chunks kept gathered: "
                     f"{len(decided.placement.resident)}")
    return lines


def host_rss_peak() -> int:
    """This process's peak resident set in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measured_lines(decided: AutoPlacement, shards: Sequence[ShardSpec], *,
                   device: torch.device, steps: int) -> list[str]:
    """
    ### The measured peaks after `steps` steps, beside the predicted ones

    The device peak is `max_memory_allocated()` since the last
    `reset_peak_memory_stats()`; a device without allocator statistics (CPU)
    says so instead of a number. The host's is the process's peak resident set
    (`ru_maxrss`).
    """
    s = summarize(decided, shards, pinned=device.type == "cuda")
    if device.type == "cuda":
        # host sync: the peak must include every kernel queued so far
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        gpu = (f"device {peak / GIB:.2f} GiB (predicted "
               f"{s.device_peak / GIB:.2f}, "
               f"{100 * (peak - s.device_peak) / max(s.device_peak, 1):+.1f}%)")
    else:
        gpu = f"device not measured on {device.type} (predicted " \
              f"{s.device_peak / GIB:.2f} GiB)"
    rss = host_rss_peak()
    return [f"automatic offload after {steps} steps: measured peaks {gpu}, "
            f"host resident set {rss / GIB:.2f} GiB (model states "
            f"{s.host_states / GIB:.2f} GiB predicted)"]
