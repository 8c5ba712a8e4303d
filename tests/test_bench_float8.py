"""The float8 peer (`fsdp2_float8`): which linears it converts, one
`Float8Linear` against its bound from e4m3's 3 mantissa bits, training on 1 and 2
gloo ranks beside plain FSDP2, and its line in `bench.run`.

On CPU torchao's `emulate` computes the product of the fp8-rounded operands in
high precision instead of on fp8 tensor cores: the roundings tested here are
the GPU's, the accumulation is not.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from bench import baselines, engine, float8_peer
from bench import pair as bench_pair
from bench import run as bench_run
from bench.baselines import EngineUnavailable
from bench.workloads import (DECODER_LAYERS, flops_per_token, mfu,
                             model_layers, shrink)
from bench.workloads import workloads as all_workloads
from labml_zero.launch import DistContext
from labml_zero.neox.kernels import ModelKernels
from tests.distributed import run_distributed
from tests.tolerance import unit_roundoff

try:
    import torchao.float8 as float8
    from torchao.float8.float8_linear import Float8Linear
except Exception:  # not installed, or built for another torch
    float8 = Float8Linear = None
needs_torchao = pytest.mark.skipif(float8 is None, reason="torchao does not import")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def converted(workload_name: str, finetune: str | None = None):
    """The workload's tiny layers on meta, converted as the engine converts them."""
    workload = shrink(all_workloads()[workload_name])
    if finetune is not None:
        workload = replace(workload, finetune=finetune)
    layers, _, _ = engine.meta_layers(workload)
    before = {name for name, m in nn.ModuleList(layers).named_modules()
              if isinstance(m, nn.Linear)}
    float8_peer.convert_layers(layers, float8_peer.float8_config(torch.device("cpu")))
    return workload, layers, before


def float8_names(layers) -> set[str]:
    return {name for name, m in nn.ModuleList(layers).named_modules()
            if isinstance(m, Float8Linear)}


@needs_torchao
def test_the_layers_linears_are_converted_and_nothing_else():
    """GPT-NeoX at width 64: the four linears of each layer; the readout stays."""
    _, layers, before = converted("W4")
    names = float8_names(layers)
    expected = {f"{i}.{name}" for i in (1, 2) for name in (
        "attention.query_key_value", "attention.dense",
        "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}
    assert names == expected
    # the readout is a linear too, left plain (and the embedding is no linear)
    assert before - names == {"4.embed_out"}
    assert not isinstance(layers[-1].embed_out, Float8Linear)
    # the fp8 all-gather's weight wrapper on every converted weight
    for layer in layers:
        if isinstance(layer, DECODER_LAYERS):
            weight = layer.attention.query_key_value.weight
            assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor"


@needs_torchao
def test_a_dimension_not_a_multiple_of_16_stays_plain():
    """Tiny Llama: d 64 (q, k, v, o convert), d_ff 172 (the MLP's three stay)."""
    workload, layers, _ = converted("L1")
    assert workload.model.d_model % 16 == 0 and workload.model.d_ff % 16 != 0
    names = float8_names(layers)
    attention = {f"{i}.self_attn.{p}_proj" for i in (1, 2) for p in "qkvo"}
    assert names == attention
    for layer in layers[1:3]:
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert type(getattr(layer.mlp, name)) is nn.Linear
    # the filter is labml_zero's own (labml_zero/layers/float8.py)
    from labml_zero.layers.float8 import fp8_linear
    assert not fp8_linear(nn.Linear(64, 172, device="meta"), every_linear=True)
    assert fp8_linear(nn.Linear(64, 176, device="meta"), every_linear=True)
    # on the GPU only where the weight is large enough to gain
    assert not fp8_linear(nn.Linear(64, 176, device="meta"))


@needs_torchao
def test_frozen_weights_stay_frozen():
    """Bias-only: the swap makes a new weight parameter; it must stay frozen."""
    _, layers, _ = converted("W3", finetune="biases")
    fresh = engine.meta_layers(shrink(all_workloads()["W3"]))[0]
    for layer, plain in zip(layers, fresh):
        assert ({n: p.requires_grad for n, p in layer.named_parameters()}
                == {n: p.requires_grad for n, p in plain.named_parameters()})


def cast_error(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r"""
    The largest error of each element of `t` cast with a tensorwise scale:
    $u |t|$ (round to nearest, `dtype`'s mantissa) plus half a subnormal
    step, $\frac{1}{2} \epsilon \cdot \text{tiny}$, undone by the scale
    $s = \max_{\text{dtype}} / \max|t|$.
    """
    info = torch.finfo(dtype)
    scale = info.max / t.abs().max()
    return unit_roundoff(dtype) * t.abs() + info.eps * info.tiny / 2 / scale


def product_bound(a, da, b, db) -> torch.Tensor:
    """|a b - a' b'| <= |da| |b| + |a| |db| + |da| |db|, summed by the product,
    plus fp32's own accumulation over the inner size."""
    n = a.shape[-1]
    exact = a.abs() @ b.abs()
    return (da @ b.abs() + a.abs() @ db + da @ db
            + n * unit_roundoff(torch.float32) * exact)


@needs_torchao
def test_one_float8_linear_is_within_its_bound():
    """
    One `Float8Linear` (emulated, fp32) against `nn.Linear` on the same weights:
    output, input gradient and weight gradient, each element within the bound
    of its two operands' casts (e4m3 forward; e4m3 and e5m2 backward). A
    linear off by a factor 1 + 4u in its weight, about one e4m3 step, fails it.
    """
    torch.manual_seed(0)
    plain = nn.Linear(64, 48, bias=False)
    config = float8.Float8LinearConfig(emulate=True)
    fp8 = Float8Linear.from_float(
        nn.Linear(64, 48, bias=False), config=config)
    with torch.no_grad():
        fp8.weight.copy_(plain.weight)
    x = torch.randn(32, 64, requires_grad=True)
    x8 = x.detach().clone().requires_grad_(True)
    grad = torch.randn(32, 48)
    y, y8 = plain(x), fp8(x8)
    y.backward(grad)
    y8.backward(grad)

    w = plain.weight.detach()
    xd = x.detach()
    forward = product_bound(xd, cast_error(xd, E4M3), w.t(), cast_error(w, E4M3).t())
    assert ((y8 - y).abs() <= forward).all()
    grad_input = product_bound(grad, cast_error(grad, E5M2), w,
                               cast_error(w, E4M3))
    assert ((x8.grad - x.grad).abs() <= grad_input).all()
    grad_weight = product_bound(grad.t(), cast_error(grad, E5M2).t(), xd,
                                cast_error(xd, E4M3))
    assert ((fp8.weight.grad - plain.weight.grad).abs() <= grad_weight).all()
    # the bound is tight enough to see a weight off by about one e4m3 step
    wrong = xd @ (w * (1 + 4 * unit_roundoff(E4M3))).t()
    assert not ((y8.detach() - wrong).abs() <= forward).all()


# ## Training beside plain FSDP2

STEPS = 2
# fp8-rounded operands on the longest path to the logits of a tiny GPT-NeoX
# layer pair: each of a layer's two chained products rounds its input and its
# weight, and the second layer's branch reads the first's
ROUNDINGS = 2 * 2 * 2


def first_losses(ctx: DistContext, workload) -> dict:
    """Each engine's losses from the same seed and batches, and on rank 0 the
    plain model's largest logit on the first batch."""
    out = {}
    batches = engine.random_batches(workload, ctx, count=STEPS, seed=0)
    for name, build in (("fsdp2", baselines.build_fsdp2),
                        ("fsdp2_float8", float8_peer.build_fsdp2_float8)):
        torch.manual_seed(0)  # the same initial weights
        built = build(ctx, workload)
        out[name] = [built.step(batch).item() for batch in batches]
        if name == "fsdp2_float8":
            out["info"] = built.info
    # the plain model in fp32 on this rank's first batch
    layers = model_layers(workload, device="cpu")
    engine.InitialWeights(workload, seed=0, device=ctx.device).copy_into(layers)
    with torch.no_grad():
        h = batches[0][:, :-1]
        for layer in layers[:-1]:
            h = layer(h)
        out["max_logit"] = layers[-1](h).abs().max().item()
    return out


@needs_torchao
@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_trains_beside_fsdp2_within_fp8_tolerance(world_size):
    r"""
    Two steps on tiny W4: finite losses, and the first loss (before any update,
    the same weights and batch) within fp8's bound of plain FSDP2's. The
    cross-entropy moves by at most twice the largest change of a logit
    ($|\partial L / \partial z|_1 \le 2$); the layers' output, and so the
    logits, are off by at most `ROUNDINGS` $\cdot u$ of themselves to first
    order (the tolerance rule's chain, with e4m3's $u = 2^{-4}$).
    """
    workload = shrink(all_workloads()["W4"])
    ranks = run_distributed(first_losses, world_size, workload)
    for result in ranks:
        assert all(math.isfinite(x) for x in result["fsdp2_float8"] + result["fsdp2"])
        assert result["info"]["float8_linears"] == 8
        atol = 2 * ROUNDINGS * unit_roundoff(E4M3) * result["max_logit"]
        assert result["fsdp2_float8"][0] == pytest.approx(result["fsdp2"][0],
                                                          abs=atol)


# ## The benchmark's line


@pytest.mark.distributed
@needs_torchao
def test_tiny_run_writes_an_ok_line(tmp_path):
    out = tmp_path / "results.jsonl"
    lines = bench_run.main(["--tiny", "--cpu", "--workloads", "W4",
                            "--engines", "fsdp2_float8", "--steps", "2",
                            "--warmup", "1", "--no-profile", "--out", str(out)])
    assert [json.loads(t) for t in out.read_text().splitlines()] == lines
    (line,) = lines
    assert line["status"] == "ok", line
    assert line["engine"] == "fsdp2_float8" and line["loss_finite"]
    assert abs(line["loss"] - math.log(512)) < 1.0
    assert line["mfu"] is None and line["mfu_fp8"] is None  # no CPU peak
    assert line["info"]["float8_linears"] == 8
    assert "emulated" in line["info"]["float8"]
    # FSDP2's model states
    fsdp2 = baselines.fsdp2_memory(line["psi_trainable"], line["psi_frozen"], 2,
                                   offload=False)
    assert line["memory_model_gib"] == {k: v / 2**30 for k, v in fsdp2.items()}


def test_engine_is_listed_and_compiled():
    assert "fsdp2_float8" in bench_pair.ENGINES
    assert "fsdp2_float8" in bench_pair.COMPILED_ENGINES
    assert "fsdp2_float8" in bench_run.parse_args(["--engines", "fsdp2_float8"]
                                                  ).engine_list


def test_mfu_fp8_is_on_the_fp8_data_sheet_peak():
    """The same FLOPs over 1978.9 TFLOP/s: half the bf16 MFU on an H100/H200
    SXM; none on an A100 (no fp8) or a CPU."""
    w2 = all_workloads()["W2"]
    expected = flops_per_token(w2) * 19.2e3 / 2 / 1978.9e12
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        assert mfu(w2, 19.2e3, 2, name, dtype=E4M3) == pytest.approx(expected,
                                                                    rel=1e-12)
    assert mfu(w2, 19.2e3, 2, "NVIDIA H100 PCIe", dtype=E4M3) == pytest.approx(
        flops_per_token(w2) * 19.2e3 / 2 / 1513e12, rel=1e-12)
    assert mfu(w2, 19.2e3, 2, "NVIDIA A100-SXM4-80GB", dtype=E4M3) is None
    assert mfu(w2, 19.2e3, 2, "cpu", dtype=E4M3) is None


def test_every_line_computing_in_fp8_has_mfu_fp8():
    """The peer always; labml_zero only with its `fp8` kernel."""
    w1 = all_workloads()["W1"]
    fp8 = replace(w1, kernels=ModelKernels.from_names("loss,fp8"))
    assert bench_pair.computes_in_fp8("fsdp2_float8", w1)
    assert bench_pair.computes_in_fp8("labml_zero", fp8)
    assert not bench_pair.computes_in_fp8("labml_zero", w1)
    assert not bench_pair.computes_in_fp8("fsdp2", w1)


def test_skipped_without_torchao(monkeypatch):
    """No process when torchao cannot be found; `EngineUnavailable` with the
    reason when it is there but does not import."""
    real = bench_pair.importlib.util.find_spec
    monkeypatch.setattr(bench_pair.importlib.util, "find_spec",
                        lambda name: None if name == "torchao" else real(name))
    line = bench_pair.run_pair("fsdp2_float8", shrink(all_workloads()["W4"]),
                               bench_run.RunConfig(), world_size=2,
                               backend="gloo", timeout_s=10)
    assert line["status"] == "skipped" and "torchao" in line["reason"]

    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(EngineUnavailable, match="torchao"):
        float8_peer.import_float8()


def test_fused_bias_gelu_is_turned_off():
    from labml_zero.neox.kernels import ModelKernels

    workload = replace(shrink(all_workloads()["W4"]),
                       kernels=ModelKernels(bias_gelu=True, loss=True))
    kept = float8_peer.without_weight_kernels(workload).kernels
    assert not kept.bias_gelu and kept.loss
