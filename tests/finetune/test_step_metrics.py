"""`neox/step_metrics.py`: a token's FLOPs, MFU and the step's indicators."""

import math

import torch

from labml_zero.finetune.job import Totals
from labml_zero.finetune.step_metrics import StepMeter, flops_per_token, peak_flops


def test_flops_per_token():
    # 6Ψ_m for the weights' forward and backward, 12·L·d·T for attention
    assert flops_per_token(matmul_params=1000, n_layers=2, d_model=8,
                           seq_len=4) == 6 * 1000 + 12 * 2 * 8 * 4
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
