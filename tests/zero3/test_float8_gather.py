"""Gathering weights in fp8 (labml_zero/zero3/float8_gather.py) on gloo ranks:
the gathered chunk is each marked weight rounded once at its chunk's
power-of-two scale and every other element exact, the bytes are the codes and
the other elements, and a product's own power-of-two cast of a gathered weight
reads the same codes. Training through it is tests/layers/test_float8.py's,
at world sizes 2 and 3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labml_zero.zero3 import ZeroConfig
from labml_zero.zero3.float8_gather import (E4M3_MAX, Float8Gather, fp8_gathered,
                                            mark_fp8_gathered)
from labml_zero.zero3.sharded_model import Zero3Layer
from tests.distributed import run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model() -> nn.Sequential:
    """Odd sizes; the second linear's weight is ten times smaller than the
    first's, so a chunk holding both rounds it at the first one's scale."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40),
                      nn.Linear(40, 24, bias=False), nn.Linear(24, 8))
    with torch.no_grad():
        m[1].weight.uniform_(0.5, 1.5)
        m[2].weight.mul_(0.1)
    return m


MARKED = ("0.weight", "2.weight")  # the last linear stays plain


def rounded(w: torch.Tensor, scale: float) -> torch.Tensor:
    """fp8(s w) / s, computed apart from the engine."""
    return ((w.double() * scale).clamp(-E4M3_MAX, E4M3_MAX)
            .to(torch.float8_e4m3fn).double() / scale)


def gather_once(ctx, dtype_name: str, chunk_numel: int, offload: bool):
    """Per rank: the gathered parameters, each chunk's scale and parameter
    names, and the all-gather's bytes; `offload` moves the shards to host
    memory first (copied up at each gather)."""
    dtype = DTYPES[dtype_name]
    m = model().to(dtype)
    for name in MARKED:
        mark_fp8_gathered(m.get_parameter(name))
    layer = Zero3Layer(m, ctx.rank, ctx.world_size, ctx.device, dtype,
                       config=ZeroConfig(dtype=dtype, chunk_numel=chunk_numel,
                                         align=4))
    for chunk in layer.chunks:
        if offload:
            chunk.offload_shard()
        chunk.gather()
        chunk.wait()
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    scales = [(float(c.transport.scale), c.names)
              for c in layer.chunks if isinstance(c.transport, Float8Gather)]
    sizes = [(c.transport.send_bytes, c.numel) for c in layer.chunks
             if isinstance(c.transport, Float8Gather)]
    return params, scales, layer.comm.counter.bytes.get("all_gather", 0), sizes


@pytest.mark.distributed
@pytest.mark.parametrize("dtype_name,offload", [("fp32", False), ("bf16", False),
                                                ("bf16", True)])
@pytest.mark.parametrize("world_size,chunk_numel", [(2, 1200), (3, 4096)])
def test_the_gathered_chunk_is_rounded_once_at_its_scale(world_size, chunk_numel,
                                                         dtype_name, offload):
    dtype = DTYPES[dtype_name]
    reference = {n: p.detach() for n, p in model().to(dtype).named_parameters()}
    results = run_distributed(gather_once, world_size, dtype_name, chunk_numel,
                              offload)
    params, scales, sent, sizes = results[0]
    assert scales, "no chunk gathered in fp8"
    covered = set()
    for scale, names in scales:
        marked = [n for n in names if n in MARKED]
        # the chunk's scale: the largest power of two that keeps its largest
        # marked magnitude within e4m3's range
        amax = max(float(reference[n].abs().max()) for n in marked)
        assert scale == 2.0 ** torch.floor(torch.log2(torch.tensor(E4M3_MAX / amax)))
        assert scale * amax <= E4M3_MAX < 2 * scale * amax
        for name in names:
            expected = (rounded(reference[name], scale) if name in MARKED
                        else reference[name].double())
            assert torch.equal(params[name].double(), expected), name
            covered.add(name)
    # the weight ten times smaller is rounded, not left as it was
    assert not torch.equal(params["2.weight"], reference["2.weight"])
    assert covered >= set(MARKED)
    # every rank decoded the same chunk
    for other in results[1:]:
        for name in params:
            assert torch.equal(other[0][name], params[name]), name
    # the bytes: per fp8 chunk, N_d ranks' codes and other elements; the codes
    # are one byte an element, under the p bytes of a plain gather
    assert sent == sum(world_size * send for send, _ in sizes)
    for send, numel in sizes:
        assert numel // world_size <= send < numel // world_size * reference[
            MARKED[0]].element_size()


def test_no_chunk_is_gathered_in_fp8_without_a_mark_or_with_one_rank():
    m = model()
    mark_fp8_gathered(m[0].weight)
    assert fp8_gathered(m[0].weight) and not fp8_gathered(m[3].weight)
    layer = Zero3Layer(m, 0, 1, "cpu", torch.float32,
                       config=ZeroConfig(dtype=torch.float32, chunk_numel=4096))
    assert not any(isinstance(c.transport, Float8Gather) for c in layer.chunks)
    assert all(c.full_is_shard for c in layer.chunks)


def test_a_products_power_of_two_cast_reads_the_gathered_codes():
    """torchao's cast of a gathered weight at its own power-of-two scale,
    decoded, is the weight itself: the product reads the codes the gather
    sent. At a scale that is not a power of two it is not (the weight would be
    rounded twice)."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    w = model()[2].weight.detach().to(torch.bfloat16)
    chunk_scale = 2.0 ** 8  # coarser than the tensor's own (its amax is small)
    gathered = rounded(w, chunk_scale).to(torch.bfloat16)

    def cast(power_of_two: bool) -> torch.Tensor:
        return hp_tensor_to_float8_dynamic(
            gathered, torch.float8_e4m3fn, LinearMMConfig(),
            scaling_granularity=ScalingGranularity.TENSORWISE,
            round_scales_to_power_of_2=power_of_two).to_original_precision()

    assert torch.equal(cast(True), gathered)
    assert not torch.equal(cast(False), gathered)


def test_the_largest_e4m3_value():
    assert E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max == 448


def gather_in_groups(ctx):
    """Hybrid sharding, groups of two ranks: the gathered parameters."""
    m = model().to(torch.bfloat16)
    for name in MARKED:
        mark_fp8_gathered(m.get_parameter(name))
    layer = Zero3Layer(m, ctx.rank % 2, 2, ctx.device, torch.bfloat16,
                       config=ZeroConfig(dtype=torch.bfloat16, chunk_numel=1200,
                                         align=4, shard_group_size=2))
    assert all(isinstance(c.transport, Float8Gather) for c in layer.chunks)
    for chunk in layer.chunks:
        chunk.gather()
        chunk.wait()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.distributed
def test_hybrid_groups_gather_what_one_group_gathers():
    """Four ranks in two shard groups: each group agrees on its chunks' scales
    within itself, and both decode what two ranks alone decode."""
    alone = run_distributed(gather_once, 2, "bf16", 1200, False)[0][0]
    for got in run_distributed(gather_in_groups, 4):
        for name, value in alone.items():
            assert torch.equal(got[name], value), name
