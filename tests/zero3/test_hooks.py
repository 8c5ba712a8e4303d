"""The schedule's bound on gathered units, counted in forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labml_zero.planner.sharding import shard_model, zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.chunk import ChunkState
from labml_zero.zero3.hooks import Phase
from labml_zero.planner.memory_model import gathered_peak, root_unit_bytes
from tests.zero3.models import batch, tiny_layers
from tests.zero3.test_sharded_model import gradient_mismatch


def count_gathered(runtime) -> dict[Phase, int]:
    """After every gather (prefetches included), how many units (the root
    aside) hold a gathered chunk; the most per phase."""
    peaks = {Phase.FORWARD: 0, Phase.BACKWARD: 0}

    def gathered() -> int:
        return sum(any(c.state is not ChunkState.SHARDED for c in u.chunks)
                   for u in runtime.units)

    for unit in runtime.units:
        def gather(original=unit.gather) -> None:
            original()
            peaks[runtime.phase] = max(peaks[runtime.phase], gathered())

        unit.gather = gather
    return peaks


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("api", ["layers", "model"])
@pytest.mark.parametrize("freeze", [False, True])
def test_at_most_one_plus_depth_units_gathered(depth, api, freeze):
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4,
                        prefetch_depth=depth)
    layers = tiny_layers(0, freeze=freeze)
    if api == "layers":
        model = Zero3Sequential(zero3_layers(layers, device="cpu", config=config))
    else:
        model = shard_model(nn.Sequential(*layers), layers, device="cpu",
                            config=config)
    peaks = count_gathered(model.runtime)
    for step in range(2):
        x, y = batch(step, 4)
        nn.functional.mse_loss(model(x), y).backward()
    assert peaks == {Phase.FORWARD: 1 + depth, Phase.BACKWARD: 1 + depth}


class TwoStreams(nn.Module):
    """A layer whose output is a tuple of two tensors that need a gradient:
    `a` feeds both of the next layer's outputs, `b` only the second."""

    def __init__(self, d: int):
        super().__init__()
        self.fa, self.fb = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        a, b = (x, x) if isinstance(x, torch.Tensor) else x
        a = torch.tanh(self.fa(a))
        return a, torch.tanh(self.fb(b)) + a


class Merge(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.out = nn.Linear(d, d)

    def forward(self, pair):
        a, b = pair
        return self.out(a * b)


def two_stream_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [TwoStreams(8) for _ in range(4)] + [Merge(8)]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_unit_with_several_outputs_holds_the_same_bound(depth):
    """Several outputs are joined into one autograd node: the backward pass
    holds 1 + depth units as with one output, and the gradients are those of
    the unsharded model."""
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4,
                        prefetch_depth=depth)
    layers = two_stream_layers()
    reference = nn.Sequential(*two_stream_layers())
    model = shard_model(nn.Sequential(*layers), layers, device="cpu", config=config)
    peaks = count_gathered(model.runtime)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert peaks == {Phase.FORWARD: 1 + depth, Phase.BACKWARD: 1 + depth}
    # the joined output keeps the layer's structure
    with torch.no_grad(), model.runtime.gathered():
        pair = layers[0](x)
    assert isinstance(pair, tuple) and len(pair) == 2
    # One rank in fp32: the same operations in the same order as the
    # reference, and a reduction over one rank, so the gradients are equal.
    assert gradient_mismatch(model, reference, None) == 0.0


def test_the_root_unit_is_gathered_for_the_whole_step_as_the_model_counts():
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    layers = tiny_layers(0, freeze=False)
    # the first and last layers are the root unit, the blocks the units
    model = shard_model(nn.Sequential(*layers), layers[1:4], device="cpu",
                        config=config)
    root = model.runtime.root
    held = []
    for unit in model.runtime.units:
        def gather(original=unit.gather) -> None:
            original()
            held.append(all(c.is_gathered for c in root.chunks))

        unit.gather = gather
    x, y = batch(0, 4)
    nn.functional.mse_loss(model(x), y).backward()
    # gathered at every gather of the forward and the backward pass
    assert held and all(held)
    gathered = sum(c.numel * c.full.element_size() for c in root.chunks)
    assert root_unit_bytes(model.layout, param_bytes=4) == gathered > 0
    assert not any(c.is_gathered for c in root.chunks)  # released at the end


class Tokens(nn.Module):
    """A tiny embedding whose matrix the readout reads too (tied)."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)

    def forward(self, ids):
        return self.embed(ids)


def tied_layers() -> list[nn.Module]:
    from tests.zero3.models import Block

    torch.manual_seed(0)
    layers = [Tokens(11, 13), Block(13, 29), Block(13, 17),
              nn.Linear(13, 11, bias=False)]
    layers[-1].weight = layers[0].embed.weight
    return layers


@pytest.mark.parametrize("depth", [0, 1])
def test_a_held_unit_is_gathered_for_the_whole_step_as_the_model_counts(depth):
    """`zero3_layers`' owner of a tied matrix: gathered at every gather of
    both passes, beside at most $1 + D$ other units, and the bytes gathered
    at once are the memory model's `gathered_peak` (held groups included)."""
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4,
                        prefetch_depth=depth)
    model = Zero3Sequential(zero3_layers(tied_layers(), device="cpu",
                                         config=config))
    runtime = model.runtime
    held = [u for u in runtime.units if u.held]
    assert [u.index for u in held] == [0] and model.layout.held == {0}
    peaks = {Phase.FORWARD: 0, Phase.BACKWARD: 0}
    seen = {"held": True, "bytes": 0}
    for unit in runtime.units:
        def gather(original=unit.gather) -> None:
            original()
            gathered = [c for u in runtime.units for c in u.chunks
                        if c.state is not ChunkState.SHARDED]
            seen["bytes"] = max(seen["bytes"], sum(c.numel * 4 for c in gathered))
            if runtime.phase is not Phase.IDLE:
                seen["held"] &= all(c.is_gathered for c in held[0].chunks)
            others = sum(any(c.state is not ChunkState.SHARDED for c in u.chunks)
                         for u in runtime.units if not u.held)
            peaks[runtime.phase] = max(peaks[runtime.phase], others)

        unit.gather = gather
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids).square().mean().backward()
        assert not runtime.gathered_chunks()
    assert seen["held"]
    assert peaks == {Phase.FORWARD: 1 + depth, Phase.BACKWARD: 1 + depth}
    assert seen["bytes"] == gathered_peak(model.layout, depth, 4)


def test_grad_ready_callbacks_run_in_registration_order():
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu",
                                         config=config))
    calls = []
    model.runtime.on_grad_ready(lambda shard, *, after: calls.append(("a", shard)))
    model.runtime.on_grad_ready(lambda shard, *, after: calls.append(("b", shard)))
    x, y = batch(0, 4)
    nn.functional.mse_loss(model(x), y).backward()
    shards = model.get_trainable_chunk()
    # each trainable chunk once per backward, both callbacks, in order
    assert [tag for tag, _ in calls] == ["a", "b"] * len(shards)
    assert {id(s) for _, s in calls} == {id(s) for s in shards}
    # the callbacks can be read, in order, but not replaced by assignment
    assert len(model.runtime.grad_ready) == 2
    with pytest.raises(AttributeError):
        model.runtime.grad_ready = lambda shard, *, after: None
    assert len(model.runtime.grad_ready) == 2


def test_a_removed_grad_ready_callback_is_not_called():
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu",
                                         config=config))
    calls = []
    kept = model.runtime.on_grad_ready(lambda shard, *, after: calls.append("kept"))
    removed = model.runtime.on_grad_ready(lambda shard, *, after: calls.append("gone"))
    removed.remove()
    removed.remove()  # a second remove does nothing, as a module hook's
    x, y = batch(0, 4)
    nn.functional.mse_loss(model(x), y).backward()
    assert calls == ["kept"] * len(model.get_trainable_chunk())
    assert len(model.runtime.grad_ready) == 1
    # a handle is also a context manager: registered for the block only
    kept.remove()
    with model.runtime.on_grad_ready(lambda shard, *, after: calls.append("block")):
        nn.functional.mse_loss(model(x), y).backward()
    nn.functional.mse_loss(model(x), y).backward()
    assert calls.count("block") == len(model.get_trainable_chunk())
    assert model.runtime.grad_ready == ()


def test_a_resident_chunk_is_a_state_that_outlives_a_forced_release():
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu", config=config))
    frozen = next(c for c in model.chunks if not c.trainable)
    assert frozen.state is ChunkState.SHARDED and not frozen.is_gathered
    frozen.keep_resident()
    for step in range(2):
        x, y = batch(step, 4)
        nn.functional.mse_loss(model(x), y).backward()
        # the hooks released every other chunk; this one stays gathered
        assert frozen.state is ChunkState.RESIDENT and frozen.is_gathered
        assert [c for c in model.chunks if c.is_gathered] == [frozen]
    frozen.release()
    assert frozen.state is ChunkState.RESIDENT
    # new weights (a load) drop the gathered copy, not the placement's decision
    frozen.release(force=True)
    assert frozen.state is ChunkState.SHARDED
    frozen.gather()
    assert frozen.state is ChunkState.GATHERING
    frozen.wait()
    assert frozen.state is ChunkState.RESIDENT


def test_a_chunk_of_meta_parameters_is_uninitialised_until_materialized():
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    from labml_zero.zero3 import Zero3Layer
    with torch.device("meta"):
        module = tiny_layers(0, freeze=False)[0]
    layer = Zero3Layer(module, 0, 1, "cpu", torch.float32, config=config)
    assert {c.state for c in layer.chunks} == {ChunkState.UNINITIALISED}
    assert not any(c.is_gathered for c in layer.chunks)
    layer.materialize(lambda name, param: nn.init.ones_(param))
    assert {c.state for c in layer.chunks} == {ChunkState.SHARDED}
    # a second call changes nothing: the chunks are initialised
    layer.materialize(lambda name, param: nn.init.zeros_(param))
    assert all(bool((c.shard.detach() == 1).any()) for c in layer.chunks)
