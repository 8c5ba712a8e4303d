"""
`states="bf16-moments"`: an fp32 master with bf16 moments, on device and host
shards, in the early update, the captured step's CPU twin and checkpoints.

The reference is `torch.optim.AdamW` on the fp32 master whose moments are
rounded to bf16 after every step. The same kernel (fused, or `foreach`) reads
the same operands in the same order in both, so the tolerance is zero: IEEE
arithmetic gives the same bits. Any looser bound would be useless here: a
moment that is not rounded, or rounded toward zero, moves an update by about
$2^{-9}$ of itself, the size of one bf16 rounding, which is what a bound for
two different kernels would have to allow once their fp32 moments round to
neighbouring bf16 values.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers import rounded_update
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.state_layout import BF16_MOMENTS, FP32_STATES
from tests import tolerance
from tests.optimizers.test_offload import (DEVICE, HYPER, gradients, run_steps,
                                           set_grad, shards, train)

MOMENTS = ("exp_avg", "exp_avg_sq")
STEPS = 20


def round_moments(reference: torch.optim.AdamW, how: str | None) -> None:
    """The reference's moments after a step: rounded to nearest bf16 (`None`),
    or one of the deliberately wrong variants."""
    for state in reference.state.values():
        for key in MOMENTS:
            m = state[key]
            if how in (None, "lr x 1.001"):
                m.copy_(m.bfloat16())
            elif how == "moments truncated":
                # toward zero: the low 16 bits of the fp32 value dropped
                m.copy_((m.view(torch.int32) & ~0xFFFF).view(torch.float32))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("offload", [None, {1, 2}])
@pytest.mark.parametrize("bug", [None, "moments kept fp32", "moments truncated",
                                 "lr x 1.001"])
def test_bf16_moments_are_adamw_with_moments_rounded_each_step(fused, offload, bug):
    ours = shards(torch.bfloat16)
    masters = [LocalShard.of(p).master_init.clone() for p in ours]
    theirs = [torch.nn.Parameter(m) for m in masters]
    opt = AdamFP16(ours, **HYPER, fused=fused, offload=offload,
                   states="bf16-moments")
    lr = HYPER["lr"] * (1.001 if bug == "lr x 1.001" else 1)
    ref = torch.optim.AdamW(theirs, **{**HYPER, "lr": lr}, fused=fused or None,
                            foreach=not fused)
    for step in range(STEPS):
        for p, q, g in zip(ours, theirs, gradients(step)):
            set_grad(p, g.clone())
            q.grad = g.clone()
        opt.step()
        ref.step()
        round_moments(ref, bug)
        opt.zero_grad()
    equal = all(torch.equal(opt.state[p]["master"], q.detach())
                for p, q in zip(ours, theirs))
    assert equal == (bug is None)
    for p in ours:
        assert [opt.state[p][k].dtype for k in MOMENTS] == [torch.bfloat16] * 2
        assert opt.state[p]["master"].dtype == torch.float32
        # the shard is its master rounded
        assert torch.equal(p.detach(), opt.state[p]["master"].bfloat16())
    if bug is None:
        for p, q in zip(ours, theirs):
            for key in MOMENTS:
                assert torch.equal(opt.state[p][key].float(), ref.state[q][key])


def test_fp32_shards_are_their_own_masters_with_bf16_moments():
    ours = shards(torch.float32)
    opt = AdamFP16(ours, **HYPER, states="bf16-moments")
    train(opt, ours, 2)
    for p in ours:
        assert opt.state[p]["master"].data_ptr() == p.data_ptr()
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_early_and_host_updates_are_the_same_update(dtype):
    """Device shards after `step()`, host shards updated during the backward
    pass: the same bits, bf16 moments included."""
    after, during = shards(dtype), shards(dtype)
    after_opt = AdamFP16(after, **HYPER, states="bf16-moments")
    during_opt = AdamFP16(during, **HYPER, offload={0, 2, 3},
                          update_during_backward=True, states="bf16-moments")
    train(after_opt, after, 5)
    for step in range(5):
        for p, g in zip(during, gradients(step)):
            set_grad(p, g)
            during_opt.grad_ready(p)
        during_opt.step()
        during_opt.zero_grad()
    for a, b in zip(after, during):
        assert torch.equal(a, b)
        for key in ("master", *MOMENTS):
            assert torch.equal(after_opt.state[a][key], during_opt.state[b][key])


@pytest.mark.parametrize("offload", [None, {0, 1}])
def test_a_non_finite_early_gradient_leaves_bf16_moments_as_they_were(offload):
    params = shards(torch.bfloat16)[:2]
    opt = AdamFP16(params, lr=1e-2, offload=offload, update_during_backward=True,
                   states="bf16-moments")
    for step in range(2):
        for p, g in zip(params, gradients(step)):
            set_grad(p, g)
            opt.grad_ready(p)
        opt.step()
        opt.zero_grad()
    before = {k: opt.state[params[1]][k].clone() for k in ("master", *MOMENTS)}
    finite, overflowed = gradients(2)[:2]
    overflowed[3] = float("inf")
    for p, g in zip(params, (finite, overflowed)):
        set_grad(p, g)
        opt.grad_ready(p)
    with pytest.raises(RuntimeError, match="non-finite gradient"):
        opt.step()
    for key, value in before.items():
        assert torch.equal(opt.state[params[1]][key], value)


def test_the_one_pass_kernel_with_bf16_moments_is_the_twin_within_rounding():
    """`adamw_rounded_` (eager here: the GPU compiles the same code) against
    the twin, one step from the same state. The master: one update's fp32
    roundings in another order. A moment: its fp32 values differ by as much,
    and a value that close to a rounding boundary of bf16 may round to the
    neighbour, one bf16 step: `eps` of bf16 relative."""
    torch.manual_seed(3)
    n = 4096
    shard_a = torch.randn(n).bfloat16()
    shard_b = LocalShard(shard_a.clone(), trainable=True).param
    master = torch.randn(n)
    exp_avg = (torch.randn(n) * 0.1).bfloat16()
    exp_avg_sq = (torch.rand(n) * 0.01).bfloat16()
    grad = torch.randn(n)
    group = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    twin = AdamFP16([shard_b], **group, fused=True, states="bf16-moments")
    twin.load_shard_state(shard_b, {"step": 4, "master": master.clone(),
                                    "exp_avg": exp_avg.clone(),
                                    "exp_avg_sq": exp_avg_sq.clone()})
    set_grad(shard_b, grad.clone())
    twin.step()
    state = (master.clone(), exp_avg.clone(), exp_avg_sq.clone())
    coefficients = rounded_update.step_coefficients(
        torch.tensor(5.0), torch.tensor(group["lr"]), beta1=0.9, beta2=0.99,
        weight_decay=group["weight_decay"])
    rounded_update.adamw_rounded_(shard_a, state, grad, coefficients, None,
                                  rounded_update.Betas(0.9, 0.99, group["eps"]))
    ours = twin.state[shard_b]
    # terms as large as the weights: where the step cancels the weight, the
    # difference is relative to them, not to the small result
    torch.testing.assert_close(state[0], ours["master"], **tolerance.parity(
        torch.float32, terms=tolerance.ADAMW_ROUNDINGS,
        scale=master.abs().max().item()))
    rho = tolerance.sum_error(torch.float32, tolerance.ADAMW_ROUNDINGS)
    one_bf16_step = torch.finfo(torch.bfloat16).eps
    for mine, theirs, old, g in zip(state[1:], (ours["exp_avg"], ours["exp_avg_sq"]),
                                    (exp_avg, exp_avg_sq), (grad, grad * grad)):
        assert mine.dtype == torch.bfloat16
        # the fp32 sums' difference, at the size of their terms, then one
        # bf16 step where the two round to neighbours
        terms = (old.float().abs().max() + g.abs().max()).item()
        torch.testing.assert_close(mine.float(), theirs.float(),
                                   rtol=one_bf16_step, atol=rho * terms)


def test_bad_states_choice_is_refused():
    with pytest.raises(ValueError, match="states must be one of fp32, "
                                         "bf16-moments, bf16-stochastic, "
                                         "bf16-kahan, 8bit-moments; got 'fp8'"):
        AdamFP16([torch.nn.Parameter(torch.ones(2))], states="fp8")


# ## Checkpoints, with the engine on one local rank


def sharded(dtype, states, *, offload=False):
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    config = ZeroConfig(dtype=dtype, chunk_numel=200, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=DEVICE,
                                         config=config))
    chunks = model.get_trainable_chunk()
    chosen = range(len(chunks) // 2, len(chunks)) if offload else None
    optimizer = AdamFP16(chunks, lr=3e-3, weight_decay=0.01, offload=chosen,
                         states=states)
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return model, optimizer


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_is_bit_exact_with_bf16_moments(tmp_path, dtype, offload, capsys):
    from labml_zero.zero3.checkpoint import (CheckpointReader, load_checkpoint,
                                             save_checkpoint)

    model, opt = sharded(dtype, "bf16-moments", offload=offload)
    run_steps(model, opt, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    run_steps(model, opt, range(3, 6))
    fresh, fresh_opt = sharded(dtype, "bf16-moments", offload=offload)
    loaded = load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    assert loaded.converted is None and capsys.readouterr().err == ""
    run_steps(fresh, fresh_opt, range(3, 6))
    for a, b in zip(model.chunks, fresh.chunks):
        assert torch.equal(a.shard, b.shard)
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]):
        for key in ("master", *MOMENTS):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    # saved as kept: bf16 moments, 2 bytes each, the layout in the manifest
    reader = CheckpointReader(tmp_path / "ckpt")
    assert reader.states == {"name": "bf16-moments",
                             "dtypes": BF16_MOMENTS.dtypes}
    name = model.chunks[-1].names[0]
    assert reader.read(name, "exp_avg").dtype == torch.bfloat16


@pytest.mark.parametrize("saved,resumed", [("fp32", "bf16-moments"),
                                           ("bf16-moments", "fp32")])
def test_a_resume_with_the_other_choice_converts_once(tmp_path, saved, resumed,
                                                      capsys):
    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint

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
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]):
        assert torch.equal(fresh_opt.state[q]["master"], opt.state[p]["master"])
        for key in MOMENTS:
            # fp32 to bf16 rounds to nearest; bf16 to fp32 is exact
            expected = opt.state[p][key].to(layout.dtype(key))
            assert torch.equal(fresh_opt.state[q][key], expected)
    # and it trains on, in the new layout
    run_steps(fresh, fresh_opt, range(3, 5))
    assert fresh_opt.state[q]["exp_avg"].dtype == layout.dtype("exp_avg")


def test_a_checkpoint_from_before_the_choice_reads_as_fp32(tmp_path):
    """A manifest without `states` was written when fp32 was the only layout."""
    import json

    from labml_zero.zero3.checkpoint import CheckpointReader, save_checkpoint

    model, opt = sharded(torch.bfloat16, "fp32")
    run_steps(model, opt, range(1))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["states"] == {"name": "fp32", "dtypes": FP32_STATES.dtypes}
    del manifest["states"]
    (tmp_path / "ckpt" / "manifest.json").write_text(json.dumps(manifest))
    assert CheckpointReader(tmp_path / "ckpt").states["name"] == "fp32"
