r"""
---
title: Llama fine-tuners
summary: The two fine-tuners the Llama family offers, by name: everything, or
  LoRA's adapters.
---

# Llama fine-tuners

A fine-tuner marks what trains. The Llama family offers two: `all`
(GPT-NeoX's [`FineTuneAll`](../neox/finetuners.html)) and `lora`
([`LlamaLoRA`](lora.html), on any of its targets). GPT-NeoX's `biases` and
`ffn` name GPT-NeoX's modules and are not offered here. The
[family](family.html) and the [activation count](activation_memory.html)
both ask this page, so they agree on what each name trains.
"""

from __future__ import annotations

from typing import Any, Callable

from labml_zero.llama.lora import LlamaLoRA
from labml_zero.neox.finetuners import FineTuneAll

__all__ = ["FINETUNERS", "finetuner"]

# The fine-tuners by name; `lora` takes `LlamaLoRA`'s fields as options.
FINETUNERS: dict[str, Callable[..., Any]] = {"all": FineTuneAll, "lora": LlamaLoRA}


def finetuner(name: str, **options: Any) -> Any:
    """
    ### The fine-tuner called `name`

    Refuses an unknown name, and options given to `all`, in one line, so a
    misspelt flag never trains something else.
    """
    if name not in FINETUNERS:
        raise ValueError(f"unknown fine-tuner {name!r} for the Llama family; "
                         f"expected one of {', '.join(FINETUNERS)}")
    if options and name != "lora":
        raise ValueError(f"fine-tuner {name!r} takes no options, got "
                         f"{', '.join(sorted(options))}")
    return FINETUNERS[name](**options)
