r"""
---
title: Llama FLOPs and activations
summary: A Llama-family model's training FLOPs per token, with grouped-query
  attention's smaller K and V projections counted, and the bytes one layer
  keeps for its backward pass.
---

# Llama FLOPs and activations

Two numbers the job needs of a model: its FLOPs per token, for the model
FLOPs utilisation (MFU), and the bytes a layer keeps for its backward pass,
for the memory budget. Both follow from the shapes alone.

"""

from __future__ import annotations

from labml_zero.llama.config import LlamaConfig
from labml_zero.neox.kernels import plain_loss_bytes_per_row

__all__ = ["matmul_parameters", "flops_per_token", "activation_bytes",
           "activation_memory"]


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
    d, d_h, d_ff = config.d_model, config.head_width, config.d_ff
    attention = 2 * d * config.n_heads * d_h + 2 * d * config.n_kv_heads * d_h
    return config.n_layers * (attention + 3 * d * d_ff) + config.n_vocab * d


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


def activation_bytes(config: LlamaConfig, tokens: int, *, dtype_bytes: int = 2
                     ) -> int:
    r"""
    ### Bytes one layer keeps for its backward pass, for `tokens` tokens

    Per token, with $p$ = `dtype_bytes`, for the plain model with no
    activation checkpointing and an attention kernel that keeps its
    log-sum-exp rather than its $T \times T$ probabilities (flash-style
    kernels, CPU and CUDA; PyTorch's math fallback keeps the square):

    * each of the two RMSNorms keeps its input in fp32 (a copy, or the input
      itself when it is fp32), $4d$; the $\frac{1}{\mathrm{rms}}$ factor, 4;
      the normalised value and its product with the weight, the input of the
      next products, $2pd$;
    * attention keeps q and k after their rotation and v, $p (n_h + 2
      n_{kv}) d_h$, its output, $p\, n_h d_h$ (also the input of $W_o$, a
      view of it), and the softmax's log-sum-exp in fp32, $4 n_h$. The
      rotation multiplies by tables that need no gradient, so it keeps only
      the tables, once for all layers, not q and k before it;
    * SwiGLU keeps the gate's output, its SiLU, the up projection's output
      and their product, $4 p\, d_{ff}$.

    GQA's smaller K and V heads are $2 p\, n_{kv} d_h$ of it, against
    $2 p\, n_h d_h$ without grouping.
    """
    d, d_h, p = config.d_model, config.head_width, dtype_bytes
    norms = 2 * (4 * d + 4 + 2 * p * d)
    attention = (p * (2 * config.n_heads + 2 * config.n_kv_heads) * d_h
                 + 4 * config.n_heads)
    mlp = 4 * p * config.d_ff
    return tokens * (norms + attention + mlp)


def activation_memory(config: LlamaConfig, *, batch: int, seq: int,
                      finetune: str = "all", checkpointing: bool = False,
                      kernels=None) -> int:
    r"""
    ### The whole model's activations when the last backward pass starts

    Every layer's saved tensors (`activation_bytes`, plain kernels), or,
    recomputed, every layer's bf16 input and one layer's saved tensors; then
    the plain readout's logits and loss (`plain_loss_bytes_per_row` a token),
    none with the chunked loss. An estimate: the fused SwiGLU and RMSNorm save
    less than counted, and the fine-tuner is not yet counted.
    """
    tokens = batch * seq
    one_layer = activation_bytes(config, tokens)
    if checkpointing:
        body = config.n_layers * tokens * config.d_model * 2 + one_layer
    else:
        body = config.n_layers * one_layer
    chunked_loss = kernels is not None and kernels.loss
    readout = 0 if chunked_loss else tokens * plain_loss_bytes_per_row(config.n_vocab)
    return body + readout
