r"""
`states="8bit-moments"`: an fp32 master with block-wise 8-bit moments, on
device and host shards, in the early update and in checkpoints.

The reference is `torch.optim.AdamW` (its `foreach` update) on the fp32
master whose moments are encoded and decoded after every step with the same
functions. With `fused=False` the kernel is that `foreach` update; with
`fused=True` the update runs in one pass (`blockwise_moments.adamw_coded_`),
whose operations are the `foreach` update's. Both read the same operands in
the same order as the reference, so the tolerance is zero.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers import blockwise_moments as bw
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.state_layout import EIGHT_BIT_MOMENTS, LAYOUTS
from tests.optimizers import test_offload
from tests.optimizers.test_offload import (HYPER, gradients, set_grad, shards,
                                           train)

CODED = ("exp_avg", "exp_avg_sq")
STEPS = 20


def code_moments(reference: torch.optim.AdamW, bug: str | None) -> None:
    """The reference's moments after a step: encoded and decoded in place, or
    a deliberately wrong variant."""
    for state in reference.state.values():
        for key, signed in zip(CODED, (True, False)):
            if bug == "moments kept fp32":
                continue
            x = state[key]
            codes = torch.empty_like(x, dtype=torch.uint8)
            scales = torch.empty(bw.n_blocks(x.numel()))
            # the wrong map: v coded with m's (signed, square root)
            bw.encode(x, codes, scales, signed=signed or bug == "v with m's map")
            x.copy_(bw.decode(codes, scales,
                              signed=signed or bug == "v with m's map"))


# Shards of several blocks, whole and partial, and of less than one.
SIZES = (37, 600, 256, 513)


@pytest.fixture(autouse=True)
def several_blocks(monkeypatch):
    """`shards` and `gradients` of `test_offload`, at these sizes."""
    monkeypatch.setattr(test_offload, "SIZES", SIZES)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("offload", [None, {1, 2}])
@pytest.mark.parametrize("bug", [None, "moments kept fp32", "v with m's map",
                                 "lr x 1.001"])
def test_8bit_moments_are_adamw_with_moments_coded_each_step(fused, offload, bug):
    ours = shards(torch.bfloat16)
    theirs = [torch.nn.Parameter(LocalShard.of(p).master_init.clone())
              for p in ours]
    opt = AdamFP16(ours, **HYPER, fused=fused, offload=offload,
                   states="8bit-moments")
    lr = HYPER["lr"] * (1.001 if bug == "lr x 1.001" else 1)
    ref = torch.optim.AdamW(theirs, **{**HYPER, "lr": lr}, foreach=True)
    for step in range(STEPS):
        for p, q, g in zip(ours, theirs, gradients(step)):
            set_grad(p, g.clone())
            q.grad = g.clone()
        opt.step()
        ref.step()
        code_moments(ref, bug)
        opt.zero_grad()
    equal = all(torch.equal(opt.state[p]["master"], q.detach())
                for p, q in zip(ours, theirs))
    assert equal == (bug is None)
    for p, q in zip(ours, theirs):
        state = opt.state[p]
        assert [state[k].dtype for k in CODED] == [torch.uint8] * 2
        assert state["exp_avg_absmax"].shape == (bw.n_blocks(p.numel()),)
        assert torch.equal(p.detach(), state["master"].bfloat16())
        if bug is None:
            assert torch.equal(bw.decode(state["exp_avg"], state["exp_avg_absmax"],
                                         signed=True), ref.state[q]["exp_avg"])


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_round_trip_error_is_bounded_by_the_map_step(signed, n):
    r"""$|x - \hat x| \le \frac{p}{2L} a_j$ (the page's bound), per block; and
    the bound is not loose by more than a factor of a few: some element of a
    random block comes within half of it."""
    g = torch.Generator().manual_seed(n)
    # values over six orders of magnitude, as squared gradients are
    x = torch.randn(n, generator=g) * 10 ** (3 * torch.rand(n, generator=g))
    x = x if signed else x * x
    codes = torch.empty(n, dtype=torch.uint8)
    scales = torch.empty(bw.n_blocks(n))
    bw.encode(x, codes, scales, signed=signed)
    back = bw.decode(codes, scales, signed=signed)
    p, levels = (2, 127) if signed else (4, 255)
    absmax = torch.nn.functional.pad(x.abs(), (0, -n % bw.BLOCK)).view(
        -1, bw.BLOCK).amax(1).repeat_interleave(bw.BLOCK)[:n]
    assert torch.equal(scales, absmax[::bw.BLOCK])
    # the bound, plus fp32's rounding of the decode (a few ulps of a_j)
    bound = absmax * (p / (2 * levels) + 8 * torch.finfo(torch.float32).eps)
    assert bool(((x - back).abs() <= bound).all())
    assert (x.abs() == absmax).any() and torch.equal(
        back[x.abs() == absmax], x[x.abs() == absmax])
    # re-encoding a decoded block gives the same codes
    again = torch.empty_like(codes)
    bw.encode(back, again, torch.empty_like(scales), signed=signed)
    assert torch.equal(again, codes)


def test_an_all_zero_block_decodes_to_zero():
    x = torch.zeros(300)
    codes, scales = torch.empty(300, dtype=torch.uint8), torch.empty(2)
    for signed in (True, False):
        bw.encode(x, codes, scales, signed=signed)
        assert torch.equal(bw.decode(codes, scales, signed=signed), x)


def test_the_layout_counts_its_scales():
    assert EIGHT_BIT_MOMENTS.bytes_per_element() == 4 + 1 + 1 + 2 * 4 / bw.BLOCK
    assert EIGHT_BIT_MOMENTS.bytes_per_element(shard_is_master=True) == \
        2 + 2 * 4 / bw.BLOCK
    assert "8bit-moments" in LAYOUTS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_early_and_host_updates_are_the_same_update(dtype):
    after, during = shards(dtype), shards(dtype)
    after_opt = AdamFP16(after, **HYPER, states="8bit-moments")
    during_opt = AdamFP16(during, **HYPER, offload={0, 2, 3},
                          update_during_backward=True, states="8bit-moments")
    train(after_opt, after, 5)
    for step in range(5):
        for p, g in zip(during, gradients(step)):
            set_grad(p, g)
            during_opt.grad_ready(p)
        during_opt.step()
        during_opt.zero_grad()
    for a, b in zip(after, during):
        assert torch.equal(a, b)
        for key in EIGHT_BIT_MOMENTS.names:
            assert torch.equal(after_opt.state[a][key], during_opt.state[b][key])


# ## Checkpoints, with the engine on one local rank


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_is_bit_exact_with_8bit_moments(tmp_path, dtype, offload, capsys):
    from labml_zero.zero3.checkpoint import (CheckpointReader, load_checkpoint,
                                             save_checkpoint)
    from tests.optimizers.test_narrow_moments import run_steps, sharded

    model, opt = sharded(dtype, "8bit-moments", offload=offload)
    run_steps(model, opt, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    run_steps(model, opt, range(3, 6))
    fresh, fresh_opt = sharded(dtype, "8bit-moments", offload=offload)
    loaded = load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    assert loaded.converted is None and capsys.readouterr().err == ""
    run_steps(fresh, fresh_opt, range(3, 6))
    for a, b in zip(model.chunks, fresh.chunks):
        assert torch.equal(a.shard, b.shard)
    for p, q in zip(opt.param_groups[0]["params"],
                    fresh_opt.param_groups[0]["params"]):
        for key in EIGHT_BIT_MOMENTS.names:
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    # saved as kept: one byte a moment, its scales per block
    reader = CheckpointReader(tmp_path / "ckpt")
    assert reader.states["dtypes"] == EIGHT_BIT_MOMENTS.dtypes
    assert reader.states["blocks"] == {"exp_avg_absmax": bw.BLOCK,
                                       "exp_avg_sq_absmax": bw.BLOCK}
    name = model.chunks[-1].names[0]
    assert reader.read(name, "exp_avg").dtype == torch.uint8


@pytest.mark.parametrize("saved,resumed", [("fp32", "8bit-moments"),
                                           ("8bit-moments", "fp32"),
                                           ("8bit-moments", "bf16-moments")])
def test_a_resume_with_another_choice_converts_once(tmp_path, saved, resumed,
                                                    capsys):
    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint
    from tests.optimizers.test_narrow_moments import run_steps, sharded

    model, opt = sharded(torch.bfloat16, saved)
    run_steps(model, opt, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    fresh, fresh_opt = sharded(torch.bfloat16, resumed)
    loaded = load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    line = (f"checkpoint {tmp_path / 'ckpt'}: optimizer states saved as "
            f"{saved!r}, converted once to {resumed!r}")
    assert loaded.converted == line
    assert capsys.readouterr().err == line + "\n"
    layout = fresh_opt.layout
    for p, q in zip(opt.param_groups[0]["params"],
                    fresh_opt.param_groups[0]["params"]):
        assert torch.equal(fresh_opt.state[q]["master"], opt.state[p]["master"])
        old, new = opt.state[p], fresh_opt.state[q]
        for key, signed in bw.CODED:
            if saved == "8bit-moments":
                # decoded (exact), then cast to the new dtype
                wide = bw.decode(old[key], old[f"{key}_absmax"], signed=signed)
                assert torch.equal(new[key], wide.to(layout.dtype(key)))
            else:
                codes = torch.empty_like(old[key], dtype=torch.uint8)
                scales = old[key].new_empty(bw.n_blocks(old[key].numel()))
                bw.encode(old[key], codes, scales, signed=signed)
                assert torch.equal(new[key], codes)
                assert torch.equal(new[f"{key}_absmax"], scales)
    run_steps(fresh, fresh_opt, range(3, 5))
    assert fresh_opt.state[q]["exp_avg"].dtype == layout.dtype("exp_avg")


# ## Training a tiny model


def tiny_training(states: str, *, lr: float = 1e-2, steps: int = 60) -> list[float]:
    """A two-layer MLP regressing a fixed random target on fp32 parameters
    (each its own master), with AdamFP16's foreach kernel."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Tanh(),
                                torch.nn.Linear(300, 4))
    x, y = torch.randn(256, 16), torch.randn(256, 4)
    opt = AdamFP16(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                   fused=False, states=states)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def test_a_tiny_model_trains_as_with_fp32_moments():
    r"""The loss tracks fp32 moments' within a tolerance from the maps' bound.

    A step moves each weight by $\alpha \hat m / \sqrt{\hat v}$; to first
    order its relative error is that of $\hat m$ plus half that of $\hat v$,
    at most $\frac{1}{L_m} + \frac{1}{L_v}$ for the elements near their
    block's absmax, which make the largest steps. The loss falls by the sum
    of the steps times the gradients, so after $t$ steps the two curves may
    part by that fraction of the fall so far, twice over (both moments' errors
    also steer later gradients). Learning rate $\times 1.1$, a wrong update of
    about that size, falls outside it."""
    ref = tiny_training("fp32")
    coded = tiny_training("8bit-moments")
    wrong = tiny_training("fp32", lr=1.1e-2)
    fraction = 2 * (1 / bw.SIGNED_LEVELS + 1 / bw.UNSIGNED_LEVELS)
    assert ref[-1] < 0.5 * ref[0]
    parts = [abs(a - b) <= fraction * (ref[0] - a) + 1e-6
             for a, b in zip(ref, coded)]
    assert all(parts), [(a, b) for a, b in zip(ref, coded)][-5:]
    assert not all(abs(a - b) <= fraction * (ref[0] - a) + 1e-6
                   for a, b in zip(ref, wrong))


@pytest.mark.parametrize("offload", [None, {0, 1}])
def test_a_non_finite_early_gradient_leaves_8bit_moments_as_they_were(offload):
    params = shards(torch.bfloat16)[:2]
    opt = AdamFP16(params, lr=1e-2, offload=offload, update_during_backward=True,
                   states="8bit-moments")
    for step in range(2):
        for p, g in zip(params, gradients(step)):
            set_grad(p, g)
            opt.grad_ready(p)
        opt.step()
        opt.zero_grad()
    before = {k: opt.state[params[1]][k].clone()
              for k in EIGHT_BIT_MOMENTS.names}
    finite, overflowed = gradients(2)[:2]
    overflowed[3] = float("inf")
    for p, g in zip(params, (finite, overflowed)):
        set_grad(p, g)
        opt.grad_ready(p)
    with pytest.raises(RuntimeError, match="non-finite gradient"):
        opt.step()
    for key, value in before.items():
        assert torch.equal(opt.state[params[1]][key], value)


def chunked(chunk_numel: int):
    """The tiny engine model of `sharded`, at a chosen chunk size."""
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=chunk_numel, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu",
                                         config=config))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3,
                         states="8bit-moments")
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return model, optimizer


def full_moments(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's decoded moments and their blocks' scales, per element."""
    out = {}
    for chunk in model.chunks:
        state = opt.state.get(chunk.shard)
        if not state:
            continue
        for key, signed in bw.CODED:
            wide = bw.decode(state[key], state[f"{key}_absmax"], signed=signed)
            scale = state[f"{key}_absmax"].repeat_interleave(bw.BLOCK)
            for name, slot, param in zip(chunk.names, chunk.spec.slots,
                                         chunk.params):
                piece = slice(slot.offset, slot.offset + param.numel())
                out.setdefault(name, {})[key] = (wide[piece], scale[piece])
    return out


def test_a_resume_at_other_chunks_codes_the_new_blocks_once(tmp_path):
    """Saved with shards of several blocks, resumed with shards of one
    partial block: each element read with its own saved block's scale, the
    new blocks coded once, within the map's bound of the new block's absmax."""
    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint
    from tests.optimizers.test_narrow_moments import run_steps

    model, opt = chunked(2000)
    assert max(c.shard.numel() for c in model.chunks) > 2 * bw.BLOCK
    run_steps(model, opt, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    fresh, fresh_opt = chunked(200)
    load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    old, new = full_moments(model, opt), full_moments(fresh, fresh_opt)
    assert old.keys() == new.keys()
    eps = torch.finfo(torch.float32).eps
    for name in old:
        for (key, signed), levels, e in zip(bw.CODED, (bw.SIGNED_LEVELS,
                                                       bw.UNSIGNED_LEVELS), (2, 4)):
            was, _ = old[name][key]
            now, scale = new[name][key]
            bound = scale * (e / (2 * levels) + 8 * eps)
            assert bool(((was - now).abs() <= bound).all()), (name, key)
    run_steps(fresh, fresh_opt, range(3, 5))
