"""The one assembly path (`labml_zero/assembly.py`): the tiny GPT-NeoX on one local
CPU rank, marked, sharded, placed and given its optimizer in order."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from labml_zero.assembly import Assembled, AutoLimits, Recipe, assemble
from labml_zero.neox import model as neox_model
from labml_zero.neox.finetuners import finetuner
from labml_zero.zero3 import ZeroConfig
from labml_zero.planner.placement import device_optimizer_bytes, shard_specs
from labml_zero.zero3.state_layout import state_layout
from tests.distributed import run_distributed

CPU = torch.device("cpu")


def tiny_layers():
    return neox_model.build_layers(neox_model.tiny(), device="meta")


def recipe(**changes) -> Recipe:
    return Recipe(zero=ZeroConfig(dtype=torch.float32), lr=1e-3, **changes)


def lm_probe(model) -> None:
    ids = torch.randint(0, 100, (1, 9))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                      ids[:, 1:].flatten()).backward()


def test_all_on_the_device_and_wired():
    built = assemble(tiny_layers(), recipe(finetune=finetuner("biases")), device=CPU,
                     init_param=neox_model.init_parameter(neox_model.tiny()))
    assert isinstance(built, Assembled)
    assert built.placement is None and built.decided is None
    # the fine-tuner's counts, and the optimizer holds exactly the trainable shards
    assert 0 < built.counts.trainable < built.counts.total
    trainable = built.model.get_trainable_chunk()
    assert sum(s.numel() for g in built.optimizer.param_groups
               for s in g["params"]) == sum(s.numel() for s in trainable)
    # step 6: the runtime calls the optimizer as each chunk is reduced
    assert built.model.runtime.grad_ready == (built.optimizer.grad_ready,)
    # one Zero3Layer per layer, in order: their layouts feed the memory model
    assert len(built.layers) == len(tiny_layers())


def test_seed_makes_the_same_weights_and_keeps_the_callers_rng():
    init = neox_model.init_parameter(neox_model.tiny())
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = assemble(tiny_layers(), recipe(seed=5), device=CPU, init_param=init)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = assemble(tiny_layers(), recipe(seed=5), device=CPU, init_param=init)
    for x, y in zip(a.model.get_trainable_chunk(), b.model.get_trainable_chunk()):
        assert torch.equal(x, y)


def test_static_placement_offloads_from_the_output_end():
    built = assemble(tiny_layers(), recipe(offload_optimizer=0.5), device=CPU,
                     init_param=neox_model.init_parameter(neox_model.tiny()))
    assert built.placement is not None and built.decided is None
    shards = shard_specs(built.model)
    on_host = built.placement.optimizer_on_host
    assert on_host and max(on_host) == len(shards) - 1
    assert len(built.optimizer.host) == len(on_host)


def test_auto_placement_needs_a_probe_and_limits_off_gpus():
    with pytest.raises(ValueError, match="needs a probe"):
        assemble(tiny_layers(), recipe(offload_optimizer="auto"), device=CPU)
    with pytest.raises(ValueError, match="needs GPUs"):
        assemble(tiny_layers(), recipe(offload_optimizer="auto"), device=CPU,
                 probe=lm_probe)


def test_auto_placement_with_a_simulated_device():
    probed = []

    def probe(model):
        probed.append(model)
        lm_probe(model)

    def limits(shards):
        trainable = sum(s.numel for s in shards if s.trainable)
        # room for the probe's peak and a third of the optimizer state
        return AutoLimits(measure_peak=lambda run: (run(), 1000)[1],
                          device_capacity=1000 + 4 * trainable)

    built = assemble(tiny_layers(), recipe(offload_optimizer="auto",
                                           resident=False),
                     device=CPU, probe=probe, auto_limits=limits)
    assert probed == [built.model]
    assert built.decided is not None
    assert built.placement == built.decided.placement
    assert 0 < len(built.optimizer.host) == len(built.placement.optimizer_on_host)


@pytest.mark.parametrize("states", ["fp32", "bf16-moments"])
def test_auto_placement_counts_the_optimizers_layout(states):
    # fp32 shards are their own masters: 8 bytes of fp32 moments an element,
    # 4 of bf16 ones. The simulated device holds the probe's 1000 bytes and
    # 4 bytes an element more: all of the bf16 moments, half of the fp32 ones.
    def limits(shards):
        trainable = sum(s.numel for s in shards if s.trainable)
        return AutoLimits(measure_peak=lambda run: (run(), 1000)[1],
                          device_capacity=1000 + 4 * trainable)

    built = assemble(tiny_layers(), recipe(offload_optimizer="auto",
                                           resident=False, states=states),
                     device=CPU, probe=lm_probe, auto_limits=limits)
    layout = state_layout(states)
    assert built.optimizer.layout is layout and built.decided.states is layout
    shards = shard_specs(built.model)
    trainable = sum(s.numel for s in shards if s.trainable)
    on_device = trainable - sum(shards[i].numel
                                for i in built.placement.optimizer_on_host)
    k_device = device_optimizer_bytes(4, layout)
    assert built.decided.predicted_peak == 1000 + k_device * on_device
    assert (on_device == trainable) == (states == "bf16-moments")


def test_auto_placement_counts_the_gradients_held_between_micro_batches():
    # With 2 micro-batches a step, the first backward runs under `no_sync`: every
    # trainable chunk then holds its full-size fp32 gradient until the last one
    # reduces it. The simulated device's peak is 1000 bytes plus those buffers,
    # as the probe finds them when each micro-batch starts.
    held = []

    def probe(model):
        held.append(sum(c.grads.full.untyped_storage().nbytes()
                        for c in model.chunks if c.trainable and c.grads.full is not None))
        lm_probe(model)

    full_grads = []

    def limits(shards):
        trainable = sum(s.numel for s in shards if s.trainable)
        # world size 1: a chunk's full buffer is its shard, 4 bytes an element
        full_grads.append(4 * trainable)
        # fp32 shards are their own masters: 8 bytes of moments an element; room
        # for the buffers and half the moments, or for all of them without the
        # buffers, so the one-micro-batch probe would offload nothing
        return AutoLimits(measure_peak=lambda run: (run(), 1000 + max(held))[1],
                          device_capacity=1000 + 4 * trainable + 4 * trainable)

    built = assemble(tiny_layers(), recipe(offload_optimizer="auto",
                                           resident=False, grad_accum=2),
                     device=CPU, probe=probe, auto_limits=limits)
    # the probe ran as the step runs: two micro-batches, the buffers held at the
    # second, and none left after it
    assert held == [0, full_grads[0]]
    assert all(c.grads.full is None for c in built.model.chunks if c.trainable)
    assert built.decided.predicted_peak >= 1000 + full_grads[0]
    assert 0 < len(built.optimizer.host) < len(built.model.get_trainable_chunk())
    with pytest.raises(ValueError, match="grad_accum must be at least 1, got 0"):
        assemble(tiny_layers(), recipe(grad_accum=0), device=CPU)


def test_free_grads_reaches_the_optimizer_and_the_probe():
    left = []

    def probe(model):
        lm_probe(model)
        # the probe frees each reduced gradient as the optimizer will
        left.append([c.local.grad for c in model.chunks if c.trainable])

    def limits(shards):
        trainable = sum(s.numel for s in shards if s.trainable)
        return AutoLimits(measure_peak=lambda run: (run(), 1000)[1],
                          device_capacity=1000 + 4 * trainable)

    built = assemble(tiny_layers(), recipe(offload_optimizer="auto",
                                           update_during_backward=True,
                                           free_grads=True, resident=False),
                     device=CPU, probe=probe, auto_limits=limits)
    assert left and left[0] and all(g is None for g in left[0])
    assert built.optimizer.free_grads
    # the probe's callback was removed: only the optimizer's is left
    assert built.model.runtime.grad_ready == (built.optimizer.grad_ready,)
    # after the probe the stand-in is idle: the optimizer frees them now
    lm_probe(built.model)
    assert built.optimizer.early
    built.optimizer.step()
    assert all(c.local.grad is None for c in built.model.chunks)


def test_free_grads_needs_updates_during_backward():
    with pytest.raises(ValueError, match="free_grads needs update_during_backward"):
        assemble(tiny_layers(), recipe(free_grads=True), device=CPU)


def test_the_fine_tune_prints_the_measured_peaks_of_an_auto_placement():
    # The fine-tune's report after its first steps (`measured_peaks`), on a CPU
    # rank with the simulated device: rank 0 says what was measured beside the
    # prediction; other ranks, and placements not decided by 'auto', say nothing.
    from labml_zero.launch import DistContext
    from labml_zero.finetune.job import PEAKS_AFTER_STEPS, measured_peaks

    def limits(shards):
        trainable = sum(s.numel for s in shards if s.trainable)
        return AutoLimits(measure_peak=lambda run: (run(), 1000)[1],
                          device_capacity=1000 + 4 * trainable)

    built = assemble(tiny_layers(), recipe(offload_optimizer="auto",
                                           resident=False),
                     device=CPU, probe=lm_probe, auto_limits=limits)
    rank0 = DistContext(0, 2, 0, CPU, "gloo")
    (line,) = measured_peaks(built, rank0, PEAKS_AFTER_STEPS)
    assert line.startswith(f"automatic offload after {PEAKS_AFTER_STEPS} steps: "
                           "measured peaks device not measured on cpu (predicted ")
    assert "host resident set" in line and "GiB predicted)" in line
    assert measured_peaks(built, DistContext(1, 2, 1, CPU, "gloo"), 2) == []
    static = assemble(tiny_layers(), recipe(), device=CPU)
    assert measured_peaks(static, rank0, 2) == []


# ## `'auto'` on several ranks: one decision, printed once
#
# Each rank measures its own peak and reads its own capacity, which differ
# between GPUs; a placement decided from a rank's own numbers can differ from
# its neighbour's, and then their collectives no longer match. Here a simulated
# device gives each rank its own capacity: a roomy one, and a tight one with
# room for only part of the optimizer's state.

ROOMY = 10**9


def auto_on_each_rank(ctx, capacities: tuple[int | None, ...],
                      shard_group_size: int | None) -> dict:
    """Assemble with `'auto'` (rank `r`'s capacity `capacities[r]`, `None` for
    the tight one), train two steps; the placement, the losses, and whether the
    rank printed the decision."""
    def limits(shards):
        trainable = sum(s.numel for s in shards if s.trainable)
        tight = 1000 + 4 * trainable
        return AutoLimits(measure_peak=lambda run: (run(), 1000)[1],
                          device_capacity=capacities[ctx.rank] or tight)

    def step_loss(model) -> torch.Tensor:
        # the same batch on every rank: the ranks' losses must then agree
        ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 ids[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    printed = io.StringIO()
    zero = ZeroConfig(dtype=torch.float32, chunk_numel=512,
                      shard_group_size=shard_group_size)
    with contextlib.redirect_stdout(printed):
        built = assemble(tiny_layers(), Recipe(zero=zero, lr=1e-3,
                                               finetune=finetuner("biases"),
                                               offload_optimizer="auto",
                                               resident=True, seed=0),
                         device=ctx.device,
                         init_param=neox_model.init_parameter(neox_model.tiny()),
                         probe=step_loss, auto_limits=limits)
    losses = []
    for _ in range(2):
        losses.append(step_loss(built.model).item())
        built.optimizer.step()
        built.optimizer.zero_grad()
    p = built.placement
    return {"placement": (sorted(p.optimizer_on_host), sorted(p.param_on_host),
                          sorted(p.resident)),
            "losses": losses, "printed": bool(printed.getvalue())}


@pytest.mark.distributed
def test_auto_placement_is_the_same_on_every_rank():
    mixed = run_distributed(auto_on_each_rank, 2, (ROOMY, None), None)
    tight = run_distributed(auto_on_each_rank, 2, (None, None), None)
    # every rank takes the tightest rank's decision: its optimizer state goes
    # (in part) to the host, which the roomy rank alone would not have sent
    decision = tight[0]["placement"]
    assert decision[0], decision
    assert [r["placement"] for r in mixed + tight] == [decision] * 4
    # the same decision is the same program: the same losses, bit for bit
    assert [r["losses"] for r in mixed] == [tight[0]["losses"]] * 2
    assert [r["printed"] for r in mixed] == [True, False]


@pytest.mark.distributed
def test_auto_placement_under_hybrid_sharding_agrees_and_prints_once():
    # shard groups of one rank: two groups, each a whole copy; the ranks agree
    # through the replica group, and only world rank 0 prints, though each
    # rank is rank 0 of its own shard group
    reports = run_distributed(auto_on_each_rank, 2, (ROOMY, None), 1)
    assert reports[0]["placement"] == reports[1]["placement"]
    assert reports[0]["placement"][0]
    assert reports[0]["losses"] == reports[1]["losses"]
    assert [r["printed"] for r in reports] == [True, False]

