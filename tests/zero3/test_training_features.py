"""Accumulation, activation checkpointing, clipping, loss scaling and lazy init.

All run sharded.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.optimizers.clip_grad import clip_grad_norm_
from labml_zero.optimizers.grad_scaler import LossScaler
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.shard import LocalShard
from tests import tolerance
from tests.distributed import run_distributed
from tests.zero3.models import TINY_TERMS, batch, tiny_layers

# fp32 through `tiny_layers`, one pass, values (gradients, outputs) of at most
# about 1.5 (tests/tolerance.py)
VALUE_ERROR = tolerance.max_error(tolerance.parity(
    torch.float32, terms=TINY_TERMS, scale=1.5), 1.5)

ROWS = 4  # rows per rank per micro-batch


def sharded(ctx, *, dtype=torch.float32, layers=None, **config):
    layers = layers if layers is not None else tiny_layers()
    cfg = ZeroConfig(dtype=dtype, chunk_numel=96, align=4, **config)
    return Zero3Sequential(zero3_layers(layers, device=ctx.device, config=cfg))


def grads(model) -> list[torch.Tensor]:
    return [LocalShard.of(s).grad.clone() for s in model.get_trainable_chunk()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest elementwise difference between two lists of gradients."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def my_rows(ctx, step: int, n_micro: int = 1):
    """This rank's rows of a global batch of n_micro micro-batches."""
    x, y = batch(step, ROWS * ctx.world_size * n_micro)
    x, y = x.to(ctx.device), y.to(ctx.device)
    per = ROWS * n_micro
    mine = slice(ctx.rank * per, (ctx.rank + 1) * per)
    return x[mine], y[mine]


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def accumulation_and_checkpointing(ctx):
    out = {}
    # One batch of 3·ROWS rows per rank.
    big = sharded(ctx)
    x, y = my_rows(ctx, 0, n_micro=3)
    loss_of(big, x, y).backward()
    out["big"] = grads(big)

    # The same rows as 3 micro-batches, reduced once.
    acc = sharded(ctx)
    comm = acc.runtime.comm
    comm.counter.reset()
    for k in range(3):
        part = slice(k * ROWS, (k + 1) * ROWS)
        if k < 2:
            with acc.no_sync():
                (loss_of(acc, x[part], y[part]) / 3).backward()
        else:
            (loss_of(acc, x[part], y[part]) / 3).backward()
    out["accumulated"] = grads(acc)
    out["reduce_calls"] = comm.counter.calls["reduce_scatter"]
    out["trainable_chunks"] = len(acc.get_trainable_chunk())

    # Activation checkpointing: same gradients, same number of all-gathers.
    plain, recomputed = sharded(ctx), sharded(ctx, activation_checkpointing=True)
    counts = []
    for model in (plain, recomputed):
        model.runtime.comm.counter.reset()
        loss_of(model, x, y).backward()
        counts.append(model.runtime.comm.counter.calls.get("all_gather", 0))
    out["gathers"] = counts
    out["ac_diff"] = max_diff(grads(plain), grads(recomputed))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_accumulation_and_activation_checkpointing(world_size):
    # one rank too: its first reduction may skip the buffer, not a later one
    for r in run_distributed(accumulation_and_checkpointing, world_size):
        # k micro-batches with accumulation equal one batch k times larger
        diff = max_diff(r["big"], r["accumulated"])
        assert diff <= VALUE_ERROR, diff
        # ... with a single reduce-scatter per trainable chunk per step
        assert r["reduce_calls"] == r["trainable_chunks"]
        # the recompute finds its chunks gathered: no extra all-gather (one
        # rank gathers nothing: its full buffers are its shards)
        assert r["gathers"][0] == r["gathers"][1]
        assert (r["gathers"][0] == 0) == (world_size == 1)
        assert r["ac_diff"] <= VALUE_ERROR


class LossHead(nn.Linear):
    """The readout of `tiny_layers` that, given the targets, returns the loss."""

    def forward(self, x, y=None):
        out = super().forward(x)
        return out if y is None else nn.functional.mse_loss(out, y)


def head_layers() -> list[nn.Module]:
    layers = tiny_layers()
    head = LossHead(13, 5)
    head.load_state_dict(layers[-1].state_dict())
    return layers[:-1] + [head]


def forward_calls(model) -> list[int]:
    """Counts, per layer, the forward calls that follow (recomputations too).

    A pre-hook: a recomputation stops once it has what backward needs, before
    the forward hooks would run."""
    calls = [0] * len(model.layers)
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def recomputing_a_loss_head(ctx):
    x, y = my_rows(ctx, 0)
    plain = sharded(ctx, layers=head_layers())
    loss_of(plain, x, y).backward()
    out = {}
    for given in ("targets", "no_targets"):
        model = sharded(ctx, layers=head_layers(), activation_checkpointing=True)
        calls = forward_calls(model)
        loss = model(x, y) if given == "targets" else loss_of(model, x, y)
        loss.backward()
        out[given] = {"calls": list(calls),
                      "diff": max_diff(grads(plain), grads(model))}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_loss_head_is_not_recomputed(world_size):
    """Under activation checkpointing every layer runs its forward twice but
    a last layer given the targets, whose output is the loss; the gradients
    are the plain ones. Without the targets the last layer is recomputed too."""
    for r in run_distributed(recomputing_a_loss_head, world_size):
        assert r["targets"]["calls"] == [2, 2, 2, 2, 1]
        assert r["no_targets"]["calls"] == [2, 2, 2, 2, 2]
        assert r["targets"]["diff"] <= VALUE_ERROR
        assert r["no_targets"]["diff"] <= VALUE_ERROR


def clipping_and_overflow(ctx):
    out = {}
    layers = tiny_layers()
    reference = nn.Sequential(*copy.deepcopy(layers)).to(ctx.device)
    model = sharded(ctx, layers=layers)
    x, y = my_rows(ctx, 1)
    loss_of(model, x, y).backward()
    gx, gy = (t.to(ctx.device) for t in batch(1, ROWS * ctx.world_size))
    loss_of(reference, gx, gy).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = clip_grad_norm_(model.get_trainable_chunk(), 0.05, model.runtime.comm)
    out["norms"] = (norm.item(), expected_norm.item())
    # The clipped shard gradients are the reference's clipped gradients, sliced.
    ref_params = dict(
        zip(map(id, nn.Sequential(*layers).parameters()), reference.parameters())
    )
    worst = 0.0
    for chunk in model.chunks:
        if not chunk.trainable:
            continue
        full = torch.zeros(chunk.numel, device=ctx.device)
        for slot, param in zip(chunk.spec.slots, chunk.params):
            full[slot.offset : slot.end] = ref_params[id(param)].grad.reshape(-1)
        mine = full[chunk.shard_offset : chunk.shard_offset + chunk.shard_numel]
        worst = max(worst, (chunk.local.grad - mine).abs().max().item())
    out["clip_diff"] = worst

    # An inf injected on the last rank only: every rank skips the step.
    model.zero_grad()
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-2)
    scaler = LossScaler(model.runtime.comm, init_scale=1024.0)
    scaler.scale(loss_of(model, x, y)).backward()
    if ctx.rank == ctx.world_size - 1:
        LocalShard.of(model.get_trainable_chunk()[0]).grad[0] = float("inf")
    before = [s.detach().clone() for s in model.get_trainable_chunk()]
    scaler.unscale_(model.get_trainable_chunk())
    out["stepped"] = scaler.step(optimizer)
    out["unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, model.get_trainable_chunk())
    )
    out["scale"] = scaler.scale_value
    # The next step, without the inf, goes through and changes the shards.
    model.zero_grad()
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.unscale_(model.get_trainable_chunk())
    out["stepped_after"] = scaler.step(optimizer)
    out["changed_after"] = not all(
        torch.equal(a, b) for a, b in zip(before, model.get_trainable_chunk())
    )
    return out


@pytest.mark.distributed
def test_clipping_and_overflow_agreement():
    for r in run_distributed(clipping_and_overflow, 2):
        ours, torchs = r["norms"]
        # the norm: one more sum, of every gradient's square
        assert abs(ours - torchs) <= VALUE_ERROR * max(1.0, torchs)
        assert r["clip_diff"] <= VALUE_ERROR
        assert r["stepped"] is False and r["unchanged"]
        assert r["scale"] == 512.0
        assert r["stepped_after"] and r["changed_after"]


def mixed_precision_run(ctx, dtype_name: str):
    """10 steps of the tiny model in fp32, bf16 or fp16; returns the losses."""
    dtype = getattr(torch, dtype_name)
    model = sharded(ctx, dtype=dtype)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3)
    # A start scale that does not overflow on step 1, so that every run takes the
    # same 10 steps (skipping is tested on its own above).
    scaler = LossScaler(
        model.runtime.comm, dynamic=dtype == torch.float16, init_scale=2.0**8
    )
    losses = []
    for step in range(10):
        x, y = my_rows(ctx, step)
        loss = loss_of(model, x.to(dtype), y.to(dtype)).float()
        scaler.scale(loss).backward()
        scaler.unscale_(model.get_trainable_chunk())
        scaler.step(optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "skipped": scaler.skipped_steps}


@pytest.mark.distributed
def test_bf16_and_fp16_track_fp32():
    reference = run_distributed(mixed_precision_run, 2, "float32")[0]["losses"]
    for dtype, tolerance in (("bfloat16", 0.05), ("float16", 0.01)):
        run = run_distributed(mixed_precision_run, 2, dtype)[0]
        assert run["skipped"] == 0
        for ours, ref in zip(run["losses"], reference):
            # relative to the loss: bf16 keeps 8 bits of mantissa, fp16 11
            assert abs(ours - ref) <= tolerance * ref, (dtype, ours, ref)
        assert run["losses"][-1] < run["losses"][0]


def lazy_init(ctx):
    eager = tiny_layers(seed=5, freeze=False)
    reference = nn.Sequential(*copy.deepcopy(eager)).to(ctx.device)
    config = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)
    x, _ = my_rows(ctx, 0)
    expected = reference(x)
    out = {}

    # Built on meta, materialised and initialised one layer at a time.
    with torch.device("meta"):
        lazy = tiny_layers(freeze=False)
    states = [layer.state_dict() for layer in eager]
    loads = iter(states)
    layers = zero3_layers(
        lazy,
        device=ctx.device,
        config=config,
        init=lambda m: m.load_state_dict(next(loads)),
    )
    out["lazy_diff"] = (Zero3Sequential(layers)(x) - expected).abs().max().item()

    # Sharded first (random weights), then pretrained weights loaded shard by shard.
    fresh = zero3_layers(
        tiny_layers(seed=9, freeze=False), device=ctx.device, config=config
    )
    for layer, state in zip(fresh, states):
        layer.load_sharded(state)
    out["loaded_diff"] = (Zero3Sequential(fresh)(x) - expected).abs().max().item()

    # A meta layer without reset_parameters and no init: a clear error.
    with torch.device("meta"):
        bare = [nn.Sequential(nn.Linear(3, 3))]
    try:
        zero3_layers(bare, device=ctx.device, config=config)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.distributed
def test_meta_layers_are_materialised_one_at_a_time():
    for r in run_distributed(lazy_init, 2):
        assert r["lazy_diff"] <= VALUE_ERROR
        assert r["loaded_diff"] <= VALUE_ERROR
        assert "reset_parameters" in r["error"]


def named_init(name: str, param: torch.Tensor) -> None:
    """A deterministic initialiser that depends only on the parameter's name."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    param.copy_(torch.randn(param.shape, generator=g))


def chunk_by_chunk_init(ctx):
    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=96, align=4)
    eager = tiny_layers(freeze=False)
    with torch.no_grad():
        for layer in eager:
            for name, param in layer.named_parameters():
                named_init(name, param)
    reference = nn.Sequential(*copy.deepcopy(eager)).to(ctx.device)

    with torch.device("meta"):
        lazy = tiny_layers(freeze=False)
    # Watch every chunk's full buffer while initialising: at most one may hold
    # memory at any moment.
    live = []

    def watching(name, param):
        live.append(sum(
            c.full.untyped_storage().nbytes() > 0
            for layer in layers
            for c in layer.chunks
        ))
        named_init(name, param)

    layers = []
    from labml_zero.zero3 import Zero3Layer
    for i, module in enumerate(lazy):
        layer = Zero3Layer(module, ctx.rank, ctx.world_size, ctx.device, torch.bfloat16,
                           chunk_numel=96, config=config)
        layers.append(layer)
        layer.materialize(watching)
    model = Zero3Sequential(layers)
    x, _ = my_rows(ctx, 0)
    with torch.no_grad():
        ours = model(x.bfloat16()).float()
        expected = reference.bfloat16()(x.bfloat16()).float()
    # The same path through zero3_layers' init_param, from fp32 meta layers.
    with torch.device("meta"):
        lazy2 = tiny_layers(freeze=False)
    model2 = Zero3Sequential(zero3_layers(lazy2, device=ctx.device, config=config,
                                          init_param=named_init))
    with torch.no_grad():
        ours2 = model2(x.bfloat16()).float()
    # fp32 masters start from the initialiser's values in full precision... of the
    # bf16 chunk they were written into (there are no fp32 originals to keep).
    masters = [LocalShard.of(s).master_init for s in model2.get_trainable_chunk()]
    masters_ok = all(m is not None and torch.isfinite(m).all().item() for m in masters)
    # Two training steps: the swapped-in parameters must survive the re-gathers of
    # the backward pass (autograd checks the saved weights' version counters).
    optimizer = AdamFP16(model2.get_trainable_chunk(), lr=1e-3)
    losses = []
    for step in range(2):
        xs, ys = my_rows(ctx, step)
        loss = loss_of(model2, xs.bfloat16(), ys.bfloat16()).float()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "max_live": max(live),
        "diff": (ours - expected).abs().max().item(),
        "diff2": (ours2 - expected).abs().max().item(),
        "masters": masters_ok,
        "losses": losses,
        "params_on_device": all(
            p.device.type == ctx.device.type for m in lazy2 for p in m.parameters()
        ),
    }


@pytest.mark.distributed
def test_meta_layers_initialised_one_chunk_at_a_time():
    for r in run_distributed(chunk_by_chunk_init, 2):
        assert r["max_live"] == 1
        assert r["diff"] == 0.0 and r["diff2"] == 0.0
        assert r["masters"] and r["params_on_device"]
        assert all(math.isfinite(v) for v in r["losses"])


def resident_chunks(ctx):
    out = {}
    x, y = my_rows(ctx, 3)
    for keep in (False, True):
        model = sharded(ctx, reshard_after_forward=not keep)
        counter = model.runtime.comm.counter
        counter.reset()
        loss_of(model, x, y).backward()
        out[keep] = (counter.calls["all_gather"], len(model.chunks), grads(model))
        # after the step every chunk is back to its shard either way
        out[f"released_{keep}"] = not model.runtime.gathered_chunks()
    return out


@pytest.mark.distributed
def test_resident_chunks_skip_the_backward_gather():
    for r in run_distributed(resident_chunks, 2):
        gathers, chunks, reshard_grads = r[False]
        kept_gathers, _, kept_grads = r[True]
        # ZeRO-3: every chunk gathered for the forward and again for the
        # backward (every layer here runs a backward: the first one's weight
        # is trainable)
        assert gathers == 2 * chunks
        # kept resident from forward to backward: one gather per chunk per step
        assert kept_gathers == chunks
        assert all(torch.equal(a, b) for a, b in zip(reshard_grads, kept_grads))
        assert r["released_False"] and r["released_True"]


def offloaded_optimizer(ctx):
    """Half the optimizer states in host memory, gradients copied down as soon as
    each chunk is reduced (the runtime's `grad_ready` hook); and every shard
    updated as its chunk is reduced (`update_during_backward`): same shards as
    on the device after the backward pass."""
    out = []
    for offload, during in ((False, False), (True, False), (False, True)):
        model = sharded(ctx, dtype=torch.bfloat16)
        shards = model.get_trainable_chunk()
        host = set(range(0, len(shards), 2)) if offload else None
        optimizer = AdamFP16(shards, lr=1e-2, offload=host,
                             update_during_backward=during)
        model.runtime.on_grad_ready(optimizer.grad_ready)
        for step in range(3):
            x, y = my_rows(ctx, step)
            loss_of(model, x.bfloat16(), y.bfloat16()).float().backward()
            optimizer.step()
            optimizer.zero_grad()
        out.append([s.detach().float().cpu() for s in shards])
    device, host, during = out
    return {
        "host_equal": all(torch.equal(a, b) for a, b in zip(device, host)),
        # bf16 shards: at most one unit in the last place apart
        "host_close": all(torch.allclose(a, b, rtol=2 ** -7, atol=0)
                          for a, b in zip(device, host)),
        "during_equal": all(torch.equal(a, b) for a, b in zip(device, during)),
        "on_gpu": ctx.device.type == "cuda",
    }


@pytest.mark.distributed
def test_offloaded_optimizer_states_train_identically():
    for r in run_distributed(offloaded_optimizer, 2):
        # the same kernel on the same operands, queued earlier on a side stream
        assert r["during_equal"]
        # the host's kernel: the device's bits on CPU; on a GPU, its rounding
        # may differ (see AdamFP16's Limitations)
        assert r["host_equal"] or (r["on_gpu"] and r["host_close"])
