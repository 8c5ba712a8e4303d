"""
The host's own single-thread speed: a fixed pure-Python loop, timed five times.

No torch, no GPU: when this loop's time moves between two moments of one run, the
host itself got faster or slower (a virtual machine's vCPUs share their physical
cores), and a host-bound step moves with it. The benchmark's results keep its
lines beside the W4 runs they were taken between.

    python -m bench.host_speed
"""

from __future__ import annotations

import time


def loop(iterations: int = 300_000) -> int:
    """Integer arithmetic and a small dict: the kind of work an interpreter does."""
    total, table = 0, {}
    for i in range(iterations):
        total += i * i % 7
        table[i & 1023] = total
    return total


def main() -> list[float]:
    times_ms = []
    for _ in range(5):
        start = time.perf_counter()
        loop()
        times_ms.append(1e3 * (time.perf_counter() - start))
    print("cpu_loop_ms", " ".join(f"{t:.1f}" for t in times_ms))
    return times_ms


if __name__ == "__main__":
    main()
