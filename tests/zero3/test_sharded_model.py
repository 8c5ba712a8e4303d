"""Sharded training equals unsharded training: parity, gradients, memory and bytes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import shard_model, zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.unit_chunks import param_specs
from tests import tolerance
from tests.distributed import run_distributed
from tests.zero3.models import TINY_TERMS, Block, batch, tiny_layers

STEPS = 10
ROWS_PER_RANK = 3
LR = 3e-3
# fp32 through `tiny_layers` (tests/tolerance.py): parameters after the steps,
# and a value of one pass (a gradient, a loss), each at most about 1.5 in size
PARAM_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, steps=STEPS, lr=LR), 1.5)
VALUE_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, scale=1.5), 1.5)


def reference_flat_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def train_both(ctx, api: str, chunk_numel: int):
    """Train a sharded model and an unsharded reference side by side on each rank."""
    layers = tiny_layers()
    reference = nn.Sequential(*copy.deepcopy(layers)).to(ctx.device)
    config = ZeroConfig(dtype=torch.float32, chunk_numel=chunk_numel, align=4)
    if api == "sequential":
        model = Zero3Sequential(zero3_layers(layers, device=ctx.device, config=config))
    else:
        # The generic wrapper: an nn.Sequential with its middle blocks as units and
        # the first and last layers left to the root.
        model = shard_model(
            nn.Sequential(*layers), layers[1:4], device=ctx.device, config=config
        )
    names = [n for n, _ in reference.named_parameters()]
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=LR, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad],
        lr=LR,
        weight_decay=0.01,
    )
    rows = ROWS_PER_RANK * ctx.world_size
    report = {"grad_mismatch": 0.0, "missing_grads": 0}
    for step in range(STEPS):
        x, y = (t.to(ctx.device) for t in batch(step, rows))
        mine = slice(ctx.rank * ROWS_PER_RANK, (ctx.rank + 1) * ROWS_PER_RANK)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        shards = model.get_trainable_chunk()
        report["missing_grads"] += sum(LocalShard.of(s).grad is None for s in shards)
        if step == 0:
            report["grad_mismatch"] = gradient_mismatch(model, reference, ctx)
            report["comm"] = dict(model.runtime.comm.counter.elements)
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    with model.runtime.gathered():
        ours = [p.detach().clone() for p in nn.Sequential(*layers).parameters()]
    theirs = [p.detach() for p in reference.parameters()]
    report["max_diff"] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    report["names"] = names
    report["layout"] = model.layout
    return report


def gradient_mismatch(model, reference, ctx) -> float:
    """Largest difference between each shard gradient and the reference's slice."""
    worst = 0.0
    ref_grads = {id(p): p.grad for p in reference.parameters()}
    ref_params = list(reference.parameters())
    index = {id(p): i for i, p in enumerate(model_params(model))}
    for chunk in model.chunks:
        if not chunk.trainable:
            continue
        expected = torch.zeros(chunk.numel, device=chunk.shard.device)
        for slot, param in zip(chunk.spec.slots, chunk.params):
            grad = ref_grads[id(ref_params[index[id(param)]])]
            expected[slot.offset : slot.end] = grad.reshape(-1)
        lo = chunk.shard_offset
        mine = expected[lo : lo + chunk.shard_numel]
        worst = max(worst, (chunk.local.grad - mine).abs().max().item())
    return worst


def model_params(model) -> list[nn.Parameter]:
    if isinstance(model, Zero3Sequential):
        return [p for layer in model.layers for p in layer.module.parameters()]
    return list(model.model.parameters())


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,api,chunk_numel",
    [
        (1, "sequential", 64),
        (2, "sequential", 200),
        (3, "generic", 96),
        (4, "generic", 128),
    ],
)
def test_parity_with_unsharded_adamw(world_size, api, chunk_numel):
    reports = run_distributed(train_both, world_size, api, chunk_numel)
    for rank, report in enumerate(reports):
        assert report["max_diff"] <= PARAM_ERROR, (rank, report["max_diff"])
        # gradients are the average over ranks, equal to the full-batch gradient
        assert report["grad_mismatch"] <= VALUE_ERROR, (rank, report["grad_mismatch"])
        assert report["missing_grads"] == 0


def test_defaults_run_in_one_process_without_a_process_group():
    # The searched chunk size, bf16, no torch.distributed at all: a laptop script.
    model = Zero3Sequential(zero3_layers(tiny_layers(), device="cpu"))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-2)
    x, y = batch(0, 8)
    losses = []
    for _ in range(5):
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_labml_nn_style_zero3_layer():
    # labml-nn's constructor, one chunk per kind per layer, used alone and chained.
    from labml_zero.zero3 import Zero3Layer

    layers = [Zero3Layer(m, 0, 1, "cpu", torch.float32) for m in tiny_layers()]
    assert all(len(layer.chunks) <= 2 for layer in layers)
    x, _ = batch(0, 4)
    alone = layers[0](x)
    assert alone.shape == (4, 13)
    chained = Zero3Sequential(layers[1:])(alone.detach())
    assert chained.shape == (4, 5)
    with pytest.raises(ValueError, match="rank 1 of world size 2"):
        Zero3Layer(tiny_layers()[0], 1, 2, "cpu", torch.float32)


class Fork(nn.Module):
    """One input, two outputs: the pre-backward hook waits for either gradient."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(7, 11), nn.Linear(7, 9)

    def forward(self, x):
        return self.left(x), self.right(x)


class Join(nn.Module):
    """Two inputs (a tuple): the post-backward hook waits for both gradients."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(11, 5), nn.Linear(9, 5)

    def forward(self, pair):
        return self.left(pair[0]) * self.right(pair[1])


def test_layers_with_several_inputs_and_outputs():
    # A unit's tensors are hooked together (multi-grad hooks) when there are
    # several, one by one when there is one: the same gradients as unsharded.
    torch.manual_seed(0)
    layers = [Fork(), Join(), nn.Linear(5, 5)]
    reference = nn.Sequential(*copy.deepcopy(layers))
    config = ZeroConfig(dtype=torch.float32, chunk_numel=64, align=4)
    model = Zero3Sequential(zero3_layers(layers, device="cpu", config=config))
    x, y = batch(0, 6)
    for net in (model, reference):
        nn.functional.mse_loss(net(x), y).backward()
    assert all(LocalShard.of(s).grad is not None
               for s in model.get_trainable_chunk())
    assert gradient_mismatch(model, reference, None) <= VALUE_ERROR
    # every chunk released after the backward pass
    assert model.runtime.gathered_chunks() == []


class TwoSharedBlocks(nn.Module):
    """Hugging Face-like: an embedding, a list of blocks `h`, a head; blocks 1
    and 2 share one linear layer (tensor and bias)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(7, 13)
        self.h = nn.ModuleList(Block(13, 29) for _ in range(3))
        self.h[2].up = self.h[1].up
        self.head = nn.Linear(13, 5)

    def forward(self, x):
        x = self.embed(x)
        for block in self.h:
            x = block(x)
        return self.head(x)


def test_parameter_shared_by_two_layers_goes_to_the_root():
    """Issue #16 item 4: trains as the unsharded model does."""
    model = TwoSharedBlocks()
    reference = copy.deepcopy(model)
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    sharded = shard_model(model, list(model.h), device="cpu", config=config)
    root = sharded.runtime.root.chunks
    assert any(name == "h.1.up.weight" for c in root for name in c.names)
    optimizer = AdamFP16(sharded.get_trainable_chunk(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                      weight_decay=0.0)
    for step in range(3):
        x, y = batch(step, 4)
        losses = []
        for net, opt in ((sharded, optimizer), (reference, ref_optimizer)):
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= VALUE_ERROR


class HeadTiedToALayer(nn.Module):
    """The readout is block 1's `up`, read again after the last block: a
    parameter of one wrapped layer and of the rest of the model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Linear(7, 13)
        self.h = nn.ModuleList(Block(13, 29) for _ in range(3))
        self.head = self.h[1].up

    def forward(self, x):
        x = self.embed(x)
        for block in self.h:
            x = block(x)
        return self.head(x)


def train_head_tied_to_a_layer(ctx):
    """Every rank trains on the same rows, so the averaged gradient is the
    unsharded model's; the losses of both, step by step."""
    model = HeadTiedToALayer()
    reference = copy.deepcopy(model)
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    sharded = shard_model(model, list(model.h), device=ctx.device, config=config)
    root = [name for c in sharded.runtime.root.chunks for name in c.names]
    optimizer = AdamFP16(sharded.get_trainable_chunk(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                      weight_decay=0.0)
    losses = []
    for step in range(3):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step))
        pair = []
        for net, opt in ((sharded, optimizer), (reference, ref_optimizer)):
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    return {"root": root, "losses": losses}


@pytest.mark.distributed
def test_a_parameter_of_a_layer_and_the_rest_goes_to_the_root():
    """The readout reads block 1's `up` outside every wrapped layer, where
    that layer's chunks are released: laid out in the root, gathered for the
    whole step, it trains as the unsharded model on two ranks."""
    for report in run_distributed(train_head_tied_to_a_layer, 2):
        assert "h.1.up.weight" in report["root"] and "h.1.up.bias" in report["root"]
        for ours, theirs in report["losses"]:
            assert abs(ours - theirs) <= VALUE_ERROR


def test_zero3_layers_lends_a_shared_parameter_to_the_later_layer():
    """Laid out in the first layer that has it, which stays gathered for the
    step; the later layer borrows it, and the model trains as the unsharded
    one (the sum of both uses' gradients, reduced once)."""
    torch.manual_seed(3)
    blocks = [Block(13, 29), Block(13, 29)]
    blocks[1].up = blocks[0].up
    reference = nn.Sequential(*copy.deepcopy(blocks))
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    layers = zero3_layers(blocks, device="cpu", config=config)
    assert [layer.held for layer in layers] == [True, False]
    assert sorted(layers[1].borrowed) == ["up.bias", "up.weight"]
    assert layers[1].module.up is layers[0].module.up
    names = [name for c in layers[1].chunks for name in c.names]
    assert not any(".up." in name for name in names)
    model = Zero3Sequential(layers)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                      weight_decay=0.0)
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        losses = []
        for net, opt in ((model, optimizer), (reference, ref_optimizer)):
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= VALUE_ERROR
        # the held layer is released with the rest at the end of the step
        assert not model.runtime.gathered_chunks()


def test_zero3_layer_follows_its_config():
    """No constructor overrides the config: its chunk size is used, and a
    disagreeing argument is an error."""
    from labml_zero.zero3 import Zero3Layer

    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    layer = Zero3Layer(tiny_layers()[1], 0, 1, "cpu", torch.float32, config=config)
    searched = dataclasses.replace(config, chunk_numel=None)
    explicit = Zero3Layer(tiny_layers()[1], 0, 1, "cpu", torch.float32,
                          chunk_numel=96, config=searched)
    # labml-nn's default: one chunk per kind
    default = Zero3Layer(tiny_layers()[1], 0, 1, "cpu", torch.float32,
                         config=searched)
    sizes = [c.numel for c in layer.chunks]
    assert sizes == [c.numel for c in explicit.chunks]
    assert sizes != [c.numel for c in default.chunks]
    with pytest.raises(ValueError, match="chunk_numel=64 differs"):
        Zero3Layer(tiny_layers()[1], 0, 1, "cpu", torch.float32, chunk_numel=64,
                   config=config)
    with pytest.raises(ValueError, match="differs from config.dtype"):
        Zero3Layer(tiny_layers()[1], 0, 1, "cpu", torch.bfloat16, config=config)
    with pytest.raises(ValueError, match="prefetch_depth must be >= 0"):
        Zero3Sequential([layer], prefetch_depth=-1)


def chunk_shapes(layout, first_group: int = 0):
    """Each chunk's group (counted from `first_group`), kind, size and slots."""
    return [(c.group - first_group, c.trainable, c.chunk_numel,
             [(s.param_index, s.offset, s.numel) for s in c.slots])
            for c in layout.chunks]


@pytest.mark.parametrize("chunk_numel", [96, None])
def test_both_ways_build_one_layout_per_model(chunk_numel):
    """`Zero3Sequential(zero3_layers(...))` and `shard_model(...)` of the same
    layers: one layout each, a group per unit, the same chunks."""
    from labml_zero.zero3.chunk_layout import plan_chunks
    from labml_zero.planner.memory_model import gathered_peak, layout_model_states
    from labml_zero.zero3.unit_chunks import param_specs

    config = ZeroConfig(dtype=torch.float32, chunk_numel=chunk_numel, align=4)
    chain = Zero3Sequential(zero3_layers(tiny_layers(), device="cpu", config=config))
    layers = tiny_layers()
    generic = shard_model(nn.Sequential(*layers), layers, device="cpu", config=config)
    # the config each model keeps holds the chunk size that was used
    assert chain.config.chunk_numel == generic.config.chunk_numel
    assert chain.config.chunk_numel is not None
    # the chained layout is the one planned over all the layers at once
    specs, _ = param_specs([layer.named_parameters() for layer in tiny_layers()])
    planned = plan_chunks(specs, chain.config.chunk_numel, 1, align=4)
    assert chain.layout == planned
    assert chunk_shapes(chain.layout) == chunk_shapes(planned)
    # shard_model's group 0 is its (here empty) root: layer i is group i + 1
    assert chunk_shapes(generic.layout, first_group=1) == chunk_shapes(chain.layout)
    assert list(chain.layout.by_group) == list(range(len(layers)))
    # the chunks the model holds are the layout's, in its order
    assert [c.numel for c in chain.chunks] == [c.chunk_numel
                                               for c in chain.layout.chunks]
    # the memory model reads either the same way
    sizes = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=12)
    assert layout_model_states(chain.layout, **sizes) == layout_model_states(
        generic.layout, **sizes) == sum(
        layout_model_states(layer.layout, **sizes) for layer in chain.layers)
    assert gathered_peak(chain.layout, 1, 4) == gathered_peak(generic.layout, 1, 4)


def test_labml_nn_layers_chain_into_one_layout():
    # each layer one chunk per kind, sized to fit: the chain's chunk size is the
    # largest, and the layout still has a group per layer
    from labml_zero.zero3 import Zero3Layer

    layers = [Zero3Layer(m, 0, 1, "cpu", torch.float32) for m in tiny_layers()]
    model = Zero3Sequential(layers)
    assert model.layout.chunk_numel == max(layer.layout.chunk_numel for layer in layers)
    assert [len(model.layout.chunks_of_group(i)) for i in range(len(layers))] == [
        len(layer.chunks) for layer in layers]
    names = [model.layout.params[s.param_index].name
             for c in model.layout.chunks for s in c.slots]
    assert names == [layer.layout.params[s.param_index].name
                     for layer in layers for c in layer.layout.chunks for s in c.slots]


def test_zero3_sequential_refuses_layers_with_different_configs():
    from labml_zero.zero3 import Zero3Layer

    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    other = dataclasses.replace(config, chunk_numel=64, reshard_after_forward=False)
    layers = [Zero3Layer(tiny_layers()[0], 0, 1, "cpu", torch.float32, config=config),
              Zero3Layer(tiny_layers()[1], 0, 1, "cpu", torch.float32, config=other)]
    with pytest.raises(ValueError, match="layer 1's config differs from layer 0's "
                                         "in chunk_numel, reshard_after_forward"):
        Zero3Sequential(layers)


def test_the_search_range_of_the_engine(monkeypatch):
    """`choose_chunk_numel`'s range: ColossalAI's default width (the search's
    default too) at most, at most 4096 steps of the hidden size, and at least the
    largest layer."""
    from labml_zero.planner import chunk_search, sharding
    from labml_zero.planner.sharding import choose_chunk_numel
    from labml_zero.zero3.chunk_layout import ParamSpec

    seen, original = [], chunk_search.search_chunk_size

    def search(specs, world_size, *, config):
        seen.append(config)
        return original(specs, world_size, config=config)

    monkeypatch.setattr(sharding, "search_chunk_size", search)

    def search_range(layers: list[tuple[int, int]]) -> int:
        specs = [ParamSpec(f"w{g}", shape, True, g) for g, shape in enumerate(layers)]
        choose_chunk_numel(specs, 1, ZeroConfig())
        return seen[-1]

    default = chunk_search.ChunkSearchConfig().search_range
    # A wide model of small layers: the default width.
    wide = search_range([(4, 16384), (4, 16384)])
    assert wide.hidden_dim == 16384 and wide.search_range == default
    # A narrow one: 4096 steps of its hidden size.
    narrow = search_range([(4, 64), (4, 64)])
    assert narrow.search_range == 4096 * 64 < default
    assert narrow.num_candidates == 4096 + 1
    # A layer larger than either: the range reaches it.
    large = search_range([(4, 64), (2 * 4096, 64)])
    assert large.search_range == 2 * 4096 * 64


def test_a_huge_group_coarsens_the_steps():
    """Llama-3.2-1B's embedding (128,256 × 2,048) stretches the range to 250.5 ×
    2^20 elements: 128,257 steps of 2,048, over the search's cap; the engine
    steps by 4,096 instead and the search runs."""
    from labml_zero.planner import chunk_search
    from labml_zero.planner.sharding import choose_chunk_numel
    from labml_zero.zero3.chunk_layout import ParamSpec

    d, vocab = 2048, 128_256
    specs = [ParamSpec("embed", (vocab, d), True, 0)] + [
        ParamSpec(f"w{g}", (d, d), True, g) for g in range(1, 5)]
    chunk = choose_chunk_numel(specs, 1, ZeroConfig())
    cap = chunk_search.ChunkSearchConfig().max_candidates
    assert vocab * d // d + 1 > cap  # the range at steps of d is over the cap
    assert chunk % (2 * d) == 0 and chunk > 0


def test_the_engine_takes_the_chunk_size_or_refuses():
    """The engine's `zero3_layers` and `shard_model` choose no size themselves:
    given neither `chunk_numel` nor a chooser they refuse in one line; the
    planner's pass its search, and a chooser's size is the one used."""
    from labml_zero.planner import sharding
    from labml_zero.zero3 import sharded_model

    with pytest.raises(ValueError, match="no chunk size"):
        sharded_model.zero3_layers(tiny_layers(), device="cpu", config=ZeroConfig())
    with pytest.raises(ValueError, match="no chunk size"):
        model = torch.nn.Sequential(*tiny_layers())
        sharded_model.shard_model(model, list(model), device="cpu",
                                  config=ZeroConfig())
    searched = sharding.zero3_layers(tiny_layers(), device="cpu", config=ZeroConfig())
    specs, _ = param_specs([layer.named_parameters() for layer in tiny_layers()])
    assert searched[0].config.chunk_numel == sharding.choose_chunk_numel(
        specs, 1, ZeroConfig())
    chosen = sharded_model.zero3_layers(tiny_layers(), device="cpu",
                                        config=ZeroConfig(),
                                        choose_chunk_numel=lambda *_: 4096)
    assert {layer.config.chunk_numel for layer in chosen} == {4096}
