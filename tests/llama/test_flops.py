"""`labml_zero/llama/flops.py` against independent counts: PyTorch's FLOP
counter on a forward and backward pass and the parameters of the built model
(what a layer saves is tests/llama/test_activation_memory.py's)."""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from labml_zero.llama.config import LlamaConfig, llama_3_1_8b
from labml_zero.llama.flops import flops_per_token, matmul_parameters
from labml_zero.llama.model import LlamaChain, build_layers

# GQA with odd sizes; the same with as many key-value heads as query heads;
# tied, with Qwen's biases and a head width that is not d / n_h.
GQA = LlamaConfig(n_vocab=97, d_model=48, n_heads=6, n_kv_heads=2, n_layers=2,
                  d_ff=100)
CONFIGS = {"gqa": GQA, "mha": dataclasses.replace(GQA, n_kv_heads=6),
           "tied_bias": dataclasses.replace(GQA, tie_embeddings=True,
                                            qkv_bias=True, head_dim=10)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_flops_per_token_is_the_flop_counter(name):
    config = CONFIGS[name]
    torch.manual_seed(0)
    model = LlamaChain(*build_layers(config))
    B, T = 2, 11
    ids = torch.randint(0, config.n_vocab, (B, T))
    # PyTorch's math attention: batched products the counter sees (it has no
    # formula for the CPU flash kernel), each query head on a copied K and V.
    with FlopCounterMode(display=False) as counter, \
            sdpa_kernel(SDPBackend.MATH):
        model(ids, ids).backward()
    assert counter.get_total_flops() == B * T * flops_per_token(config, T)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matmul_parameters_are_the_linear_weights(name):
    """Every `nn.Linear` weight of the built model, the tied readout included
    (it multiplies, though it is the embedding's parameter)."""
    config = CONFIGS[name]
    layers = build_layers(config, device="meta")
    linear = [m.weight for layer in layers for m in layer.modules()
              if isinstance(m, torch.nn.Linear)]
    assert matmul_parameters(config) == sum(w.numel() for w in linear)


def test_gqa_saves_the_kv_projections_share():
    """Llama-3.1-8B: 8 key-value heads for 32 query heads."""
    config = llama_3_1_8b()
    mha = dataclasses.replace(config, n_kv_heads=config.n_heads)
    d, d_h = config.d_model, config.head_width
    saved = 2 * d * (config.n_heads - config.n_kv_heads) * d_h * config.n_layers
    assert matmul_parameters(mha) - matmul_parameters(config) == saved
