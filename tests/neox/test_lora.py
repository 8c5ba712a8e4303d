"""`labml_zero/neox/lora.py`: the adapted linear, the fine-tuner, loading, memory,
and fp32 parity with plain PyTorch LoRA trained by `torch.optim.AdamW`."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labml_zero.neox import model as M
from labml_zero.neox.finetuners import finetuner
from labml_zero.neox.hf_checkpoint import HFCheckpoint
from labml_zero.neox.lora import (TARGETS, FineTuneLoRA, LoRALinear, load_hf_layer,
                                  lora_model_states, sharded_count)
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.checkpoint import load_checkpoint, save_checkpoint
from labml_zero.zero3.trainable import TrainableCount
from tests import tolerance
from tests.distributed import run_distributed
from tests.zero3.test_memory_and_comm import held_bytes


def small_config() -> M.NeoXConfig:
    """3 heads of 24 (6 rotary dims), d_ff 100, vocab 97: every size odd."""
    return M.NeoXConfig(n_vocab=97, d_model=72, n_heads=3, n_layers=2, d_ff=100,
                        max_position=64, gelu_approximate="none")


# ## The fine-tuner


@pytest.fixture
def layers():
    return M.build_layers(small_config(), device="meta")


def adapter_numel(c: M.NeoXConfig, rank: int, targets) -> int:
    shapes = {"query_key_value": (c.d_model, 3 * c.d_model),
              "dense": (c.d_model, c.d_model),
              "dense_h_to_4h": (c.d_model, c.ff_dim),
              "dense_4h_to_h": (c.ff_dim, c.d_model)}
    return c.n_layers * sum(rank * sum(shapes[t]) for t in targets)


def test_all_four_targets_by_default(layers):
    c = small_config()
    total = M.count_parameters(layers)
    count = FineTuneLoRA(rank=4, alpha=8)(layers)
    assert count.trainable == adapter_numel(c, 4, TARGETS)
    assert count.total == total + count.trainable
    trainable = {n for layer in layers for n, p in layer.named_parameters()
                 if p.requires_grad}
    assert trainable == {f"{path}.{m}" for path in TARGETS.values()
                         for m in ("lora_A", "lora_B")}
    block = layers[1]
    assert isinstance(block.attention.query_key_value, LoRALinear)
    assert isinstance(block.mlp.dense_4h_to_h, LoRALinear)
    # the base names are unchanged, so checkpoints still load by name
    names = {n for n, _ in block.named_parameters()}
    assert {n for n, _ in M.TransformerLayer(c, 0, device="meta")
            .named_parameters()} <= names


def test_a_subset_of_targets(layers):
    c = small_config()
    lora = finetuner("lora", rank=2, alpha=2, targets=("dense", "dense_h_to_4h"))
    count = lora(layers)
    assert count.trainable == adapter_numel(c, 2, ("dense", "dense_h_to_4h"))
    assert type(layers[1].attention.query_key_value) is nn.Linear
    assert type(layers[1].mlp.dense_4h_to_h) is nn.Linear
    assert lora.scale == 1.0


def test_bad_options_are_refused(layers):
    with pytest.raises(ValueError, match="LoRA rank must be an integer >= 1"):
        FineTuneLoRA(rank=0)
    with pytest.raises(ValueError, match="LoRA alpha must be > 0"):
        FineTuneLoRA(alpha=0)
    with pytest.raises(ValueError, match="unknown LoRA target 'mlp'"):
        FineTuneLoRA(targets=("dense", "mlp"))
    with pytest.raises(ValueError, match="at least one projection"):
        FineTuneLoRA(targets=())
    with pytest.raises(ValueError, match="takes no options"):
        finetuner("biases", rank=4)
    FineTuneLoRA()(layers)
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        FineTuneLoRA()(layers)


def test_init_param_initialises_adapters_and_delegates_the_rest():
    lora = FineTuneLoRA(rank=4)
    seen = []
    init = lora.init_param(lambda name, p: seen.append(name))
    a, b = torch.full((4, 9), 5.0), torch.full((9, 4), 5.0)
    init("attention.dense.lora_A", a)
    init("attention.dense.lora_B", b)
    init("attention.dense.weight", torch.empty(9, 9))
    assert seen == ["attention.dense.weight"]
    assert a.abs().max() <= 1 / 3 and torch.count_nonzero(b) == 0


# ## Built on meta, sharded, loaded from a Hugging Face checkpoint


def test_meta_build_then_checkpoint_gives_the_base_model_at_step_0(
        hf_model, hf_checkpoint_dir):
    hf = HFCheckpoint(hf_checkpoint_dir)
    layers = M.build_layers(hf.config, device="meta")
    lora = FineTuneLoRA(rank=4, alpha=8)
    lora(layers)
    torch.manual_seed(0)
    # chunks start at 0; the adapters are drawn while each chunk is built
    sharded = zero3_layers(layers, device="cpu",
                           config=ZeroConfig(dtype=torch.float32, chunk_numel=4096),
                           init_param=lora.init_param(lambda name, p: None))
    for layer in sharded:
        load_hf_layer(layer, hf)
    model = Zero3Sequential(sharded)
    ids = torch.randint(0, hf.config.n_vocab, (2, 9),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(ids).logits
        # fp32 logits, one forward pass
        torch.testing.assert_close(model(ids), expected, **tolerance.parity(
            torch.float32, terms=tolerance.neox_terms(
                hf.config, seq=ids.shape[1])))
    with model.runtime.gathered():
        a = layers[1].attention.query_key_value.lora_A.detach()
        b = layers[1].attention.query_key_value.lora_B.detach()
        assert 0 < a.abs().max() <= 1 / math.sqrt(hf.config.d_model)
        assert torch.count_nonzero(b) == 0


# ## Memory


def one_step_memory(ctx, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    layers = M.build_layers(small_config(), device="meta")
    lora = FineTuneLoRA(rank=4, alpha=8)
    count = lora(layers)
    sharded = zero3_layers(layers, device=ctx.device,
                           config=ZeroConfig(dtype=dtype, chunk_numel=3000, align=4),
                           init_param=lora.init_param(
                               M.init_parameter(small_config())))
    model = Zero3Sequential(sharded)
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-3)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten()).backward()
    optimizer.step()
    # plain tuples: the results travel between processes through `torch.save`
    return {"held": held_bytes(model, optimizer), "count": tuple(count),
            "stored": tuple(sharded_count(sharded))}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,dtype_name", [(2, "bfloat16"), (3, "float32")])
def test_memory_model_matches_the_bytes_held(world_size, dtype_name):
    param_bytes = 2 if dtype_name == "bfloat16" else 4
    # fp32 chunks: the shard is its own master, so Adam adds only the moments
    optimizer_bytes = 12 if param_bytes == 2 else 8
    for report in run_distributed(one_step_memory, world_size, dtype_name):
        stored = TrainableCount(*report["stored"])
        count = TrainableCount(*report["count"])
        # padding aside, the chunks hold exactly the formula's elements
        assert stored.trainable >= count.trainable
        assert stored.total - stored.trainable >= count.total - count.trainable
        exact = lora_model_states(stored, world_size, param_bytes=param_bytes,
                                  optimizer_bytes=optimizer_bytes)
        assert report["held"] == exact
        formula = lora_model_states(count, world_size, param_bytes=param_bytes,
                                    optimizer_bytes=optimizer_bytes)
        padding = (stored.total - count.total) * (param_bytes + 4 + optimizer_bytes)
        assert formula <= report["held"] <= formula + padding / world_size
        if param_bytes == 2:
            # the page's (2 Ψ_base + 18 Ψ_lora) / N_d, exactly, for the stored counts
            psi_base = stored.total - stored.trainable
            assert exact == (2 * psi_base + 18 * stored.trainable) // world_size


# ## fp32 parity with plain PyTorch and AdamW

STEPS = 5
ROWS_PER_RANK = 2
SEQ = 8
# The parity's tolerance (tests/tolerance.py): fp32 through `small_config`,
# forward and backward, with the 3 ranks' rows in the batch at most.
TERMS = tolerance.neox_terms(small_config(), seq=SEQ,
                             tokens=3 * ROWS_PER_RANK * SEQ, backward=True)
LOSS_TOLERANCE = tolerance.parity(torch.float32, terms=TERMS)
PARAM_TOLERANCE = tolerance.parity(torch.float32, terms=TERMS, steps=STEPS, lr=1e-2)
# Updates a little wrong, which the same tolerance must reject: the learning
# rate 0.1% too high, and the weight decay forgotten.
WRONG_UPDATES = {"lr x 1.001": (1e-2 * 1.001, 0.01), "no weight decay": (1e-2, 0.0)}


def reference_lora(reference: list[nn.Module], adapters: dict, scale: float):
    """The same maths with no engine and no `LoRALinear`: forward hooks add
    `scale · x Aᵀ Bᵀ` to each target's output."""
    params = []
    for layer in reference:
        if not isinstance(layer, M.TransformerLayer):
            continue
        for path in TARGETS.values():
            a, b = (nn.Parameter(adapters[(layer.layer_idx, path, m)].clone())
                    for m in ("lora_A", "lora_B"))
            params += [a, b]

            def hook(module, inputs, output, a=a, b=b):
                return output + scale * (inputs[0] @ a.T) @ b.T

            layer.get_submodule(path).register_forward_hook(hook)
    return params


def train_parity(ctx):
    torch.manual_seed(0)
    c = small_config()
    layers = M.build_layers(c)
    for layer in layers:
        # biases and norms away from 0 and 1, so each branch matters
        for name, p in layer.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.data.normal_(0.0, 0.1)
    # the references run on the rank's device, as the engine does: the parity
    # compares the engine with plain PyTorch, not one device's kernels with
    # another's
    base = [layer.to(ctx.device) for layer in copy.deepcopy(layers)]
    lora = FineTuneLoRA(rank=4, alpha=8)
    lora(layers)
    adapters = {(layer.layer_idx, path, m): getattr(layer.get_submodule(path), m)
                .detach().clone() for layer in layers
                if isinstance(layer, M.TransformerLayer)
                for path in TARGETS.values() for m in ("lora_A", "lora_B")}
    adapters = {key: value.to(ctx.device) for key, value in adapters.items()}
    # copies before any hook: a hook is shared by a deep copy, with its adapters
    wrong_models = {bug: nn.Sequential(*copy.deepcopy(base)).requires_grad_(False)
                    for bug in WRONG_UPDATES}
    reference = nn.Sequential(*base)
    reference.requires_grad_(False)
    ref_params = reference_lora(list(reference), adapters, lora.scale)
    model = Zero3Sequential(zero3_layers(
        layers, device=ctx.device,
        config=ZeroConfig(dtype=torch.float32, chunk_numel=2400, align=4)))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=1e-2, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01)
    # Two wrong references (see WRONG_UPDATES) that the tolerance must reject.
    wrong = {}
    for bug, (lr, weight_decay) in WRONG_UPDATES.items():
        wrong_params = reference_lora(list(wrong_models[bug]), adapters, lora.scale)
        wrong[bug] = (wrong_models[bug], wrong_params, torch.optim.AdamW(
            wrong_params, lr=lr, weight_decay=weight_decay))
    losses, ref_losses = [], []
    # one global batch, learnt by heart, so the loss must fall
    ids = torch.randint(0, c.n_vocab, (ROWS_PER_RANK * ctx.world_size, SEQ + 1),
                        generator=torch.Generator().manual_seed(100)).to(ctx.device)
    for _ in range(STEPS):
        mine = ids[ctx.rank * ROWS_PER_RANK:(ctx.rank + 1) * ROWS_PER_RANK]
        loss = F.cross_entropy(model(mine[:, :-1]).flatten(0, 1),
                               mine[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # the global mean: each rank's mean over equally many tokens
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
        ref_loss = F.cross_entropy(reference(ids[:, :-1]).flatten(0, 1),
                                   ids[:, 1:].flatten())
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())
        for wrong_model, _, wrong_optimizer in wrong.values():
            F.cross_entropy(wrong_model(ids[:, :-1]).flatten(0, 1),
                            ids[:, 1:].flatten()).backward()
            wrong_optimizer.step()
            wrong_optimizer.zero_grad()
    with model.runtime.gathered():
        ours = [getattr(layer.get_submodule(path), m).detach().clone()
                for layer in layers if isinstance(layer, M.TransformerLayer)
                for path in TARGETS.values() for m in ("lora_A", "lora_B")]
        base_diff = max((p - q).abs().max().item() for layer, ref in
                        zip(layers, base) for (name, p), q in
                        zip(((n, p) for n, p in layer.named_parameters()
                             if "lora_" not in n), ref.parameters()))
    return {"losses": losses, "ref_losses": ref_losses, "ours": ours,
            "theirs": [p.detach() for p in ref_params], "base_diff": base_diff,
            "wrong": {bug: [p.detach() for p in params]
                      for bug, (_, params, _) in wrong.items()}}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parity_with_plain_lora_and_adamw(world_size):
    for report in run_distributed(train_parity, world_size):
        torch.testing.assert_close(report["losses"], report["ref_losses"],
                                   **LOSS_TOLERANCE)
        # the loss moves: B leaves 0 and the model leaves the base model
        assert report["losses"][-1] < report["losses"][0]
        for ours, theirs in zip(report["ours"], report["theirs"], strict=True):
            torch.testing.assert_close(ours, theirs, **PARAM_TOLERANCE)
        # the tolerance still catches a real bug
        for bug, wrong in report["wrong"].items():
            assert not all(tolerance.within(ours, theirs, PARAM_TOLERANCE)
                           for ours, theirs in zip(report["ours"], wrong)), bug
        assert torch.count_nonzero(report["ours"][1]) > 0
        # the base weights never change
        assert report["base_diff"] == 0.0


def test_adapters_cost_under_a_tenth_of_the_base_from_width_1024():
    # the page's bound 96 / d at r = 8 on all four projections
    for preset in (M.pythia_410m, M.pythia_1_4b):
        c = preset()
        count = FineTuneLoRA(rank=8)(M.build_layers(c, device="meta"))
        assert count.trainable == c.n_layers * 128 * c.d_model
        base = count.total - count.trainable
        ratio = 18 * count.trainable / (2 * base)
        assert ratio < 96 / c.d_model <= 0.1


# ## Sharded checkpoints


def meta_lora_model(ctx):
    """Built on meta and initialised chunk by chunk, as the fine-tune builds it."""
    torch.manual_seed(0)
    layers = M.build_layers(small_config(), device="meta")
    lora = FineTuneLoRA(rank=4, alpha=8, targets=("query_key_value", "dense_4h_to_h"))
    lora(layers)
    sharded = zero3_layers(layers, device=ctx.device,
                           config=ZeroConfig(dtype=torch.float32, chunk_numel=2400),
                           init_param=lora.init_param(
                               M.init_parameter(small_config())))
    model = Zero3Sequential(sharded)
    return model, AdamFP16(model.get_trainable_chunk(), lr=1e-2)


def steps(model, optimizer, ctx, n: int) -> list[float]:
    ids = torch.randint(0, 97, (2 * ctx.world_size, SEQ + 1),
                        generator=torch.Generator().manual_seed(5))
    mine = ids[2 * ctx.rank:2 * ctx.rank + 2].to(ctx.device)
    losses = []
    for _ in range(n):
        loss = F.cross_entropy(model(mine[:, :-1]).flatten(0, 1),
                               mine[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_and_resume(ctx, path: str):
    model, optimizer = meta_lora_model(ctx)
    first = steps(model, optimizer, ctx, 2)
    save_checkpoint(path, model, optimizer)
    straight = steps(model, optimizer, ctx, 2)
    model, optimizer = meta_lora_model(ctx)
    load_checkpoint(path, model, optimizer)
    return first, straight, steps(model, optimizer, ctx, 2)


@pytest.mark.distributed
def test_a_lora_run_resumes_from_a_sharded_checkpoint_bit_for_bit(tmp_path):
    for first, straight, resumed in run_distributed(save_and_resume, 2,
                                                    str(tmp_path / "ckpt")):
        assert straight == resumed
        # the fresh model's own start would repeat `first`
        assert resumed[0] < first[-1]
