r"""
---
title: Host memory of a benchmark run
summary: Each rank's peak resident memory, the host's lowest available memory, and a
  watchdog that ends a run before the host runs out.
---

# Host memory of a benchmark run

Offloading engines (workload W5) keep model states in host memory, so the
benchmark reports it beside the GPU's:

* `host_rss_peak`: the largest resident set of one rank process
  (`ru_maxrss`). Page-locked ("pinned") buffers are resident, so they count.
* `host_used_peak`: the host's memory in use at its fullest,
  $\text{MemTotal} - \min \text{MemAvailable}$ from `/proc/meminfo`, sampled
  every `interval_s`: all ranks together, plus everything else on the host.

## Running out, safely

An engine that asks for more host memory than there is would meet the kernel's
out-of-memory killer, which picks its victim by size, may take a process of
another job, and leaves no record of why. So a watchdog thread in every rank
ends the run first: when `MemAvailable` falls below `reserve` bytes, it writes
the rank's record as `"status": "oom"` with `"where": "host"` and the bytes in
use, and ends the process at once (`os._exit`), as a device out-of-memory error
does ([run](run.html)). Out of memory counts as a result.

## Limitations

* Linux only (`/proc/meminfo`); elsewhere nothing is sampled and the watchdog
  never fires.
* Sampling can miss a spike shorter than `interval_s`; an allocation of more
  than `reserve` bytes at once can still reach the kernel's killer first.
"""

from __future__ import annotations

import os
import resource
import threading
from typing import Callable

MEMINFO = "/proc/meminfo"


def meminfo() -> dict[str, int] | None:
    """`MemTotal` and `MemAvailable` in bytes, or `None` where there is no
    `/proc/meminfo`."""
    try:
        with open(MEMINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            # "MemTotal:  263854792 kB"
            values[key] = int(rest.split()[0]) * 1024
    return values if len(values) == 2 else None


def rss_peak() -> int:
    """This process's peak resident set in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class HostMemoryWatch:
    """
    ## The watchdog

    * `reserve`: bytes of `MemAvailable` below which `on_exhausted(used)` is
      called (once) with the host's bytes in use; it is expected not to return.
    * `interval_s`: seconds between samples.

    `used_peak` is the largest `MemTotal - MemAvailable` seen so far, `None`
    without `/proc/meminfo`.
    """

    def __init__(self, *, reserve: int, on_exhausted: Callable[[int], None],
                 interval_s: float = 0.1):
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0 bytes, got {reserve}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.reserve = reserve
        self.on_exhausted = on_exhausted
        self.interval_s = interval_s
        self.used_peak: int | None = None
        self._stop = threading.Event()
        self._fired = False
        # daemon: a rank that ends must not wait for its watchdog
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="host-memory-watch")

    def sample(self) -> None:
        """Read `/proc/meminfo` once; call `on_exhausted` below the reserve."""
        info = meminfo()
        if info is None:
            return
        used = info["MemTotal"] - info["MemAvailable"]
        self.used_peak = max(used, self.used_peak or 0)
        if info["MemAvailable"] < self.reserve and not self._fired:
            self._fired = True
            self._stop.set()
            self.on_exhausted(used)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "HostMemoryWatch":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def exit_on_exhausted(write_record: Callable[[dict], None]) -> Callable[[int], None]:
    """
    ### What a rank does when the host runs out

    Writes its record through `write_record` and ends the process without
    unwinding: the main thread may be inside an allocation or a collective.
    """

    def exhausted(used: int) -> None:
        write_record({"status": "oom", "where": "host", "host_used": used,
                      "error": f"host memory exhausted: {used / 2**30:.1f} GiB "
                               "in use"})
        os._exit(1)

    return exhausted
