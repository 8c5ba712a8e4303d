"""`neox/step_metrics.py`: a token's FLOPs, MFU and the step's indicators."""

import math

import torch

from labml_zero.finetune.job import Totals
from labml_zero.finetune.step_metrics import (StepMeter, host_peak_gib, mfu,
                                              peak_flops, peak_flops_of)


def test_a_cpu_has_no_peak():
    assert peak_flops(torch.device("cpu"), torch.float32) is None


def test_indicators_of_a_step():
    meter = StepMeter(token_flops=10.0, peak=100.0, world_size=2,
                      device=torch.device("cpu"))
    totals = Totals(loss_sum=5.0, correct=1.0, tokens=10.0, grad_squares=9.0)
    out = meter.indicators(totals, lr=0.5, scale=1024.0)
    assert out["lr"] == 0.5 and out["grad_norm"] == 3.0
    assert out["loss_scale"] == 1024.0 and out["memory.peak"] > 0
    # MFU: tokens/s × FLOPs a token over the peak of both devices
    assert math.isclose(out["mfu"], out["tokens_per_s"] * 10.0 / 200.0)
    # on a CPU the device's peak is the host's: no second series
    assert "memory.host" not in out


def test_a_device_off_the_host_records_the_hosts_memory_too():
    """Any device but the CPU (here `meta`, whose peak falls back on the
    host's as a CPU's does): `memory.host` is the process's resident peak,
    and the run's last line names both peaks."""
    meter = StepMeter(token_flops=10.0, peak=None, world_size=1,
                      device=torch.device("meta"), warmup=1)
    totals = Totals(loss_sum=5.0, correct=1.0, tokens=10.0, grad_squares=9.0)
    meter.indicators(totals, lr=0.5, scale=None)
    out = meter.indicators(totals, lr=0.5, scale=None)
    resident = host_peak_gib()
    assert 0 < out["memory.host"] <= resident
    assert "mfu" not in out  # no peak FLOP/s given
    line = meter.steady_line()
    assert line.startswith("tokens/s over steps 2..2 of this run (after 1 warm-up): ")
    assert line.endswith(f"GiB, host {host_peak_gib():.2f} GiB")


def test_peak_is_the_data_sheets_dense_figure_in_flops():
    """FLOP/s, not TFLOP/s: bf16 and fp16 share the tensor cores' dense rate,
    fp32 runs through TF32 at half; a PCIe H100 is not its SXM twin."""
    assert peak_flops_of("NVIDIA H200", torch.bfloat16) == 989.4e12
    assert peak_flops_of("NVIDIA H200", torch.float16) == 989.4e12
    assert peak_flops_of("NVIDIA H200", torch.float32) == 494.7e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert peak_flops_of("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    # the NVL cards' sheets give 1,671 TFLOP/s bf16 "with sparsity": not the
    # SXM figure their names' "H100" and "H200" would otherwise match
    for nvl in ("NVIDIA H100 NVL", "NVIDIA H200 NVL"):
        assert peak_flops_of(nvl, torch.bfloat16) == 1671e12 / 2
    assert peak_flops_of("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12
    # an unknown GPU, a CPU and a dtype without tensor-core peak get none
    assert peak_flops_of("NVIDIA GeForce GT 710", torch.bfloat16) is None
    assert peak_flops_of("cpu", torch.bfloat16) is None
    assert peak_flops_of("NVIDIA H200", torch.float64) is None
    # fp8 (either format): the H100 data sheet's sparse figures halved, SXM
    # 3958 and PCIe 3026; none on an A100
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert peak_flops_of("NVIDIA H200", fp8) == 1978.9e12
        assert peak_flops_of("NVIDIA H100 80GB HBM3", fp8) == 1978.9e12
        assert peak_flops_of("NVIDIA H100 PCIe", fp8) == 3026e12 / 2
        assert peak_flops_of("NVIDIA A100-SXM4-80GB", fp8) is None


def test_mfu_of_a_step_on_the_data_sheet():
    # W1: 59.2k tokens/s of 9.07 GFLOPs each on one H200 is 54%, not the 68%
    # a 790 TFLOP/s measured product would give
    share = mfu(token_flops=9.07e9, tokens_per_s=59.2e3, world_size=1,
                peak=peak_flops_of("NVIDIA H200", torch.bfloat16))
    assert math.isclose(share, 9.07e9 * 59.2e3 / 989.4e12, rel_tol=1e-12)
    assert mfu(token_flops=1.0, tokens_per_s=1.0, world_size=1, peak=None) is None
