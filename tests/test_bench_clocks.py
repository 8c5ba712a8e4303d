"""The GPU clock sampler of the benchmark, on a CPU: parsing, the timed window, and
the background `nvidia-smi` through a stand-in with the same output format."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
import time

import pytest
import torch

from bench.gpu_clocks import (
    CLOCK_FIELDS, SW_POWER_CAP, ClockSample, ClockWatch, gpu_id, parse_sample, summarize,
)

# a line as an H200's driver writes it for the query
LINE = "2026/12/03 16:50:57.204, 1530, 1980, 694.03, 700.00, 0x0000000000000004"


def test_a_driver_line_is_parsed():
    sample = parse_sample(LINE)
    assert (sample.sm_mhz, sample.sm_max_mhz, sample.power_w, sample.power_limit_w,
            sample.reasons) == (1530.0, 1980.0, 694.03, 700.0, SW_POWER_CAP)
    assert sample.at == pytest.approx(time.mktime((2026, 12, 3, 16, 50, 57, 0, 0, -1)) + 0.204)


@pytest.mark.parametrize("line", [
    "", "timestamp, clocks.sm [MHz], clocks.max.sm [MHz], power.draw [W], "
    "power.limit [W], clocks_event_reasons.active",
    "2026/12/03 16:50:57.204, [N/A], 1980, 694.03, 700.00, 0x4",
    "2026/12/03 16:50:57.204, 1530, 694.03, 0x4",
    "No devices were found",
])
def test_other_lines_are_not_samples(line):
    assert parse_sample(line) is None


def test_only_the_window_is_summarized():
    samples = [ClockSample(t, mhz, 1980, watts, 700, reasons)
               for t, mhz, watts, reasons in [
        (0.5, 1980, 100, 0),  # warm-up: left out
        (1.0, 1500, 700, SW_POWER_CAP), (1.5, 1600, 690, SW_POWER_CAP | 0x1),
        (2.0, 1700, 600, 0), (2.0, 1800, 650, 0),
        (2.5, 1980, 80, 0),  # profiled step: left out
    ]]
    summary = summarize(samples, 1.0, 2.0)
    assert set(summary) == set(CLOCK_FIELDS)
    assert summary["clock_samples"] == 4
    assert summary["sm_clock_mhz_mean"] == pytest.approx((1500 + 1600 + 1700 + 1800) / 4)
    assert summary["power_w_mean"] == pytest.approx((700 + 690 + 600 + 650) / 4)
    assert (summary["sm_clock_max_mhz"], summary["power_limit_w"]) == (1980, 700)
    assert summary["power_capped_share"] == 0.5
    assert summarize(samples, 3.0, 4.0) is None


def test_a_cpu_has_no_gpu_to_watch():
    assert gpu_id(torch.device("cpu")) is None
    with ClockWatch(None) as watch:
        pass
    assert watch.during(0, time.time()) is None


def stand_in(folder, body: str) -> None:
    """An executable `nvidia-smi` in `folder` that runs `body` with Python."""
    path = folder / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_watch_reads_what_nvidia_smi_writes(tmp_path, monkeypatch):
    # the stand-in checks the arguments the watch passes, then writes a sample
    # every 10 ms, with the power cap set in every other one, until terminated
    stand_in(tmp_path, """
        import datetime, sys, time
        assert sys.argv[1:3] == ["-i", "GPU-test"], sys.argv
        assert "--query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active" in sys.argv
        assert sys.argv[-2:] == ["-lms", "10"], sys.argv
        i = 0
        while True:
            now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
            cap = "0x4" if i % 2 else "0x0"
            print(f"{now}, {1500 + i % 2 * 100}, 1980, 650.5, 700.00, {cap}", flush=True)
            i += 1
            time.sleep(0.01)
    """)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with ClockWatch("GPU-test", interval_ms=10) as watch:
        time.sleep(0.5)
        start = time.time()
        time.sleep(0.5)
        end = time.time()
    summary = watch.during(start, end)
    assert summary["clock_samples"] >= 10
    assert 1500 <= summary["sm_clock_mhz_mean"] <= 1600
    assert summary["power_w_mean"] == pytest.approx(650.5)
    assert 0.2 < summary["power_capped_share"] < 0.8
    assert not os.path.exists(watch._path)  # its own temporary file, removed


def test_a_failing_nvidia_smi_fails_nothing(tmp_path, monkeypatch):
    stand_in(tmp_path, """
        print("Failed to initialize NVML: Driver/library version mismatch")
        raise SystemExit(9)
    """)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with ClockWatch("GPU-test") as watch:
        time.sleep(0.2)
    assert watch.during(0, time.time()) is None
