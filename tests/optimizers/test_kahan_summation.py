"""
`states="bf16-kahan"`: no master, bf16 moments, and a bf16 compensation $c$
beside each bf16 weight $w$; the update runs on $x = w + c$ and splits its
result back into $w' = \\operatorname{rn}(x')$ and $c' = \\operatorname{rn}(x' - w')$.

Two references. The twin is `torch.optim.AdamW` on the fp32 pair $w + c$, its
moments rounded to bf16 and its result split the same way after every step:
the same kernel on the same operands, so the tolerance is zero (as in
tests/optimizers/test_narrow_moments.py). The other is an fp32 master (AdamW
with the same bf16 moments): the pair follows it within what the splits lose,
derived below from bf16's unit roundoff $u$.
"""

from __future__ import annotations

import pytest
import torch

from labml_zero.optimizers import kahan_summation
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.zero3.shard import LocalShard
from labml_zero.zero3.state_layout import BF16_KAHAN
from tests import tolerance
from tests.optimizers import no_master_steps as steps_driver
from tests.optimizers.test_narrow_moments import MOMENTS, round_moments
from tests.optimizers.test_offload import (DEVICE, HYPER, gradients, run_steps,
                                           set_grad, shards)
from tests.optimizers.test_stochastic_rounding import (
    early_update_is_the_same_update)

STEPS = 20
U = tolerance.unit_roundoff(torch.bfloat16)
# One split loses $|x' - (w' + c')| \le u |x' - w'| \le u^2 |x'|$; the fp32
# sum $w + c$ and the two programs' fp32 updates round by $2^{-24} |x|$ each,
# far below a second $u^2 |x|$: at most $2 u^2 |x|$ a step.
PER_STEP = 2 * U**2


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` as the optimizer stores it: $w$ to nearest, then $c$."""
    w = x.bfloat16()
    return w, (x - w.float()).bfloat16()


def pair(p: torch.Tensor, opt: AdamFP16) -> torch.Tensor:
    """The weight the update sees, $w + c$ in fp32."""
    return p.detach().float() + opt.state[p]["compensation"].float()


def test_small_updates_are_kept_every_time():
    """Weights of 1 in bf16 (a step of $2^{-7}$ above 1) each get 1,000
    updates between $10^{-4}$ and $3 \\cdot 10^{-4}$, below half a step:
    rounded to nearest nothing moves; with the compensation each weight ends
    within $1000 \\cdot 2u^2 \\max|x| \\approx 0.04$ of the fp32 sum, against
    stochastic rounding's $6 \\cdot 2^{-8} \\sqrt{1000} \\approx 0.74$ for one
    weight (tests/optimizers/test_stochastic_rounding.py)."""
    n, updates = 64, 1000
    delta = torch.linspace(1e-4, 3e-4, n)  # [n] fp32
    shard = torch.ones(n, dtype=torch.bfloat16)
    compensation = torch.zeros(n, dtype=torch.bfloat16)
    moments = [torch.zeros(n, dtype=torch.bfloat16) for _ in MOMENTS]

    def add(weights, grads, exp_avgs, exp_avg_sqs):
        weights[0].add_(grads[0])

    total = torch.ones(n)  # [n] fp32, the master's sum
    nearest = shard.clone()
    for _ in range(updates):
        kahan_summation.update(add, [shard], [delta], [compensation],
                               *[[m] for m in moments])
        total += delta
        nearest = (nearest.float() + delta).bfloat16()
    bound = updates * PER_STEP * total.abs().max().item()
    assert bound < 0.05
    kept = shard.float() + compensation.float()
    assert (kept - total).abs().max().item() <= bound
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))
    assert (nearest.float() - total).abs().min().item() > bound
    # and the weight alone is the sum rounded, within one of its steps
    assert (shard.float() - total).abs().max().item() <= 2**-7


def reference(theirs: list[torch.nn.Parameter], bug: str | None, *,
              fused: bool = False) -> torch.optim.AdamW:
    """AdamW on fp32 copies, its $\beta_2$ perturbed for that bug."""
    beta1, beta2 = HYPER["betas"]
    betas = (beta1, beta2 + 1e-3 if bug == "beta2 perturbed" else beta2)
    return torch.optim.AdamW(theirs, **{**HYPER, "betas": betas},
                             fused=fused or None, foreach=not fused)


def step_both(opt: AdamFP16, ref: torch.optim.AdamW, ours, theirs, step: int,
              moments: str | None = None) -> None:
    """One step of each on the same gradients, the reference's moments then
    rounded to bf16 (`round_moments`, `moments` a wrong variant)."""
    for p, q, g in zip(ours, theirs, gradients(step)):
        set_grad(p, g.clone())
        q.grad = g.clone()
    opt.step()
    ref.step()
    round_moments(ref, moments)
    opt.zero_grad()


def start(ours: list[torch.Tensor]) -> list[torch.Tensor]:
    """$w + c$ at the first step: the shard and, from the engine's exact fp32
    weights, $c = \\operatorname{rn}(\\theta - w)$."""
    return [p.detach().float() + (LocalShard.of(p).master_init
                                  - p.detach().float()).bfloat16().float()
            for p in ours]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bug", [None, "compensation dropped",
                                 "moments kept fp32", "beta2 perturbed"])
def test_the_update_is_adamw_on_the_pair(fused, bug):
    ours = shards(torch.bfloat16)
    theirs = [torch.nn.Parameter(x) for x in start(ours)]
    opt = AdamFP16(ours, **HYPER, fused=fused, states="bf16-kahan")
    ref = reference(theirs, bug, fused=fused)
    for step in range(STEPS):
        step_both(opt, ref, ours, theirs, step,
                  bug if bug == "moments kept fp32" else None)
        with torch.no_grad():
            for q in theirs:
                w, c = split(q)
                q.copy_(w.float() + (0 if bug == "compensation dropped"
                                     else c.float()))
    assert same_as_reference(opt, ref, ours, theirs) == (bug is None)
    for p, q in zip(ours, theirs):
        assert list(opt.state[p]) == ["step", "compensation", *MOMENTS]
        assert LocalShard.of(p).master_init is None  # dropped, not kept
        if bug is None and DEVICE.type == "cpu":
            # the shard is the pair's weight, its compensation what is left
            assert torch.equal(p.detach(), q.detach().bfloat16())


def same_as_reference(opt: AdamFP16, ref: torch.optim.AdamW, ours, theirs) -> bool:
    """On CPU the pairs bit for bit. A GPU's kernels round their fp32 values
    in their own orders: then no more values apart than chance allows, as in
    `pairs_apart`."""
    if DEVICE.type == "cpu":
        return all(torch.equal(pair(p, opt), q.detach()) for p, q in zip(ours, theirs))
    apart = sum(int((~torch.isclose(pair(p, opt), q.detach(),
                                    rtol=STEPS * PER_STEP, atol=0)).sum())
                + sum(int((opt.state[p][key] != ref.state[q][key].bfloat16()).sum())
                      for key in MOMENTS)
                for p, q in zip(ours, theirs))
    return apart <= steps_driver.flips_at_most(3 * sum(p.numel() for p in ours), STEPS)


@pytest.mark.parametrize("bug", [None, "compensation dropped", "beta2 perturbed"])
def test_the_pair_follows_an_fp32_master(bug):
    """Against AdamW on the fp32 master with the same bf16 moments: the
    moments do not read the weight, so both take the same updates and differ
    only by what each split loses, $2u^2 |x_t|$ at step $t$, plus the start's
    one split; weight decay shrinks a difference, never grows it. So
    $|w + c - \\theta| \\le 2u^2 \\sum_t |\\theta_t|$ per element, about
    $6 \\cdot 10^{-4}$ of the weight after 20 steps, where rounding to
    nearest alone loses up to $2^{-9}$ of it each step."""
    ours = shards(torch.bfloat16)
    theirs = [torch.nn.Parameter(LocalShard.of(p).master_init.clone()) for p in ours]
    opt = AdamFP16(ours, **HYPER, states="bf16-kahan")
    ref = reference(theirs, bug)
    # [S] fp32 each: $\sum_t |\theta_t|$, the start's included
    spread = [q.detach().abs() for q in theirs]
    for step in range(STEPS):
        step_both(opt, ref, ours, theirs, step)
        if bug == "compensation dropped":
            for p in ours:
                opt.state[p]["compensation"].zero_()
        for total, q in zip(spread, theirs):
            total += q.detach().abs()
    within = all(bool(((pair(p, opt) - q.detach()).abs() <= PER_STEP * total).all())
                 for p, q, total in zip(ours, theirs, spread))
    assert within == (bug is None)


def test_fp32_shards_are_their_own_masters():
    """An fp32 shard (one rank may keep the parameter dtype) is updated in
    place, as without a compensation; its compensation stays zero."""
    kahan, stochastic = shards(torch.float32), shards(torch.float32)
    opt = AdamFP16(kahan, **HYPER, states="bf16-kahan")
    other = AdamFP16(stochastic, **HYPER, states="bf16-stochastic")
    for step in range(5):
        for a, b, g in zip(kahan, stochastic, gradients(step)):
            set_grad(a, g.clone())
            set_grad(b, g.clone())
        opt.step()
        other.step()
    for a, b in zip(kahan, stochastic):
        assert torch.equal(a, b)
        assert not opt.state[a]["compensation"].any()
        for key in MOMENTS:
            assert torch.equal(opt.state[a][key], other.state[b][key])


def test_an_early_update_is_the_same_update():
    early_update_is_the_same_update("bf16-kahan")


def test_what_cannot_go_without_a_master_is_refused():
    half = [LocalShard(torch.ones(4).half(), trainable=True).param]
    with pytest.raises(ValueError, match="^states 'bf16-kahan' rounds into bf16 "
                                         "or fp32 parameters, got torch.float16$"):
        AdamFP16(half, states="bf16-kahan")
    # on the host as on the device
    with pytest.raises(ValueError, match="^states 'bf16-kahan' rounds into bf16 "
                                         "or fp32 parameters, got torch.float16$"):
        AdamFP16(half, states="bf16-kahan", offload={0})


def sharded(states: str, *, chunk_numel: int = 200):
    """The engine on a small model, bf16 chunks of `chunk_numel` elements."""
    from labml_zero.planner.sharding import zero3_layers
    from labml_zero.zero3 import ZeroConfig, Zero3Sequential
    from tests.zero3.models import tiny_layers

    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=chunk_numel, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device=DEVICE,
                                         config=config))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=3e-3, weight_decay=0.01,
                         states=states)
    model.runtime.on_grad_ready(optimizer.grad_ready)
    return model, optimizer


def states_by_name(model, optimizer, key: str) -> dict[str, torch.Tensor]:
    """Each parameter's slice of a state (or of the shard), by name: the same
    whatever the chunk size, at world size 1."""
    out = {}
    for chunk in model.chunks:
        if not chunk.trainable:
            continue
        whole = (chunk.shard.detach() if key == "param"
                 else optimizer.state[chunk.shard][key])
        for name, slot in zip(chunk.names, chunk.spec.slots):
            out[name] = whole[slot.offset : slot.offset + slot.numel]
    return out


def test_resume_is_bit_exact_and_reshards(tmp_path):
    from labml_zero.zero3.checkpoint import (CheckpointReader, load_checkpoint,
                                             save_checkpoint)

    model, opt = sharded("bf16-kahan")
    run_steps(model, opt, range(3))
    save_checkpoint(tmp_path / "ckpt", model, opt)
    assert CheckpointReader(tmp_path / "ckpt").states == {
        "name": "bf16-kahan", "dtypes": BF16_KAHAN.dtypes}
    run_steps(model, opt, range(3, 6))
    fresh, fresh_opt = sharded("bf16-kahan")
    assert load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt).converted is None
    run_steps(fresh, fresh_opt, range(3, 6))
    for a, b in zip(model.chunks, fresh.chunks):
        assert torch.equal(a.shard, b.shard)
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]):
        for key in BF16_KAHAN.names:
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    # another chunk size: each parameter's compensation read back as saved
    saved, _ = sharded("bf16-kahan")
    saved_opt = AdamFP16(saved.get_trainable_chunk(), states="bf16-kahan")
    load_checkpoint(tmp_path / "ckpt", saved, saved_opt)
    other, other_opt = sharded("bf16-kahan", chunk_numel=120)
    load_checkpoint(tmp_path / "ckpt", other, other_opt)
    for key in ("param", *BF16_KAHAN.names):
        a = states_by_name(saved, saved_opt, key)
        b = states_by_name(other, other_opt, key)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_resume_from_a_master_keeps_it_to_16_bits(tmp_path, capsys):
    from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint

    full, full_opt = sharded("fp32")
    run_steps(full, full_opt, range(3))
    save_checkpoint(tmp_path / "fp32", full, full_opt)
    capsys.readouterr()
    fresh, fresh_opt = sharded("bf16-kahan")
    loaded = load_checkpoint(tmp_path / "fp32", fresh, fresh_opt)
    assert loaded.converted.endswith("saved as 'fp32', converted once to "
                                     "'bf16-kahan'")
    assert capsys.readouterr().err == loaded.converted + "\n"
    for p, q in zip(full_opt.param_groups[0]["params"],
                    fresh_opt.param_groups[0]["params"]):
        master = full_opt.state[p]["master"]
        # the shard is the master to nearest, the compensation what it lost
        assert torch.equal(q.detach(), master.bfloat16())
        assert torch.equal(fresh_opt.state[q]["compensation"], split(master)[1])
        assert torch.equal(fresh_opt.state[q]["exp_avg"],
                           full_opt.state[p]["exp_avg"].bfloat16())
    # and back: the master is the pair, $w + c$, not the shard alone
    run_steps(fresh, fresh_opt, range(3, 4))
    save_checkpoint(tmp_path / "back", fresh, fresh_opt)
    again, again_opt = sharded("fp32")
    load_checkpoint(tmp_path / "back", again, again_opt)
    for p, q in zip(fresh_opt.param_groups[0]["params"],
                    again_opt.param_groups[0]["params"]):
        assert torch.equal(again_opt.state[q]["master"], pair(p, fresh_opt))
    assert BF16_KAHAN.bytes_per_element() == 2 + 2 + 2


KAHAN_NAMES = ("compensation", *MOMENTS)


def twin_step(state, grad, step, lr):
    kahan_summation.update(steps_driver.fp32_kernel(step, lr), [state["weight"]],
                           [grad], [state["compensation"]], [state["exp_avg"]],
                           [state["exp_avg_sq"]])


def one_pass_step(state, grad, step, lr):
    _, coefficients = steps_driver.scalars(step, lr)
    run = (kahan_summation.compiled_update() if DEVICE.type == "cuda"
           else kahan_summation.adamw_kahan_)
    run(state["weight"], tuple(state[n] for n in KAHAN_NAMES), grad,
        coefficients, None, steps_driver.betas())


def pairs_apart(a: dict, b: dict) -> int:
    """Values the two programs did not store alike: pairs $w + c$ further
    apart than the splits lose, `PER_STEP` of $|x|$ a step (the programs'
    fp32 roundings far below it), and moments rounded to different bf16
    neighbours. Where a moment went to the other neighbour its weight's
    later updates differ by up to $2^{-8}$ of the update, more than a pair's
    tolerance for a weight near zero; both are rare (`flips_at_most`)."""
    moments = sum(int((a[key] != b[key]).sum()) for key in MOMENTS)
    pairs = torch.isclose(a["weight"].float() + a["compensation"].float(),
                          b["weight"].float() + b["compensation"].float(),
                          rtol=steps_driver.STEPS * PER_STEP, atol=0)
    return moments + int((~pairs).sum())


def test_one_pass_is_the_twin_within_rounding():
    reference = steps_driver.train(twin_step, KAHAN_NAMES)
    allowed = steps_driver.flips_at_most(3 * steps_driver.SIZE, steps_driver.STEPS)
    assert pairs_apart(steps_driver.train(one_pass_step, KAHAN_NAMES),
                       reference) <= allowed
    # a learning rate 1% off moves $x$ by about $10^{-4}$ a step
    wrong = steps_driver.train(one_pass_step, KAHAN_NAMES,
                               lr=steps_driver.HYPER["lr"] * 1.01)
    assert pairs_apart(wrong, reference) > allowed
