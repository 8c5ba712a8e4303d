"""`labml_zero/planner/memory_budget.py` against the engine: the tiny GPT-NeoX,
assembled as the fine-tune assembles it, on two CPU ranks; the bytes it really
holds and moves are the budget's (and the calculator's: the same inputs are in
its grid, tests/docs/calculator_grid.py)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch

from labml_zero.assembly import Recipe, assemble
from labml_zero.neox import model as neox_model
from labml_zero.neox.activation_memory import activation_bytes
from labml_zero.neox.finetuners import finetuner
from labml_zero.neox.family import NEOX
from labml_zero.neox import config as neox_config
from labml_zero.planner import memory_budget, placement
from labml_zero.planner.devices import GPUS
from labml_zero.planner.memory_budget import TORCH_DTYPES, budget
from labml_zero.planner.memory_model import pinned_bytes
from labml_zero.planner.placement import Placement, ShardSpec, resident_bytes
from labml_zero.planner.search import HOST_PROCESS_BYTES
from labml_zero.planner.setting import Job, Setting, budget_inputs, budget_of
from labml_zero.zero3 import ZeroConfig
from tests.distributed import run_distributed
from tests.docs.calculator_grid import ENGINE_CASES, neox_inputs as BudgetInputs
from tests.zero3.test_memory_and_comm import held_bytes


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                             ids[:, 1:].flatten())


def engine_bytes(ctx, inputs: BudgetInputs) -> dict:
    config = ZeroConfig(dtype=TORCH_DTYPES[inputs.param_dtype],
                        reduce_dtype=TORCH_DTYPES[inputs.reduce_dtype],
                        chunk_numel=inputs.chunk_numel,
                        prefetch_depth=inputs.prefetch_depth)
    built = assemble(neox_model.build_layers(inputs.model, device="meta",
                                             kernels=inputs.kernels),
                     Recipe(zero=config, finetune=finetuner(inputs.finetune), seed=0),
                     device=ctx.device,
                     init_param=neox_model.init_parameter(inputs.model))
    model, optimizer = built.model, built.optimizer
    counter = model.runtime.comm.counter
    torch.manual_seed(ctx.rank)
    ids = torch.randint(0, 1000, (inputs.batch, inputs.seq + 1), device=ctx.device)
    # one step: what each collective moves
    counter.reset()
    lm_loss(model, ids).backward()
    moved = dict(counter.bytes)
    optimizer.step()
    states = held_bytes(model, optimizer)
    model.zero_grad()
    # a micro-batch under no_sync: every trainable chunk keeps its buffer
    with model.no_sync():
        lm_loss(model, ids).backward()
    buffers = sum(chunk.grads.full.untyped_storage().nbytes()
                  for chunk in model.chunks if chunk.trainable)
    return {"states": states, "moved": moved, "buffers": buffers,
            "chunk_numel": model.layout.chunk_numel}


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(ENGINE_CASES)))
def test_the_engine_holds_and_moves_the_budget(case):
    inputs = ENGINE_CASES[case]
    expected = budget(inputs)
    for got in run_distributed(engine_bytes, inputs.world_size, inputs):
        assert got["chunk_numel"] == expected.chunk_numel
        # the shards, the fp32 gradient shards, master and moments
        assert got["states"] == (expected.params + expected.grad_shards
                                 + expected.optimizer_device)
        # the full-size buffers held under accumulation: g_r Ψ_t, padded
        assert got["buffers"] == expected.accumulation
        assert got["moved"]["all_gather"] == expected.all_gather
        assert got["moved"]["reduce_scatter"] == expected.reduce_scatter


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_fp8_gathers_move_and_hold_the_budget(world_size):
    """With fp8 products (emulated) on several ranks the layers' weights are
    gathered in fp8: the engine moves the budget's bytes, fewer than the same
    job's in bf16, and holds its states."""
    pytest.importorskip("torchao.float8")
    from labml_zero.neox.kernels import ModelKernels

    kernels = ModelKernels(fp8=True, fp8_emulate=True, fp8_every_linear=True)
    inputs = replace(ENGINE_CASES[0], world_size=world_size, kernels=kernels,
                     param_dtype="bf16", micro_batches=1)
    expected = budget(inputs)
    plain = budget(replace(inputs, kernels=ModelKernels()))
    assert expected.all_gather < plain.all_gather
    assert expected.gathered > plain.gathered  # the codes' buffers
    for got in run_distributed(engine_bytes, world_size, inputs):
        assert got["moved"]["all_gather"] == expected.all_gather
        assert got["moved"]["reduce_scatter"] == expected.reduce_scatter
        assert got["states"] == (expected.params + expected.grad_shards
                                 + expected.optimizer_device)


def accumulated_grads(ctx, accumulate: bool) -> list[torch.Tensor]:
    config = neox_model.NeoXConfig(n_vocab=128, d_model=32, n_heads=2, n_layers=1)
    built = assemble(neox_model.build_layers(config, device="meta"),
                     Recipe(zero=ZeroConfig(dtype=torch.float32), seed=0),
                     device=ctx.device, init_param=neox_model.init_parameter(config))
    model = built.model
    torch.manual_seed(0)
    first, second = torch.randint(0, 128, (2, 2, 9), device=ctx.device)
    with model.no_sync() if accumulate else contextlib.nullcontext():
        lm_loss(model, first).backward()
    lm_loss(model, second).backward()
    return [chunk.local.grad.clone() for chunk in model.chunks if chunk.trainable]


@pytest.mark.distributed
def test_one_rank_accumulates_through_its_buffer():
    """At N_d = 1 with an fp32 reduction the gradient skips the buffer, except
    after `no_sync`: the buffer holds the earlier micro-batches (the budget's
    accumulation term), and the sum is that of two reduced backward passes."""
    (accumulated,) = run_distributed(accumulated_grads, 1, True)
    (reduced,) = run_distributed(accumulated_grads, 1, False)
    for a, b in zip(accumulated, reduced):
        # fp32 sums of the same two terms, in either order: a few ulps apart
        torch.testing.assert_close(a, b, rtol=4 * torch.finfo(torch.float32).eps,
                                   atol=4 * torch.finfo(torch.float32).eps)


def test_the_worked_example_peaks_at_the_start_of_backward():
    """The notes' worked example: its peak is the backward term at the loss's
    peak, which leaves the gradient shards out and every activation in; the
    layers' gradients come later, beside fewer activations."""
    example = budget(BudgetInputs())
    backward = (example.device_states - example.grad_shards + example.gathered
                + example.activations)
    assert example.peak == backward > example.device_states
    assert example.activations > example.activations_beside_grads + example.grad_buffer


def test_lora_activations_are_in_the_peak():
    """LoRA's activations are the activation model's at the job's rank and
    targets, and the peak holds them: each extra rank of each adapter adds its
    A x, 2 bytes for each of n tokens, in every layer."""
    job = BudgetInputs(model=neox_model.pythia_160m(), world_size=8, finetune="lora",
                       lora_rank=16, lora_targets=("query_key_value", "dense"),
                       batch=2, seq=512, chunk_numel=2**22)
    got = budget(job)
    assert got.activations == activation_bytes(
        job.model, batch=2, seq=512, finetune="lora", lora_rank=16,
        lora_targets=("query_key_value", "dense")).total
    assert got.peak == (got.device_states - got.grad_shards + got.gathered
                        + got.activations) > got.device_states
    wider = budget(replace(job, lora_rank=32))
    n, L = 2 * 512, job.model.n_layers
    assert wider.activations - got.activations == L * 2 * n * (32 - 16) * 2


def unpinned(inputs) -> memory_budget.Budget:
    """The budget with each staging buffer at its own $4S$ bytes."""
    with mock.patch.object(placement, "pinned_bytes", lambda nbytes: nbytes):
        return budget(inputs)


def test_pinned_staging_is_rounded_to_a_power_of_two():
    assert [pinned_bytes(n) for n in (0, 1, 4, 5, 2**24, 2**24 + 1)] == \
        [0, 1, 4, 8, 2**24, 2**25]
    shards = [ShardSpec(numel=5, trainable=True), ShardSpec(numel=8, trainable=True)]
    both = Placement(optimizer_on_host=frozenset({0, 1}))
    # 12 of state each element; staging 20 -> 32 and 32 -> 32 bytes
    assert resident_bytes(both, shards).host == 12 * 13 + 4 * 13
    assert resident_bytes(both, shards, pinned=True).host == 12 * 13 + 32 + 32


# GPT-NeoX-20B's full fine-tune on one H200, bf16 states rounded
# stochastically, 8 x 2048 tokens: three runs of the job, each with the
# machine's used memory (`free`, every process) sampled every second
RUN74 = (Path(__file__).resolve().parents[2] / "bench" / "results"
         / "2026-12-06-run74-1xH200-job-20b-gradients-kept.txt")
HOST_GOAL = 0.05  # issue 49: host memory within 5%


def test_the_20b_runs_host_memory_is_the_budgets():
    """With a quarter and with 0.4 of the state on the host, the node's host
    memory the planner counts (the state, the pinned staging buffers as
    allocated, one process) is what the machine used, within 1%; without
    the staging buffers' rounding it was 7 to 8% short. (These runs ran out
    of device memory in their first step, after the host state was made.)"""
    job = Job(model=neox_config.PRESETS["gpt-neox-20b"](), seq=2048, global_batch=8,
              states="bf16-stochastic", family=NEOX)
    checked = 0
    for run in RUN74.read_text().split("## run")[1:]:
        fraction = re.search(r"--offload-optimizer ([\d.]+) ", run)
        if fraction is None:
            continue  # nothing offloaded: the process alone
        setting = Setting(batch=8, micro_batches=1, checkpointing=True,
                          offload_fraction=float(fraction.group(1)), compile=True)
        used = int(re.search(r"max host used MiB: (\d+)", run).group(1)) * 2**20
        node = budget_of(job, setting, world_size=1,
                         device_bytes=GPUS["h200"].memory_bytes).optimizer_host
        node += HOST_PROCESS_BYTES
        assert node / used - 1 == pytest.approx(0, abs=0.01)
        flat = unpinned(budget_inputs(job, setting, world_size=1,
                                      device_bytes=GPUS["h200"].memory_bytes))
        assert flat.optimizer_host + HOST_PROCESS_BYTES < (1 - HOST_GOAL) * used
        checked += 1
    assert checked == 2


def test_fitting_the_device_offloads_the_fewest_chunks():
    """`offload_fraction=None` offloads until the peak fits, and no more; a device
    too small for everything offloaded says it does not fit."""
    job = BudgetInputs(model=neox_model.pythia_1b(), world_size=1, batch=2,
                       chunk_numel=2**22, offload_fraction=None,
                       device_bytes=12 * 2**30)
    fitted = budget(job)
    assert fitted.fits and 0 < fitted.offloaded_fraction < 1
    # per offloaded element 12 bytes of state and 4 of staging buffer, which
    # the host's allocator rounds up to a power of two a shard
    flat = unpinned(job)
    assert flat.host_down == 4 * flat.optimizer_host // 16
    assert flat.optimizer_host <= fitted.optimizer_host < 2 * flat.optimizer_host
    assert not budget(replace(job, device_bytes=2**30)).fits
    with pytest.raises(ValueError, match="shard_group_size 3 does not divide"):
        budget(BudgetInputs(world_size=8, shard_group_size=3))
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        BudgetInputs(param_dtype="int8")


def test_an_offload_a_run_chose_is_replayed_chunk_for_chunk():
    """`offloaded_chunks=k` offloads the first k chunks of `offload_order`, the
    automatic placement's chunks: where the fitted count is given back, the
    budget is the fitted one, and a fraction of the same elements, taken from
    the output end, may move other chunks."""
    job = BudgetInputs(model=neox_model.pythia_1b(), world_size=1, batch=2,
                       chunk_numel=2**22, offload_fraction=None,
                       device_bytes=12 * 2**30)
    fitted = budget(job)
    by_count = [budget(replace(job, offloaded_chunks=k)) for k in range(fitted.chunks + 1)]
    same = [b for b in by_count if b.offloaded_fraction == fitted.offloaded_fraction]
    assert 0 < fitted.offloaded_fraction < 1 and len(same) == 1
    assert (same[0].peak, same[0].optimizer_host) == (fitted.peak, fitted.optimizer_host)
    # each count offloads more than the one before it
    assert all(a.optimizer_device > b.optimizer_device for a, b in zip(by_count, by_count[1:]))
    assert budget(replace(job, offloaded_chunks=0)).optimizer_host == 0
    with pytest.raises(ValueError, match="offloaded_chunks must be >= 0"):
        replace(job, offloaded_chunks=-1)


def test_the_kernels_reach_the_activations():
    """The budget's activations are the activation page's count for the kernels
    of the job: the chunked loss holds no logits, so the peak drops."""
    kernels = neox_model.ModelKernels.from_names("loss,rotary,norms")
    plain = BudgetInputs(world_size=1, batch=8, seq=2048)
    fused = replace(plain, kernels=kernels)
    expected = activation_bytes(plain.model, batch=8, seq=2048, finetune="all",
                                kernels=kernels).total
    assert budget(fused).activations == expected
    assert budget(plain).peak - budget(fused).peak == (
        budget(plain).activations - expected)


def test_early_updates_add_q_of_the_largest_gradient_shards():
    """With `update_during_backward` the peak leaves the gradient shards out but
    holds the engine's Q queued ones, each the largest trainable shard: in the
    parameter dtype on one rank (its gradient stays narrow), fp32 on two."""
    from labml_zero.optimizers.early_update import EARLY_UPDATES_IN_FLIGHT

    for world_size, grad_bytes in ((1, 2), (2, 4)):
        job = BudgetInputs(model=neox_model.pythia_160m(), world_size=world_size,
                           batch=1, seq=256, chunk_numel=2**22)
        kept, early = budget(job), budget(replace(job, update_during_backward=True))
        _, layout, _ = memory_budget._layout(job)
        largest = max(layout.shard_numel(c) for c in layout.chunks if c.trainable)
        assert kept.early_grads == 0
        assert early.early_grads == EARLY_UPDATES_IN_FLIGHT * grad_bytes * largest
        # the queued gradients come beside the layers' activations, which
        # with them outweigh the loss's peak here
        beside = early.activations_beside_grads + early.grad_buffer + early.early_grads
        assert beside > early.activations
        assert early.peak == (early.device_states - early.grad_shards
                              + early.gathered + beside)


def test_the_state_layout_sets_k_on_the_device_and_the_host():
    """Each layout's $K$ scales the optimizer's bytes, on the device and, where
    offloaded, on the host; a layout without a master keeps a copy of the
    weight on the host besides."""
    from labml_zero.zero3.state_layout import LAYOUTS

    def run(states, offload):
        return budget(BudgetInputs(states=states, offload_fraction=offload))

    for offload in (0.0, 0.5):
        base = run("fp32", offload)
        for name in ("bf16-moments",):
            other = run(name, offload)
            ratio = LAYOUTS[name].bytes_per_element() / LAYOUTS["fp32"].bytes_per_element()
            assert other.optimizer_device == base.optimizer_device * ratio
            assert other.peak - base.peak == other.optimizer_device - base.optimizer_device
            assert other.offloaded_fraction == base.offloaded_fraction
    fitted = run("bf16-stochastic", None)
    assert fitted.offloaded_fraction == 0.0 and fitted.optimizer_host == 0
    assert fitted.optimizer_device == (LAYOUTS["bf16-stochastic"].bytes_per_element()
                                       * fitted.grad_shards // 4)
    for name in ("bf16-stochastic", "bf16-kahan"):
        none, half = run(name, 0.0), run(name, 0.5)
        layout = LAYOUTS[name]
        offloaded = half.offloaded_fraction * half.grad_shards // 4
        assert 0 < half.offloaded_fraction < 1
        # the device saves K; the host holds K + p (the weight's copy) + 4,
        # the staging buffer's 4 before its pinned rounding
        assert none.peak - half.peak == layout.bytes_per_element() * offloaded
        flat = unpinned(BudgetInputs(states=name, offload_fraction=0.5))
        assert flat.optimizer_host == (layout.bytes_per_element() + 2 + 4) * offloaded
    with pytest.raises(ValueError, match="states must be one of fp32"):
        BudgetInputs(states="int8")


def test_a_llama_models_budget_asks_its_family():
    """The same sum for another family: Llama-3.2-1B's parameters are its
    family's count (the tied readout once), its activations the family's
    count, and LoRA's trainable elements $r (d_{in} + d_{out})$ per adapter;
    a fine-tuner the family lacks is refused in one line."""
    from labml_zero.llama.config import llama_3_2_1b
    from labml_zero.llama.family import LLAMA

    model = llama_3_2_1b()
    job = memory_budget.BudgetInputs(model, family=LLAMA, world_size=8, batch=2,
                                     seq=1024, chunk_numel=2**24)
    got = budget(job)
    layers = LLAMA.build(model, device="meta")
    assert got.psi_trainable + got.psi_frozen == LLAMA.count_parameters(layers)
    assert got.psi_frozen == 0
    assert got.activations == LLAMA.activation_memory(
        model, batch=2, seq=1024, finetune="all", checkpointing=False,
        kernels=LLAMA.resolve_kernels("none", "cpu"))
    assert job.lora_targets == LLAMA.lora_targets
    lora = budget(replace(job, finetune="lora", lora_rank=16,
                          lora_targets=("q_proj", "down_proj")))
    d, L = model.d_model, model.n_layers
    q_out = model.n_heads * model.head_width
    assert lora.psi_trainable == L * 16 * ((d + q_out) + (model.d_ff + d))
    with pytest.raises(ValueError, match="^finetune must be one of all, lora for "
                                         "the llama family, got 'biases'$"):
        memory_budget.BudgetInputs(model, family=LLAMA, finetune="biases")
