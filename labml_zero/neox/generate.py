r"""
---
title: Sampling text
summary: Greedy and top-k sampling from any callable that maps token ids to
  logits, to sanity-check loaded and fine-tuned weights.
---

# Sampling text

A quick look at what a model writes is the cheapest check that a checkpoint
loaded correctly (a wrong QKV layout still gives finite losses but produces
gibberish). The model is any callable `ids [1, T] -> logits [1, T, V]`: our
`nn.Sequential` of layers, a ZeRO-sharded model, or a Hugging Face forward.

Each new token is greedy, $x_{t+1} = \arg\max_v \ell_v$, or drawn from the top
$k$ logits (see `generate_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tokenizers import Tokenizer

from labml_zero.neox.tokenizer import decode, encode, vocab_size

__all__ = ["Sampling", "generate", "generate_ids"]

# Any forward from token ids `[1, T]` to logits `[1, T, V]`.
Model = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sampling:
    """
    ## How to pick each next token
    """

    top_k: int | None = None
    """`None`: greedy. Otherwise sample among the `top_k` most likely ids."""
    temperature: float = 1.0
    r"""$\tau$; ignored by greedy decoding."""
    max_context: int = 2048
    """Longest prefix fed to the model (the model's `max_position`)."""

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"Sampling.top_k must be >= 1 or None, "
                             f"got {self.top_k}")
        if self.temperature <= 0:
            raise ValueError(f"Sampling.temperature must be > 0, "
                             f"got {self.temperature}")
        if self.max_context < 1:
            raise ValueError(f"Sampling.max_context must be >= 1, "
                             f"got {self.max_context}")


@torch.no_grad()
def generate_ids(model: Model, ids: list[int], *, n_tokens: int, n_vocab: int,
                 sampling: Sampling = Sampling(),
                 generator: torch.Generator | None = None,
                 device: str | torch.device = "cpu") -> list[int]:
    """
    ### Extend `ids` by `n_tokens` tokens

    `n_vocab` is the number of valid ids (the tokenizer's size); `generator`
    seeds top-$k$ sampling (a CPU generator: sampling runs on the host). Batch
    size one, no stop tokens other than the length limit; when the text
    outgrows `max_context`, only the last `max_context` tokens are fed, as a
    sliding window.

    Each new token re-runs the whole prefix (no KV cache): $O(n^2)$ forward
    tokens for $n$ new ones, negligible for the few dozen tokens of a sanity
    check. Only ids below `n_vocab` are candidates: the rows the embedding is
    padded with were never trained and decode to nothing.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if not ids:
        raise ValueError("generate needs a non-empty prompt")
    out = list(ids)
    for _ in range(n_tokens):
        x = torch.tensor([out[-sampling.max_context:]], dtype=torch.long,
                         device=device)  # [1, T]
        logits = model(x)[0, -1, :n_vocab].float()  # [V] fp32, last position
        # **Greedy**: $x_{t+1} = \arg\max_v \ell_v$. Deterministic.
        if sampling.top_k is None:
            # host sync: .item(); the next step needs the id on the host anyway.
            out.append(int(logits.argmax().item()))
            continue
        # **Top-k**: keep the $k$ largest logits, sample from
        # $\operatorname{softmax}(\ell / \tau)$ over them with the caller's
        # `torch.Generator`, so a seed fixes the text.
        values, indices = logits.topk(min(sampling.top_k, n_vocab))  # [k], [k]
        # [k] fp32 on the host, so a CPU generator works for any model device.
        probs = torch.softmax(values / sampling.temperature, dim=-1).cpu()
        choice = torch.multinomial(probs, 1, generator=generator)  # [1]
        out.append(int(indices.cpu()[choice].item()))
    return out


def generate(model: Model, tokenizer: Tokenizer, prompt: str, *, n_tokens: int,
             sampling: Sampling = Sampling(),
             generator: torch.Generator | None = None,
             device: str | torch.device = "cpu") -> str:
    """
    ### Continue `prompt`; returns only the new text
    """
    prompt_ids = encode(tokenizer, prompt)
    ids = generate_ids(model, prompt_ids, n_tokens=n_tokens,
                       n_vocab=vocab_size(tokenizer), sampling=sampling,
                       generator=generator, device=device)
    return decode(tokenizer, ids[len(prompt_ids):])
