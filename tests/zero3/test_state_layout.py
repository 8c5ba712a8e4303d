"""The optimizer's state layout: declared once, counted the same everywhere."""

from __future__ import annotations

import typing

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.optimizers import rounded_update
from labml_zero.planner import memory_model
from labml_zero.planner.placement import (Placement, ShardSpec,
                                          device_optimizer_bytes, resident_bytes)
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.state_layout import (BF16_KAHAN, BF16_MOMENTS,
                                           BF16_STOCHASTIC, EIGHT_BIT_BLOCK,
                                           EIGHT_BIT_MOMENTS, FP32_STATES,
                                           LAYOUTS,
                                           ShardOptimizer, StateLayout,
                                           StateTensor, state_layout)


def test_bytes_per_element_of_each_layout():
    assert FP32_STATES.bytes_per_element() == 4 + 4 + 4
    assert BF16_MOMENTS.bytes_per_element() == 4 + 2 + 2
    # an fp32 shard is its own master: the master's 4 bytes are not kept twice
    assert FP32_STATES.bytes_per_element(shard_is_master=True) == 4 + 4
    assert BF16_MOMENTS.bytes_per_element(shard_is_master=True) == 2 + 2
    assert [FP32_STATES.shard_is_master(p) for p in (2, 4)] == [False, True]
    # the memory model's default K is the default layout's
    assert memory_model.OPTIMIZER_BYTES == FP32_STATES.bytes_per_element()
    assert list(LAYOUTS) == ["fp32", "bf16-moments", "bf16-stochastic",
                             "bf16-kahan", "8bit-moments"]
    # one byte per moment and one fp32 scale per block of each
    assert EIGHT_BIT_MOMENTS.bytes_per_element() == \
        4 + 1 + 1 + 2 * 4 / EIGHT_BIT_BLOCK
    assert EIGHT_BIT_MOMENTS.bytes_per_element(shard_is_master=True) == \
        1 + 1 + 2 * 4 / EIGHT_BIT_BLOCK
    # no master: the bf16 shard is the weight, and nothing is dropped for an
    # fp32 shard, which has no copy to drop
    assert BF16_STOCHASTIC.bytes_per_element() == 2 + 2
    assert BF16_STOCHASTIC.bytes_per_element(shard_is_master=True) == 2 + 2
    assert not BF16_STOCHASTIC.shard_is_master(4)
    # a bf16 compensation beside the bf16 weight: not a master, so an fp32
    # shard keeps its (unused) 2 bytes too
    assert BF16_KAHAN.bytes_per_element() == 2 + 2 + 2
    assert BF16_KAHAN.bytes_per_element(shard_is_master=True) == 2 + 2 + 2
    assert not BF16_KAHAN.shard_is_master(4)
    assert BF16_KAHAN.master is None
    assert BF16_KAHAN.compensation.name in {t.name for t in BF16_KAHAN.moments}
    # the one pass reads and writes K bytes of state each
    assert (rounded_update.one_pass_bytes(2, 4)
            - rounded_update.one_pass_bytes(2, 4, BF16_MOMENTS)) == 2 * (12 - 8)


def test_placement_counts_each_layouts_bytes():
    shards = [ShardSpec(100, True), ShardSpec(40, True), ShardSpec(60, False)]
    on_host = Placement(optimizer_on_host=frozenset({1}))
    for p in (2, 4):
        for layout in (FP32_STATES, BF16_MOMENTS, BF16_STOCHASTIC,
                       BF16_KAHAN, EIGHT_BIT_MOMENTS):
            k = layout.bytes_per_element()
            k_device = device_optimizer_bytes(p, layout)
            assert k_device == (k - 4 if p == 4 and layout.master else k)
            split = resident_bytes(on_host, shards, param_bytes=p, states=layout)
            # a host home's master never aliases the shard: all of K, plus
            # the 4-byte staging buffer; without a master, the host's copy
            # of the weight (p) besides
            weight = p if layout.master is None else 0
            assert layout.host_bytes_per_element(p) == k + weight
            assert split.host == (k + weight + 4) * 40
            assert split.device == (p + 4 + k_device) * 100 + (p + 4) * 40 + p * 60


def test_a_layout_is_checked_when_declared_and_chosen():
    with pytest.raises(ValueError, match="names a state twice"):
        StateLayout("twice", (StateTensor("m", torch.float32),
                              StateTensor("m", torch.bfloat16)))
    with pytest.raises(ValueError, match="more than one master"):
        StateLayout("two", (StateTensor("a", torch.float32, master=True),
                            StateTensor("b", torch.float32, master=True)))
    with pytest.raises(ValueError, match="a master and a compensation"):
        StateLayout("both", (StateTensor("a", torch.float32, master=True),
                             StateTensor("c", torch.bfloat16, compensation=True)))
    with pytest.raises(ValueError, match="states must be one of fp32, "
                                         "bf16-moments, bf16-stochastic, "
                                         "bf16-kahan, 8bit-moments"):
        state_layout("int8")
    assert state_layout(BF16_MOMENTS) is BF16_MOMENTS
    with pytest.raises(ValueError, match="has no state 'v'"):
        FP32_STATES.dtype("v")


# a layout without a master has no host update (refused: see
# tests/optimizers/test_stochastic_rounding.py)
@pytest.mark.parametrize("layout,offload", [
    (FP32_STATES, None), (FP32_STATES, {0}), (BF16_MOMENTS, None),
    (BF16_MOMENTS, {0}), (BF16_STOCHASTIC, None), (BF16_KAHAN, None),
    (EIGHT_BIT_MOMENTS, None),
    (EIGHT_BIT_MOMENTS, {0})])
def test_adam_fp16_is_a_shard_optimizer_of_its_layout(layout, offload):
    shard = LocalShard(torch.randn(8).bfloat16(), trainable=True).param
    opt = AdamFP16([shard], lr=0.1, states=layout.name, offload=offload)
    # every member of the contract, typed: nothing for the engine to probe
    members = set(typing.get_type_hints(ShardOptimizer)) | {
        name for name in vars(ShardOptimizer)
        if not name.startswith("_") and callable(vars(ShardOptimizer)[name])}
    assert members == {"layout", "update_during_backward", "state_device",
                       "shard_state", "load_shard_state", "grad_ready"}
    assert all(hasattr(opt, name) for name in members)
    assert opt.layout is layout
    LocalShard.of(shard).grad = torch.ones(8)
    opt.step()
    state = opt.shard_state(shard)
    assert list(state) == ["step", *layout.names]
    for spec in layout.tensors:
        assert state[spec.name].dtype == spec.dtype
        assert state[spec.name].device == opt.state_device(shard)


def test_the_bytes_table_is_read_from_the_layouts():
    from labml_zero.zero3.state_layout import BF16_WEIGHT_BYTES, LAYOUTS, bytes_table

    rows = bytes_table().splitlines()[2:]
    assert len(rows) == len(LAYOUTS)
    for row, layout in zip(rows, LAYOUTS.values()):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == f"`{layout.name}`"
        assert cells[1] == {FP32_STATES: "float32", BF16_MOMENTS: "float32",
                            BF16_STOCHASTIC: "none",
                            BF16_KAHAN: "none; bfloat16 compensation",
                            EIGHT_BIT_MOMENTS: "float32"}[layout]
        # exact: every K is a sum of powers of two
        assert float(cells[3]) == layout.bytes_per_element()
        assert float(cells[4]) == BF16_WEIGHT_BYTES + layout.bytes_per_element()
    # the five choices' K from first principles: 4 + 4 + 4, 4 + 2 + 2, 2 + 2,
    # 2 + 2 + 2, and 4 + 1 + 1 with an fp32 scale per 256 elements for each
    # moment
    assert [float(r.split("|")[4]) for r in rows] == [12, 8, 4, 6, 6 + 8 / 256]
