"""A Llama-family model under `shard_model` or `zero3_layers` at world sizes 2
and 3, with odd sizes (every chunk padded), trains as the unsharded model with
`torch.optim.AdamW`; a tied embedding lives in `shard_model`'s root unit, or in
`zero3_layers`' embedding layer, held gathered for the step."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from labml_zero.llama.config import LlamaConfig, RopeScaling
from labml_zero.llama.model import LlamaChain, build_layers
from labml_zero.optimizers.adam_fp16 import AdamFP16
from labml_zero.planner.sharding import shard_model, zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.shard import LocalShard
from tests import tolerance
from tests.distributed import run_distributed

STEPS = 5
ROWS_PER_RANK = 2
SEQ = 13
LR = 3e-3
# Odd everywhere: vocab 97, 6 query heads of 8 on 3 key-value heads, d_ff 77.
UNTIED = LlamaConfig(n_vocab=97, d_model=48, n_heads=6, n_kv_heads=3, n_layers=3,
                     d_ff=77, rope_theta=500000.0,
                     rope_scaling=RopeScaling(original_max_position=8),
                     max_position=64, init_std=0.1)
# Tied, as SmolLM2 and Llama 3.2. Without Qwen's k bias: its gradient nearly
# cancels (a bias shared by every key shifts each query's scores by one
# constant, which the softmax ignores, except for what the rotation turns), so
# rounding is a large part of it and Adam, which normalises the gradient,
# turns that into a large part of its update in any two programs, sharded or
# not. The biases' forward pass is tested against transformers' Qwen 2.
TIED = dataclasses.replace(UNTIED, tie_embeddings=True, rope_scaling=None)
CONFIGS = {"untied": UNTIED, "tied": TIED}


def llama_terms(config: LlamaConfig, *, seq: int, tokens: int) -> int:
    """`terms` (tests/tolerance.py) of the loss and the gradients: per layer the
    reductions of `tests/llama/test_model.py::llama_terms`, the final norm and
    the readout, the loss over the vocabulary and the tokens; the backward pass
    the same again, and each weight's gradient sums over the tokens."""
    d, d_h = config.d_model, config.head_width
    layer = 6 * d + d_h + seq + config.n_heads * d_h + config.d_ff
    forward = config.n_layers * layer + 2 * d + tokens + config.n_vocab
    return 2 * forward + tokens


def batch(step: int, rows: int, config: LlamaConfig):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, config.n_vocab, (rows, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def untie(chain: LlamaChain) -> LlamaChain:
    """The wrong program for a tied model: the readout a copy of the embedding,
    so each matrix learns from one use's gradient only."""
    readout = chain[-1].lm_head
    readout.weight = torch.nn.Parameter(readout.weight.detach().clone())
    return chain


def train_both(ctx, name: str, api: str = "generic"):
    """The sharded model and an unsharded copy, trained side by side; for a
    tied model also an untied copy, the wrong program the tolerance rejects."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    layers = build_layers(config)
    reference = LlamaChain(*copy.deepcopy(layers)).to(ctx.device)
    wrong = untie(copy.deepcopy(reference)) if config.tie_embeddings else None
    zero = ZeroConfig(dtype=torch.float32, chunk_numel=1000, align=4)
    if api == "generic":
        # Every layer a unit: a tied matrix, in two of them, goes to the root.
        model = shard_model(LlamaChain(*layers), layers, device=ctx.device,
                            config=zero)
    else:
        # The layer list: a tied matrix is the embedding layer's, held.
        model = Zero3Sequential(zero3_layers(layers, device=ctx.device,
                                             config=zero))
    optimizer = AdamFP16(model.get_trainable_chunk(), lr=LR, weight_decay=0.01)
    references = [(reference, torch.optim.AdamW(reference.parameters(), lr=LR,
                                                weight_decay=0.01))]
    if wrong is not None:
        references.append((wrong, torch.optim.AdamW(wrong.parameters(), lr=LR,
                                                    weight_decay=0.01)))
    initial = [p.detach().clone() for p in reference.parameters()]
    mine = slice(ctx.rank * ROWS_PER_RANK, (ctx.rank + 1) * ROWS_PER_RANK)
    report = {"losses": [], "ref_losses": [], "missing_grads": 0}
    for step in range(STEPS):
        x, y = (t.to(ctx.device) for t in batch(step, ROWS_PER_RANK * ctx.world_size,
                                                 config))
        loss = model(x[mine], y[mine])
        loss.backward()
        # The reference takes the same rows in the same micro-batches, one
        # after another: the full batch in one pass would sum each weight's
        # gradient over the tokens in another order, and where that sum nearly
        # cancels, Adam (which divides by the gradient's size) turns the
        # rounding into a visible update in any two programs, sharded or not.
        for net, net_optimizer in references:
            ref_loss = 0.0
            for r in range(ctx.world_size):
                rows = slice(r * ROWS_PER_RANK, (r + 1) * ROWS_PER_RANK)
                part = net(x[rows], y[rows]) / ctx.world_size
                part.backward()
                ref_loss += part.item()
            net_optimizer.step()
            net_optimizer.zero_grad()
            if net is reference:
                report["ref_losses"].append(ref_loss)
        report["missing_grads"] += sum(LocalShard.of(s).grad is None
                                       for s in model.get_trainable_chunk())
        report["losses"].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    with model.runtime.gathered():
        ours = [p.detach().clone() for p in LlamaChain(*layers).parameters()]
    theirs = [p.detach() for p in reference.parameters()]
    report["n_params"] = (len(ours), len(theirs))
    report["max_diff"] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    if wrong is not None:
        # the embedding first in both: the untied copy's extra readout is last
        report["wrong_diff"] = max((a - b).abs().max().item()
                                   for a, b in zip(ours, wrong.parameters()))
    report["moved"] = max((a - b).abs().max().item()
                          for a, b in zip(theirs, initial))
    # the matrix held for the whole step: the root's, or the held layers'
    held = ([c for c in model.layout.chunks_of_group(0)] if api == "generic" else
            [c for i, layer in enumerate(model.layers) if layer.held
             for c in model.layout.chunks_of_group(i)])
    report["held_numel"] = sum(s.numel for c in held for s in c.slots)
    report["readout_chunks"] = (len(model.layers[-1].chunks)
                                if api == "layers" else None)
    return report


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,name,api", [
    (2, "tied", "generic"), (3, "untied", "generic"),
    (2, "tied", "layers"), (3, "tied", "layers")])
def test_parity_with_unsharded_adamw(world_size, name, api):
    config = CONFIGS[name]
    tokens = ROWS_PER_RANK * world_size * SEQ
    terms = llama_terms(config, seq=SEQ, tokens=tokens)
    # parameters of size about 1 after STEPS updates (tests/tolerance.py)
    param_error = tolerance.max_error(tolerance.parity(
        torch.float32, terms=terms, steps=STEPS, lr=LR), 1.5)
    for report in run_distributed(train_both, world_size, name, api):
        assert report["missing_grads"] == 0
        assert report["n_params"][0] == report["n_params"][1]
        # the updates moved the weights far beyond the tolerance
        assert report["moved"] > 100 * param_error
        assert report["max_diff"] <= param_error, report["max_diff"]
        tied = config.n_vocab * config.d_model if config.tie_embeddings else 0
        if api == "generic":
            # the tied matrix, and only it, is the root unit's
            assert report["held_numel"] == tied
        else:
            # the embedding layer, its one matrix, is held; the readout
            # borrows it and has no chunks of its own
            assert report["held_numel"] == tied
            assert report["readout_chunks"] == 0
        if config.tie_embeddings:
            # one use's gradient per matrix fails the same tolerance
            assert report["wrong_diff"] > param_error, report["wrong_diff"]
