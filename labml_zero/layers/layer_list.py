r"""
---
title: A model as a list of layers
summary: What every family's list of layers shares: which blocks to build,
  Hugging Face's initialisation, the chain with the loss at its end, and the
  parameter count with a tied matrix once.
---

# A model as a list of layers

The engine shards and gathers one *layer* at a time, so every family's model
is a list,

$$[\text{Embedding}, \text{Block}_i \text{ for } i \in I, \text{FinalNorm},
\text{Readout}],$$

named as Hugging Face names it; the pieces that do not depend on the
architecture are here.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

__all__ = ["layer_indices", "token_table", "init_like_hf", "LayerChain", "count_parameters"]


def layer_indices(n_layers: int, filter_layers: Iterable[int] | None) -> list[int]:
    r"""
    ## The indices of the blocks to build

    All $L$ = `n_layers` without a filter; else the filter's, sorted, each
    once, refused (one line) if outside $0 \ldots L - 1$.
    """
    if filter_layers is None:
        return list(range(n_layers))
    indices = sorted(set(filter_layers))
    bad = [i for i in indices if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"filter_layers {bad} out of range: the model has "
                         f"{n_layers} layers (0..{n_layers - 1})")
    return indices


def token_table(n_vocab: int, d_model: int, *, device=None, dtype=None) -> nn.Embedding:
    """
    ## The token embedding's table

    `nn.Embedding` draws its weight from a normal distribution as it is made.
    On the meta device there are no values to draw, yet PyTorch's meta
    `normal_` is a reference implementation whose first call imports
    `torch._dynamo`, seconds of start-up for every process that lays a model
    out on meta (the plan, the preflight, the sharded build). There the table
    is made empty; elsewhere as PyTorch makes it, and the family's
    `reset_parameters` sets the values either way.
    """
    if device is not None and torch.device(device).type == "meta":
        weight = torch.empty(n_vocab, d_model, device="meta", dtype=dtype)
        return nn.Embedding(n_vocab, d_model, _weight=weight)
    return nn.Embedding(n_vocab, d_model, device=device, dtype=dtype)


def init_like_hf(module: nn.Module, std: float,
                 norms: tuple[type[nn.Module], ...] = (nn.LayerNorm,)) -> None:
    r"""
    ## Hugging Face's initialisation

    $\mathcal{N}(0, \sigma^2)$ for linear and embedding weights, with $\sigma$ the
    config's `init_std` (Hugging Face's `initializer_range`), zero biases, and
    for each norm of the classes `norms` a unit weight and a zero bias (where
    it has one; RMSNorm has none). Under `torch.no_grad` so it may run on leaf
    parameters that require grad.
    """
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
            elif isinstance(m, norms):
                m.weight.fill_(1.0)
            else:
                continue
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()


class LayerChain(nn.Sequential):
    """
    ## The layers in a chain, with the loss at its end

    `LayerChain(*layers)(ids)` is the logits, as `nn.Sequential` gives;
    `(ids, targets)` hands the targets to the last layer, the readout, which
    returns the loss. The engines' wrappers (DDP, FSDP2, `Zero3Sequential`
    with its own `forward(x, *last_args)`) pass both through.
    """

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None):
        *body, last = self
        x = ids
        for layer in body:
            x = layer(x)
        return last(x) if targets is None else last(x, targets)


def count_parameters(layers: Iterable[nn.Module]) -> int:
    r"""
    ## Parameter count $\Psi$

    The model's parameters in elements, a matrix tied into two layers once
    (works on the meta device).
    """
    seen = {id(p): p.numel() for layer in layers for p in layer.parameters()}
    return sum(seen.values())
