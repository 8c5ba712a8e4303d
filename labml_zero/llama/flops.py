r"""
---
title: Llama FLOPs
summary: A Llama-family model's training FLOPs per token, with grouped-query
  attention's smaller K and V projections counted.
---

# Llama FLOPs

The number the job needs of a model for its model FLOPs utilisation (MFU):
the FLOPs a token costs, forward and backward, which follow from the shapes
alone. The bytes a model keeps for its backward pass are the next page's,
[activation memory](activation_memory.html).
"""

from __future__ import annotations

from labml_zero.llama.config import LlamaConfig

__all__ = ["layer_linears", "matmul_parameters", "flops_per_token"]


def layer_linears(config: LlamaConfig) -> tuple[tuple[int, int], ...]:
    r"""$(d_\text{in}, d_\text{out})$ of each product of a decoder layer:
    $W_q$, $W_k$, $W_v$, $W_o$, the gate, up and down projections."""
    d, d_ff = config.d_model, config.d_ff
    q, kv = config.n_heads * config.head_width, config.n_kv_heads * config.head_width
    return ((d, q), (d, kv), (d, kv), (q, d), (d, d_ff), (d, d_ff), (d_ff, d))


def matmul_parameters(config: LlamaConfig) -> int:
    r"""
    ### $L\, N_\text{layer} + V d$: the weights that multiply activations

    The products of a layer have

    $$N_\text{layer} = \underbrace{2 d\, n_h d_h}_{W_q,\ W_o}
      + \underbrace{2 d\, n_{kv} d_h}_{W_k,\ W_v} + 3 d\, d_{ff},$$

    so grouped-query attention saves $2 d (n_h - n_{kv}) d_h$ per layer
    against multi-head attention; the readout adds $V d$, tied or not (the
    embedding is a lookup, no product).
    """
    layer = sum(d_in * d_out for d_in, d_out in layer_linears(config))
    return config.n_layers * layer + config.n_vocab * config.d_model


def flops_per_token(config: LlamaConfig, seq: int) -> int:
    r"""
    ### Training FLOPs a token, forward and backward, at sequence length $T$

    A product with $N$ weights costs $2N$ FLOPs a token forward and $4N$
    backward (the gradients of its input and of its weight). Attention itself
    multiplies every query head with $T$ keys and $T$ values, $4 n_h d_h T$
    FLOPs a token forward, whatever $n_{kv}$ is, since each query head still
    reads a whole key and value head:

    $$C = 6 \left(L\, N_\text{layer} + V d\right) + 12\, L\, n_h d_h T$$
    (tested: tests/llama/test_flops.py::test_flops_per_token_is_the_flop_counter).

    The attention term counts the whole $T \times T$ square, as PaLM's
    ([Chowdhery et al.](https://arxiv.org/abs/2204.02311), appendix B) and
    `torch.utils.flop_counter` do; a causal kernel skips about half of it.
    The plain model is counted, no fused kernels; biases and the element-wise
    passes (norms, SiLU, rotation, softmax) are $O(d)$ a token and left out.
    """
    attention = 12 * config.n_layers * config.n_heads * config.head_width * seq
    return 6 * matmul_parameters(config) + attention
