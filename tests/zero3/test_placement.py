"""Placement policies: hand-computed decisions, bytes moved and bytes resident."""

from __future__ import annotations

import functools

import pytest
import torch

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.memory_model import zero_model_states
from labml_zero.planner.placement import (GIB, OffloadTraffic, Placement, ShardSpec,
                                          StaticPlacement, auto_placement,
                                          offload_traffic, resident_bytes)

# model.chunks of a small model: embedding, a frozen chunk, two blocks, the head
SHARDS = [ShardSpec(100, True), ShardSpec(50, False), ShardSpec(100, True),
          ShardSpec(100, True), ShardSpec(60, True)]


@pytest.mark.parametrize("fraction, expected", [
    (0.0, set()),
    # 36 of 360 trainable elements: the head alone (60)
    (0.1, {4}),
    # 180 of 360: 60 + 100 is short, 60 + 100 + 100 is enough
    (0.5, {2, 3, 4}),
    (1.0, {0, 2, 3, 4}),
])
def test_static_optimizer_fraction_from_the_output_end(fraction, expected):
    placement = StaticPlacement(optimizer_cpu_fraction=fraction).place(SHARDS)
    assert placement.optimizer_on_host == expected
    assert placement.param_on_host == set()


def test_static_param_fraction_and_validation():
    placement = StaticPlacement(1.0, 0.5).place(SHARDS)
    # 205 of 410 elements over all chunks
    assert placement.param_on_host == {2, 3, 4}
    with pytest.raises(ValueError, match="needs optimizer_cpu_fraction"):
        StaticPlacement(0.5, 0.5)
    with pytest.raises(ValueError, match="optimizer_cpu_fraction must be in"):
        StaticPlacement(1.5)


def test_traffic_and_resident_bytes():
    placement = Placement(optimizer_on_host=frozenset({2, 3, 4}))
    # 260 offloaded elements: 4 bytes down, 2 up each
    traffic = offload_traffic(placement, SHARDS)
    assert traffic == OffloadTraffic(down=1040, up=520)
    assert traffic.seconds(520.0) == 2.0
    # device: 2·410 parameters + 4·360 gradients + 12·100 state; host: 16·260
    assert resident_bytes(placement, SHARDS) == (3460, 4160)
    # nothing offloaded: the memory model's (p + g + K)Ψ_t + pΨ_f with g = 4
    none = resident_bytes(Placement(), SHARDS)
    assert none == (zero_model_states(360, 50, 1, grad_bytes=4), 0)
    # parameters on the host too: their upload happens twice a step instead
    both = Placement(frozenset({0, 2, 3, 4}), frozenset({2, 3, 4}))
    assert offload_traffic(both, SHARDS) == OffloadTraffic(1440, 200 + 2 * 2 * 260)
    assert resident_bytes(both, SHARDS) == (2 * 150 + 4 * 360, 16 * 360 + 2 * 260)


def test_placement_checks_and_optimizer_positions():
    with pytest.raises(ValueError, match="chunk 1, which is frozen"):
        Placement(optimizer_on_host=frozenset({1})).check(SHARDS)
    with pytest.raises(ValueError, match="names chunk 5, but there are 5"):
        Placement(param_on_host=frozenset({5})).check(SHARDS)
    with pytest.raises(ValueError, match="trainable chunk 2"):
        Placement(param_on_host=frozenset({2})).check(SHARDS)
    placement = Placement(optimizer_on_host=frozenset({2, 3, 4}))
    # the optimizer numbers the trainable chunks 0..3: chunks 0, 2, 3, 4
    positions = placement.optimizer_offload(SHARDS)
    assert positions == {1, 2, 3}
    params = [torch.nn.Parameter(torch.zeros(s.numel)) for s in SHARDS if s.trainable]
    opt = AdamFP16(params, offload=positions)
    assert [p in opt.host for p in params] == [False, True, True, True]


def test_auto_everything_fits():
    # 5000 + 12·360 = 9320 <= 10000
    decided = auto_placement(SHARDS, device_capacity=10_000, measured_peak_other=5000)
    assert decided.placement == Placement()
    assert decided.predicted_peak == 9320
    assert decided.traffic == (0, 0)


@pytest.mark.parametrize("capacity, expected, peak", [
    # budget 7500: 9320 - 1200 (chunk 3) = 8120 is over, - 1200 (chunk 2) fits
    (8000, {2, 3}, 6920),
    # budget exactly 8120: one chunk, the later of the equal ones
    (8620, {3}, 8120),
    # budget 5100: every chunk, the head last (the smallest saving)
    (5600, {0, 2, 3, 4}, 5000),
])
def test_auto_offloads_fewest_chunks(capacity, expected, peak):
    decided = auto_placement(SHARDS, device_capacity=capacity,
                             measured_peak_other=5000, margin=500)
    assert decided.placement.optimizer_on_host == expected
    assert decided.predicted_peak == peak
    moved = sum(SHARDS[i].numel for i in expected)
    assert decided.traffic == (4 * moved, 2 * moved)


def test_auto_fp32_saves_eight_bytes():
    # fp32 shards are their own masters: 8 bytes of state per element on device
    decided = auto_placement(SHARDS, device_capacity=5000 + 8 * 360 - 800,
                             measured_peak_other=5000, param_bytes=4)
    # 800 bytes of state each for chunks 0, 2, 3: the latest of them goes
    assert decided.placement.optimizer_on_host == {3}
    # and its update comes up in fp32
    assert decided.traffic == (400, 400)


def test_auto_nothing_fits():
    with pytest.raises(ValueError, match=r"short by 3\.00 GiB") as error:
        auto_placement(SHARDS, device_capacity=8 * GIB,
                       measured_peak_other=10 * GIB, margin=GIB)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="device_capacity must be >= 0"):
        auto_placement(SHARDS, device_capacity=-1, measured_peak_other=0)


# ## From a measured first step, with the engine (one local rank, CPU)


def test_first_step_placement_probes_then_decides():
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from labml_zero.planner.placement import shard_specs
    from labml_zero.planner.placement_probe import first_step_placement
    from tests.zero3.models import batch, tiny_layers

    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=200, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=torch.device("cpu"),
                                         config=config))
    shards = shard_specs(model)
    trainable = [s.numel for s in shards if s.trainable]
    runs = []

    def forward_backward():
        x, y = batch(0, 4)
        torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        runs.append(1)

    # a "device" whose probe peaked at 10 kB, with 4·Σ trainable of it the
    # master_init copies; room for 12 bytes of state on all but one element in 3
    master_bytes = 4 * sum(trainable)
    other = 10_000
    capacity = other + 12 * sum(trainable) * 2 // 3
    decided = first_step_placement(
        model, forward_backward, margin=0, device_capacity=capacity,
        measure_peak=lambda run: (run(), other + master_bytes)[1])
    assert runs == [1]
    # the probe's gradients are gone: it trained nothing
    assert all(c.local.grad is None for c in model.chunks if c.trainable)
    # the same decision as auto_placement on the measured numbers
    expected = auto_placement(shards, device_capacity=capacity,
                              measured_peak_other=other, margin=0,
                              resident_world_size=1)
    assert decided == expected
    offloaded = sum(shards[i].numel for i in decided.placement.optimizer_on_host)
    assert offloaded >= sum(trainable) / 3
    assert decided.predicted_peak <= capacity
    # and it feeds the optimizer
    offload = decided.placement.optimizer_offload(shards)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-3, offload=offload)
    assert len(optimizer.host) == len(decided.placement.optimizer_on_host) > 0


def test_first_step_placement_on_cpu_needs_measurements():
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from labml_zero.planner.placement_probe import first_step_placement
    from tests.zero3.models import tiny_layers

    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=torch.device("cpu"),
                                         config=ZeroConfig(chunk_numel=200)))
    with pytest.raises(ValueError, match="needs measure_peak and device_capacity"):
        first_step_placement(model, lambda: None)


# ## The page's GPT-NeoX-20B figures


@functools.cache
def neox_20b_shards(world_size: int = 2) -> list[ShardSpec]:
    """`model.chunks` of the fully trained 20B model as the bench builds it."""
    from labml_zero.neox.model import build_layers, gpt_neox_20b
    from labml_zero.zero3 import ZeroConfig
    from labml_zero.zero3.chunk_layout import plan_chunks
    from labml_zero.planner.sharding import choose_chunk_numel
    from labml_zero.zero3.unit_chunks import param_specs

    layers = build_layers(gpt_neox_20b(), device="meta")
    specs, _ = param_specs([layer.named_parameters() for layer in layers])
    chunk = choose_chunk_numel(specs, world_size, ZeroConfig())
    shards = []
    for layer in layers:
        # one Zero3Layer (one layout) per layer, as zero3_layers builds them
        own, _ = param_specs([layer.named_parameters()])
        for spec in plan_chunks(own, chunk, world_size, align=64).chunks:
            shards.append(ShardSpec(spec.chunk_numel // world_size, spec.trainable))
    return shards


def test_gpt_neox_20b_memory_figures_of_the_page():
    shards = neox_20b_shards()
    assert len(shards) == 47  # embedding, 44 layers, final norm, readout
    s = sum(x.numel for x in shards)
    assert s / 1e9 == pytest.approx(10.28, abs=0.01)
    everything = resident_bytes(Placement(), shards)
    assert everything.device / 1e9 == pytest.approx(185, rel=0.01)
    # "62 + (1 - x) 123 GB on the device and 165 x GB on the host"
    half = StaticPlacement(optimizer_cpu_fraction=0.5).place(shards)
    split = resident_bytes(half, shards)
    x = sum(shards[i].numel for i in half.optimizer_on_host) / s
    assert split.device / 1e9 == pytest.approx(62 + (1 - x) * 123, rel=0.01)
    assert split.host / 1e9 == pytest.approx(165 * x, rel=0.01)


def test_gpt_neox_20b_traffic_of_the_page():
    """Half of the 20B model's optimizer state offloaded on 2 ranks: F = 5.1e9
    elements per rank, 4F = 20.6 GB down and 2F = 10.3 GB up per step; the copy
    down takes as long as the backward pass of T = x Φ / β tokens."""
    shards = neox_20b_shards()
    half = StaticPlacement(optimizer_cpu_fraction=0.5).place(shards)
    s = sum(x.numel for x in shards)
    f = sum(shards[i].numel for i in half.optimizer_on_host)
    assert f"{f / 1e9:.1f}" == "5.1"
    traffic = offload_traffic(half, shards)
    assert (traffic.down, traffic.up) == (4 * f, 2 * f)
    assert (f"{traffic.down / 1e9:.1f}", f"{traffic.up / 1e9:.1f}") == ("20.6",
                                                                        "10.3")
    # The link's break-even step: backward, 4/6 of 6ΨT FLOP over N_d GPUs at Φ
    # each, against the copy down on a link of β bytes/s, for any Φ and β.
    world, psi, x = 2, 2 * s, f / s
    for flops, bandwidth in ((400e12, 50e9), (790e12, 25e9)):
        tokens = x * flops / bandwidth
        backward = 4 * psi * tokens / (world * flops)
        assert traffic.seconds(bandwidth) == pytest.approx(backward, rel=1e-12)


def test_gpt_neox_20b_automatic_choice_of_the_page():
    # W5 measured: 18 chunks chosen; the largest chunks are the 44 layers, so
    # they are the last 18 layers (L26..L43, positions 27..44), not the readout
    shards = neox_20b_shards()
    layer_bytes = 12 * shards[1].numel
    other = 60 * GIB
    needed = 12 * sum(x.numel for x in shards) - 17.5 * layer_bytes
    decided = auto_placement(shards, device_capacity=int(other + needed),
                             measured_peak_other=other)
    assert decided.placement.optimizer_on_host == frozenset(range(27, 45))
    # the bytes per step and rank of the page (and of the W5 line)
    assert decided.traffic == OffloadTraffic(down=16_310_329_344, up=8_155_164_672)
    trainable = sum(x.numel for x in shards)
    offloaded = sum(shards[i].numel for i in decided.placement.optimizer_on_host)
    assert offloaded / trainable == pytest.approx(0.397, abs=0.001)


def test_auto_keeps_frozen_chunks_resident_in_the_room_left():
    # frozen chunk 1 (50 elements) gathered on 2 ranks: 2 * 50 * 2 = 200 bytes
    states = resident_bytes(Placement(), SHARDS).device
    decided = auto_placement(SHARDS, device_capacity=states + 200,
                             measured_peak_other=states - 12 * 360,
                             resident_world_size=2)
    assert decided.placement == Placement(resident=frozenset({1}))
    assert decided.predicted_peak == states + 200
    # one byte short: not resident
    decided = auto_placement(SHARDS, device_capacity=states + 199,
                             measured_peak_other=states - 12 * 360,
                             resident_world_size=2)
    assert decided.placement.resident == frozenset()
    # without the world size, nothing is made resident
    decided = auto_placement(SHARDS, device_capacity=10 * states,
                             measured_peak_other=states - 12 * 360)
    assert decided.placement.resident == frozenset()


def test_resident_only_for_frozen_chunks():
    with pytest.raises(ValueError, match="resident names trainable chunk 0"):
        Placement(resident=frozenset({0})).check(SHARDS)
    with pytest.raises(ValueError, match="both resident and on the host"):
        Placement(optimizer_on_host=frozenset({0, 2, 3, 4}), resident=frozenset({1}),
                  param_on_host=frozenset({1})).check(SHARDS)
