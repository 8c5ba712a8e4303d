r"""
---
title: Fine-tuners
summary: Choose which GPT-NeoX parameters train (biases only, the MLPs, all, or
  low-rank adapters) by setting requires_grad before the ZeRO engine wraps the
  layers.
---

# Fine-tuners

A fine-tuner marks parameters trainable or frozen. It must run **before** the
engine shards the layers, because the engine packs trainable and frozen
parameters into different chunks (see [chunk layout](../zero3/chunk_layout.html)):
only trainable chunks carry gradients, fp32 masters and Adam moments, so with
$\Psi_t$ trainable parameters out of $\Psi$ the model states cost
$\frac{2\Psi + (4 + K)\Psi_t}{N_d}$ bytes per rank (bf16 parameters, the
engine's fp32 gradient shard) instead of $\frac{(2 + 4 + K)\Psi}{N_d}$.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from labml_zero.neox.lora import FineTuneLoRA
from labml_zero.neox.model import TransformerLayer
from labml_zero.zero3.trainable import TrainableCount, mark_trainable, train_all

__all__ = ["FineTuneBiases", "FineTuneFFN", "FineTuneAll", "FINETUNERS", "finetuner"]

# The names `finetuner` knows; `'lora'` takes options.
FINETUNERS = ("biases", "ffn", "all", "lora")


class FineTuneBiases:
    r"""
    ## Train the three bias vectors of each transformer layer

    The biases of the QKV projection, the attention output and the MLP's first
    linear, as in labml-nn's GPT-NeoX fine-tune (a BitFit-style tune:
    $3d + d + 4d$ per layer,
    {{py: 100 * finetuners.finetuner('biases')(neox_model.build_layers(
        neox_model.gpt_neox_20b(), device='meta')).trainable / (
        neox_model.count_parameters(neox_model.build_layers(
        neox_model.gpt_neox_20b(), device='meta'))) | .3f}}% of GPT-NeoX-20B).
    """

    name = "biases"
    BIASES = ("attention.query_key_value.bias", "attention.dense.bias",
              "mlp.dense_h_to_4h.bias")

    def __call__(self, layers: Sequence[nn.Module]) -> TrainableCount:
        return mark_trainable(layers, lambda layer, name: isinstance(
            layer, TransformerLayer) and name in self.BIASES)


class FineTuneFFN:
    """## Train the MLP (weights and biases) of each transformer layer"""

    name = "ffn"

    def __call__(self, layers: Sequence[nn.Module]) -> TrainableCount:
        return mark_trainable(layers, lambda layer, name: isinstance(
            layer, TransformerLayer) and name.startswith("mlp."))


class FineTuneAll:
    """## Train every parameter"""

    name = "all"

    def __call__(self, layers: Sequence[nn.Module]) -> TrainableCount:
        return train_all(layers)


def finetuner(name: str, **options: Any
              ) -> FineTuneBiases | FineTuneFFN | FineTuneAll | FineTuneLoRA:
    """
    ### The fine-tuner called `name`: `'biases'`, `'ffn'`, `'all'` or `'lora'`

    Four, each built on the engine's [`mark_trainable`](../zero3/trainable.html):
    the biases, the MLPs, everything, and [LoRA](lora.html)'s low-rank adapters.
    The first three choose by parameter name; only `FineTuneLoRA` adds
    parameters. The embedding, final norm and readout are frozen by all but
    `FineTuneAll`. `options` are `FineTuneLoRA`'s fields (`rank`, `alpha`,
    `targets`); the other fine-tuners take none. Callers that take a name (the job, the
    benchmark) resolve it here: the assembly takes the fine-tuner itself.
    """
    if name == "lora":
        return FineTuneLoRA(**options)
    if name not in FINETUNERS:
        raise ValueError(f"unknown fine-tuner {name!r}; expected one of "
                         f"{', '.join(FINETUNERS)}")
    if options:
        raise ValueError(f"fine-tuner {name!r} takes no options, got "
                         f"{', '.join(sorted(options))}")
    match name:
        case "biases":
            return FineTuneBiases()
        case "ffn":
            return FineTuneFFN()
    return FineTuneAll()
