"""The automatic placement's report: its numbers and its printed lines."""

from __future__ import annotations

import torch

from labml_zero.planner.placement import ShardSpec, auto_placement, resident_bytes
from labml_zero.planner.placement_report import (
    decision_lines,
    host_rss_peak,
    measured_lines,
    summarize,
)

GIB = 1024**3


def decided_for_test():
    # three trainable chunks and a frozen one; room for one chunk's state only
    shards = [ShardSpec(1000, True), ShardSpec(3000, True), ShardSpec(2000, True),
              ShardSpec(500, False)]
    decided = auto_placement(shards, device_capacity=100_000,
                             measured_peak_other=100_000 - 12 * 1000)
    return shards, decided


def test_summary_counts_the_offloaded_chunks_bytes_and_peaks():
    shards, decided = decided_for_test()
    s = summarize(decided, shards)
    on_host = decided.placement.optimizer_on_host
    assert on_host == {1, 2}
    assert (s.offloaded_chunks, s.trainable_chunks) == (2, 3)
    assert s.offloaded_fraction == 5000 / 6000
    # 4 bytes down and p = 2 up per offloaded element
    assert (s.down, s.up) == (4 * 5000, 2 * 5000)
    assert s.device_peak == decided.predicted_peak
    assert s.host_states == resident_bytes(decided.placement, shards).host == 16 * 5000


def test_decision_lines_say_fraction_chunks_link_and_peaks():
    shards, decided = decided_for_test()
    text = "\n".join(decision_lines(decided, shards))
    assert "2 of 3 trainable chunks" in text
    assert "83.3% of the elements" in text
    assert "GB down" in text and "GB up" in text
    assert f"device {decided.predicted_peak / GIB:.2f} GiB" in text


def test_measured_lines_on_cpu_name_the_host_peak():
    shards, decided = decided_for_test()
    (line,) = measured_lines(decided, shards, device=torch.device("cpu"), steps=3)
    assert "after 3 steps" in line
    assert "device not measured on cpu" in line
    assert host_rss_peak() > 0
    assert "host resident set" in line
