"""The notes' measurable claims: bytes held per rank and bytes communicated per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import shard_model
from labml_zero.zero3 import ZeroConfig
from labml_zero.zero3.chunk import ChunkState
from labml_zero.zero3.hooks import Phase
from labml_zero.planner.memory_model import (
    BACKWARD,
    FORWARD,
    gathered_peak,
    gathered_units,
    layout_model_states,
    zero3_step_comm,
    zero_model_states,
)
from tests.distributed import run_distributed
from tests.zero3.models import batch, tiny_layers


def held_bytes(model, optimizer) -> int:
    """Count the real tensors the engine and the optimizer keep for the model."""
    seen: set[int] = set()
    total = 0

    def count(tensor):
        nonlocal total
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr not in seen:
            seen.add(ptr)
            total += tensor.untyped_storage().nbytes()

    for chunk in model.chunks:
        count(chunk.shard)
        # released chunks hold nothing beyond the shard: their full buffer has
        # no storage, or (one rank) is the shard itself
        assert chunk.state is ChunkState.SHARDED
        if chunk.full_is_shard:
            assert chunk.full.data_ptr() == chunk.shard.data_ptr()
        else:
            assert chunk.full.untyped_storage().nbytes() == 0
        assert chunk.grads is None or chunk.grads.full is None
        if chunk.trainable:
            count(chunk.local.grad)
        else:
            assert chunk.shard not in optimizer.state
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                count(value)
    return total


def one_step(ctx, dtype_name: str, reduce_name: str, states: str = "fp32"):
    dtype, reduce_dtype = getattr(torch, dtype_name), getattr(torch, reduce_name)
    layers = tiny_layers()
    config = ZeroConfig(dtype=dtype, reduce_dtype=reduce_dtype, chunk_numel=96, align=4)
    model = shard_model(
        nn.Sequential(*layers), layers[1:4], device=ctx.device, config=config
    )
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-3, states=states)
    comm = model.runtime.comm
    x, y = batch(0, 2 * ctx.world_size)
    mine = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    comm.counter.reset()
    loss = nn.functional.mse_loss(
        model(x[mine].to(ctx.device, dtype)), y[mine].to(ctx.device, dtype)
    )
    loss.backward()
    optimizer.step()
    counted = dict(comm.counter.elements), dict(comm.counter.bytes)
    layout = model.layout
    params = list(nn.Sequential(*layers).parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    return {
        "held": held_bytes(model, optimizer),
        "layout": layout,
        "psi": (trainable, frozen),
        "counted": counted,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_one_rank_casts_gradients_straight_into_its_shard(reduce_dtype):
    # N_d = 1: the mean over one rank is the gradient itself, so an fp32
    # reduction is no reduction at all (nothing counted, no buffer); a bf16
    # one still rounds through its buffer, as on N ranks. The full buffer is
    # the shard, so nothing is gathered either.
    (r,) = run_distributed(one_step, 1, "bfloat16", reduce_dtype)
    elements, _ = r["counted"]
    assert elements.get("all_gather", 0) == 0
    reduced = r["layout"].total_numel(trainable=True)
    assert elements.get("reduce_scatter", 0) == (
        0 if reduce_dtype == "float32" else reduced)
    assert r["held"] == layout_model_states(
        r["layout"], param_bytes=2, grad_bytes=4, optimizer_bytes=12)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size,dtype,reduce_dtype",
    [
        (2, "bfloat16", "bfloat16"),
        (2, "bfloat16", "float32"),
        (3, "float32", "float32"),
    ],
)
def test_memory_per_rank_and_bytes_per_step(world_size, dtype, reduce_dtype):
    p = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    g = torch.tensor([], dtype=getattr(torch, reduce_dtype)).element_size()
    for r in run_distributed(one_step, world_size, dtype, reduce_dtype):
        layout = r["layout"]
        # Memory: the engine's tensors are exactly the layout's (p + 4 + K)/N_d
        # per trainable element and p/N_d per frozen one, padding included. The
        # shard gradient is fp32 (4 bytes) whatever the reduce dtype: it is what
        # the optimizer reads, and accumulates across micro-batches.
        expected = layout_model_states(
            layout, param_bytes=p, grad_bytes=4,
            optimizer_bytes=12, master_aliases_param=p == 4,
        )
        assert r["held"] == expected
        # ... which is ZeRO's ((2 + g + K)Ψ_t + 2Ψ_f)/N_d, with g = 4, plus the
        # padding (each chunk's shard rounds up, hence the +1s).
        psi_t, psi_f = r["psi"]
        padding_t = layout.padding(trainable=True) // world_size
        padding_f = layout.padding(trainable=False) // world_size
        if p == 2:
            formula = zero_model_states(psi_t, psi_f, world_size, param_bytes=2,
                                        grad_bytes=4, optimizer_bytes=12)
            slack = (2 + 4 + 12) * (padding_t + 1) + 2 * (padding_f + 1)
            assert r["held"] - formula <= slack
            assert r["held"] >= formula

        # Communication: every chunk gathered for the forward, the layers'
        # chunks again for the backward (the root stays gathered), and each
        # trainable chunk reduce-scattered once: the "3Ψ" of the notes.
        comm = zero3_step_comm(layout, param_bytes=p, grad_bytes=g,
                               backward_groups=[1, 2, 3])
        elements, nbytes = r["counted"]
        assert elements["all_gather"] == (
            comm.forward_all_gather.numel + comm.backward_all_gather.numel
        )
        assert elements["reduce_scatter"] == comm.reduce_scatter.numel
        assert nbytes["reduce_scatter"] == comm.reduce_scatter.nbytes
        total = layout.total_numel()
        root = sum(c.chunk_numel for c in layout.chunks_of_group(0))
        assert elements["all_gather"] == 2 * total - root
        assert elements["reduce_scatter"] == layout.total_numel(trainable=True)


@pytest.mark.distributed
@pytest.mark.parametrize("states", ["bf16-moments", "bf16-stochastic",
                                    "bf16-kahan", "8bit-moments"])
@pytest.mark.parametrize("world_size,dtype", [(2, "bfloat16"), (1, "float32")])
def test_bf16_moments_hold_the_layouts_bytes(world_size, dtype, states):
    """With bf16 moments the engine and the optimizer hold exactly the
    layout's $K$ per trainable element, $4 + 2 + 2$ ($2 + 2$ where the fp32
    shard is its own master) or, without a master, $2 + 2$ ($2 + 2 + 2$ with
    a compensation), as the memory model and placement count it."""
    from labml_zero.planner.placement import (ShardSpec, StaticPlacement,
                                              device_optimizer_bytes,
                                              resident_bytes)
    from labml_zero.zero3.state_layout import LAYOUTS

    chosen = LAYOUTS[states]
    p = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    for r in run_distributed(one_step, world_size, dtype, "float32", states):
        layout = r["layout"]
        aliased = chosen.shard_is_master(p)
        expected = layout_model_states(
            layout, param_bytes=p, grad_bytes=4,
            optimizer_bytes=chosen.bytes_per_element(shard_is_master=aliased))
        # per-block scales: the model counts $4/B$ bytes per element, a
        # shard holds whole blocks, its last one partial
        partial = sum(
            t.nbytes * (t.numel(layout.shard_numel(c)) * t.block
                        - layout.shard_numel(c))
            for c in layout.chunks if c.trainable
            for t in chosen.tensors if t.block is not None)
        assert r["held"] == expected + partial
        # placement's device split counts the model's bytes, from the same layout
        shards = [ShardSpec(layout.shard_numel(c), c.trainable)
                  for c in layout.chunks]
        split = resident_bytes(StaticPlacement().place(shards), shards,
                               param_bytes=p, states=chosen)
        assert split == (expected, 0)
        assert device_optimizer_bytes(p, chosen) == {
            ("bf16-moments", 2): 4 + 2 + 2, ("bf16-moments", 4): 2 + 2,
            ("bf16-stochastic", 2): 2 + 2, ("bf16-stochastic", 4): 2 + 2,
            ("bf16-kahan", 2): 2 + 2 + 2, ("bf16-kahan", 4): 2 + 2 + 2,
            ("8bit-moments", 2): 4 + 1 + 1 + 8 / 256,
            ("8bit-moments", 4): 1 + 1 + 8 / 256,
        }[states, p]


def test_figures_in_the_chunk_notes():
    """The chunk page's figures: Pythia-160M's 148 parameter tensors (one
    gradient copy each before the chunk held them), and the (p + g) bytes per
    parameter that the gradient copy moves for Pythia-6.9B, 41 GB a step."""
    from labml_zero.neox.model import build_layers, pythia_160m, pythia_6_9b

    tensors = [p for layer in build_layers(pythia_160m(), device="meta")
               for p in layer.parameters()]
    assert len(tensors) == 148
    params = sum(p.numel() for layer in build_layers(pythia_6_9b(), device="meta")
                 for p in layer.parameters())
    assert round((2 + 4) * params / 1e9) == 41


def units_gathered_at_once(ctx, depth: int):
    """The most units (and full-buffer bytes) the engine holds gathered at once in
    forward and in backward, over two steps of six equal layers (all of them
    units, so the root holds nothing)."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(6)]
    config = ZeroConfig(dtype=torch.float32, prefetch_depth=depth)
    model = shard_model(nn.Sequential(*layers), layers, device=ctx.device,
                        config=config)
    runtime = model.runtime
    units = [unit for unit in runtime.all_units() if unit.module is not None]
    peak = {Phase.FORWARD: [0, 0], Phase.BACKWARD: [0, 0]}

    def count():
        live = [u for u in units
                if any(c.state is not ChunkState.SHARDED for c in u.chunks)]
        nbytes = sum(c.full.untyped_storage().nbytes() for u in live for c in u.chunks)
        if runtime.phase in peak:
            held = peak[runtime.phase]
            held[0], held[1] = max(held[0], len(live)), max(held[1], nbytes)

    for unit in units:
        for chunk in unit.chunks:
            def gather(original=chunk.gather):
                original()
                count()
            chunk.gather = gather
    x = torch.randn(4, 8, device=ctx.device, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
    return {phase.value: held for phase, held in peak.items()}, model.layout


@pytest.mark.distributed
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_units_gathered_at_once_match_the_memory_model(depth):
    (held, layout), = run_distributed(units_gathered_at_once, 1, depth)
    for phase in (FORWARD, BACKWARD):
        units, nbytes = held[phase]
        assert units == gathered_units(depth, phase)
        assert nbytes == gathered_peak(layout, depth, 4, phase=phase)
