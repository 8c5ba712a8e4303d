r"""
---
title: The GPU's clock and power during the timed steps
summary: The SM clock, the board's power and how often the driver held the clock down
  at its power limit, sampled while the benchmark times its steps.
---

# The GPU's clock and power during the timed steps

A GPU runs its streaming multiprocessors (SMs) at the highest clock its power
limit allows. When a step's kernels would draw more than the limit, the driver
lowers the clock and reports why, as a bit of the clock's *event reasons*; the
software power cap is bit `0x4`. A step that runs under the cap is bound by energy:
its time is about the energy its kernels need over the power limit,

$$t_\text{step} \approx \frac{E_\text{step}}{P_\text{limit}},$$

so work that runs *beside* other kernels is not free, it lowers the clock of the
kernels it runs with. Then only less energy per step (fewer floating-point
operations, fewer bytes moved) makes the step shorter, and how the work is spread
over streams or SMs changes little.

Each record of the benchmark says which case it measured, from rank 0's GPU:

* `sm_clock_mhz_mean`: the mean SM clock over the samples, beside
  `sm_clock_max_mhz`, the highest the board allows;
* `power_w_mean`: the mean board power, beside `power_limit_w`, its limit;
* `power_capped_share`: the share of samples in which the power-cap bit was set.
  The bit says that the cap acted at some moment of the sample's interval, however
  briefly: a step with short bursts over the limit sets it too, at a clock near its
  maximum. How far the mean clock stays below the maximum says how much the cap
  costs.

sampled by `nvidia-smi` every `interval_ms` while the timed steps run (samples of
the warm-up and of the profiled step are left out by their timestamps). These
fields are absent on a CPU, and where `nvidia-smi` is missing or fails. Tracking
the clock is optional, so it never fails a run.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch

# the clock event reason set while the driver holds the clock at the power limit
SW_POWER_CAP = 0x4
QUERY = ("timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,"
         "clocks_event_reasons.active")
# the fields `summarize` adds to a record
CLOCK_FIELDS = ("sm_clock_mhz_mean", "sm_clock_max_mhz", "power_w_mean",
                "power_limit_w", "power_capped_share", "clock_samples")
# `nvidia-smi`'s timestamp, in the host's local time: "2026/12/03 16:50:57.204"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"


@dataclass(frozen=True)
class ClockSample:
    at: float
    """Seconds since the epoch, comparable with `time.time()`."""
    sm_mhz: float
    sm_max_mhz: float
    power_w: float
    power_limit_w: float
    reasons: int
    """The clock event reasons, a bit mask."""


def parse_sample(line: str) -> ClockSample | None:
    """One line of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`,
    or `None` for a line that is not one (a header, an "[N/A]" field, an
    error message)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 6:
        return None
    try:
        at = datetime.datetime.strptime(fields[0], TIMESTAMP).timestamp()
        return ClockSample(at, *map(float, fields[1:5]), int(fields[5], 16))
    except ValueError:
        return None


def summarize(samples: list[ClockSample], start: float, end: float) -> dict | None:
    """The record's fields from the samples taken in `[start, end]`, or `None`
    when there are none."""
    inside = [s for s in samples if start <= s.at <= end]
    if not inside:
        return None
    n = len(inside)
    return {
        "sm_clock_mhz_mean": sum(s.sm_mhz for s in inside) / n,
        "sm_clock_max_mhz": max(s.sm_max_mhz for s in inside),
        "power_w_mean": sum(s.power_w for s in inside) / n,
        "power_limit_w": min(s.power_limit_w for s in inside),
        "power_capped_share": sum(bool(s.reasons & SW_POWER_CAP) for s in inside) / n,
        "clock_samples": n,
    }


def gpu_id(device: torch.device) -> str | None:
    """The GPU's id for `nvidia-smi -i`: its UUID, which names the same board
    whatever `CUDA_VISIBLE_DEVICES` renumbers; `None` on a CPU."""
    if device.type != "cuda":
        return None
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


class ClockWatch:
    """
    ## Sample while a block runs

    `with ClockWatch(gpu) as watch:` starts `nvidia-smi` in the background, writing
    one line per `interval_ms` into a file of its own temporary directory; at the
    end of the block it is stopped and the lines read. `watch.during(start, end)`
    is then `summarize` over them. With `gpu=None`, or no `nvidia-smi` on the
    path, nothing runs and `during` is `None`.
    """

    def __init__(self, gpu: str | None, *, interval_ms: int = 100):
        self.gpu = gpu
        self.interval_ms = interval_ms
        self.samples: list[ClockSample] = []
        self._process: subprocess.Popen | None = None
        self._folder: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> "ClockWatch":
        command = shutil.which("nvidia-smi")
        if self.gpu is None or command is None:
            return self
        self._folder = tempfile.TemporaryDirectory(prefix="labml_zero_clocks_")
        self._path = os.path.join(self._folder.name, "samples.csv")
        try:
            with open(self._path, "w") as out:
                self._process = subprocess.Popen(
                    [command, "-i", self.gpu, f"--query-gpu={QUERY}",
                     "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                    stdout=out, stderr=subprocess.DEVNULL)
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            with open(self._path) as f:
                parsed = (parse_sample(line) for line in f)
                self.samples = [s for s in parsed if s is not None]
        if self._folder is not None:
            self._folder.cleanup()

    def during(self, start: float, end: float) -> dict | None:
        return summarize(self.samples, start, end)
