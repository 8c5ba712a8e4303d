"""Every engine of the benchmark starts from the same weights and batches
(`bench.engine.InitialWeights`, `random_batches`), so the loss column of the
first step is one number up to the engines' roundings."""

from __future__ import annotations

import math

import pytest
import torch

from bench import run as bench_run
from bench.engine import InitialWeights, lm_loss, random_batches
from bench.workloads import model_layers, shrink, workloads
from labml_zero.launch import DistContext
from labml_zero.layers.layer_list import LayerChain

CPU = torch.device("cpu")
RANKS = 2  # the bench's --cpu runs two gloo ranks


def reference_loss(workload, *, seed: int, dtype: torch.dtype,
                   ranks: int = RANKS) -> float:
    """The first step's loss as the bench reports it (the mean over the ranks'
    batches, those of the bench's seed 0) of the unsharded model in one
    process, in `dtype`, its weights drawn with `seed`."""
    layers = model_layers(workload, device="meta", plain=True)
    for layer in layers:
        layer.to_empty(device=CPU)
    InitialWeights(workload, seed=seed, device=CPU).copy_into(layers)
    model = LayerChain(*layers).to(dtype)
    losses = []
    for rank in range(ranks):
        ctx = DistContext(rank, ranks, rank, CPU, "gloo")
        batch = random_batches(workload, ctx, count=1, seed=0)[0]
        with torch.no_grad():
            losses.append(lm_loss(model, batch).item())
    return sum(losses) / ranks


def first_loss_tolerance(workload, dtype: torch.dtype, *, sigmas: float = 6) -> float:
    r"""
    How far two engines' first losses may lie apart, from the dtype and sizes.

    The engines run the same products on the same bf16 values; they differ in
    where they round to bf16 (DDP's autocast keeps the embedding and the
    residual stream in fp32, ours and FSDP2 round them): $k = 2L + 3$
    roundings on a logit's path (the embedding, two residual sums per layer,
    the final norm, the readout), each a relative error of at most the unit
    roundoff $u$. At initialisation a logit is $z = \hat x \cdot w$ with
    $\hat x$ of unit variance and $w \sim \mathcal{N}(0, \sigma^2)$, so
    $|z| \approx \sigma \sqrt{d}$. A token's loss moves by
    $\sum_j (p_j - [j = y])\, \delta z_j$, and roundings of independent
    elements are independent with variance $u^2 z^2 / 3$ (uniform), so the mean
    over $N$ tokens moves with a standard deviation of about
    $\sqrt{k}\, u\, \sigma\sqrt{d} / \sqrt{3N}$; the tolerance is `sigmas` of
    them. A worst-case bound (every rounding of one sign) would be
    $\sqrt{3Nk}$ times larger and could not tell two seeds apart.
    """
    config = workload.model
    k = 2 * config.n_layers + 3
    u = torch.finfo(dtype).eps / 2
    tokens = RANKS * workload.batch * workload.seq
    logit = config.init_std * math.sqrt(config.d_model)
    return sigmas * math.sqrt(k) * u * logit / math.sqrt(3 * tokens)


def test_initial_weights_depend_on_the_layer_and_seed_only():
    workload = shrink(workloads()["W1"])
    first = InitialWeights(workload, seed=0, device=CPU)
    # drawn in another order, and another instance: the same values
    last = {k: v.clone() for k, v in first.layer(3).items()}
    embed = {k: v.clone() for k, v in first.layer(0).items()}
    other = InitialWeights(workload, seed=0, device=CPU)
    for index, expected in ((0, embed), (3, last)):
        for name, value in other.layer(index).items():
            assert torch.equal(value, expected[name]), (index, name)
    # another seed, other weights; two layers of one model differ too
    reseeded = InitialWeights(workload, seed=1, device=CPU).layer(0)
    assert not torch.equal(reseeded["embed_in.weight"], embed["embed_in.weight"])
    a, b = first.layer(1), first.layer(2)
    name = "attention.dense.weight"
    assert not torch.equal(a[name], b[name])


@pytest.mark.distributed
def test_engines_start_alike(tmp_path):
    """One step, no warm-up: the line's loss is the first step's, before any
    update. labml_zero, FSDP2 and DDP agree with each other and with the
    unsharded model within the bf16 tolerance, and a model drawn from another
    seed lies outside it."""
    engines_start_alike("W1", tmp_path)


@pytest.mark.distributed
@pytest.mark.parametrize("name,kernels", [("L1", "all"), ("L2", "none")])
def test_llama_engines_start_alike(name, kernels, tmp_path):
    """The same for the Llama workloads: every engine builds the same Llama
    model from the preset, shrunk, with the same weights; L1 with every fused
    kernel (their twins on a CPU, the chunked loss), L2 recomputing its
    layers, against the plain unsharded model."""
    engines_start_alike(name, tmp_path, kernels=kernels)


def engines_start_alike(name: str, tmp_path, *, kernels: str = "none"):
    tiny = shrink(workloads()[name])
    lines = bench_run.main([
        "--tiny", "--cpu", "--workloads", name, "--kernels", kernels,
        "--engines", "labml_zero,fsdp2,ddp", "--steps", "1", "--warmup", "0",
        "--no-profile", "--out", str(tmp_path / "start.jsonl")])
    losses = {line["engine"]: line["loss"] for line in lines}
    assert set(losses) == {"labml_zero", "fsdp2", "ddp"}
    tolerance = first_loss_tolerance(tiny, torch.bfloat16)
    exact = reference_loss(tiny, seed=0, dtype=torch.float64)
    for engine, loss in losses.items():
        assert abs(loss - exact) <= tolerance, (engine, loss, exact, tolerance)
    # The same bf16 program: ours and FSDP2 gather the same bf16 weights.
    assert losses["labml_zero"] == pytest.approx(
        reference_loss(tiny, seed=0, dtype=torch.bfloat16), abs=tolerance)
    # An engine that drew its weights with another seed would fail the check.
    for seed in (1, 2):
        other = reference_loss(tiny, seed=seed, dtype=torch.float64)
        assert abs(other - exact) > 2 * tolerance, (seed, other, exact)


@pytest.mark.distributed
def test_the_bounds_start_as_the_engines():
    """The one-device bounds draw the same weights: on one rank, the first
    losses of ours, the model alone and the update floor agree."""
    tiny = shrink(workloads()["W2-1"])
    lines = bench_run.main([
        "--tiny", "--cpu", "--world-size", "1", "--workloads", "W2-1",
        "--engines", "labml_zero,model_only,update_floor", "--steps", "1",
        "--warmup", "0", "--no-profile"])
    # half the tokens of two ranks: the tolerance of one rank's batch
    tolerance = first_loss_tolerance(tiny, torch.bfloat16) * math.sqrt(RANKS)
    exact = reference_loss(tiny, seed=0, dtype=torch.float64, ranks=1)
    for line in lines:
        assert abs(line["loss"] - exact) <= tolerance, (line["engine"], line)
