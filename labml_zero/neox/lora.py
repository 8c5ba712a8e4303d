r"""
---
title: LoRA for GPT-NeoX
summary: Low-rank adapters on GPT-NeoX's four projections; the base weights stay
  frozen in two-byte chunks and only the adapters carry gradients and Adam state.
---

# LoRA for GPT-NeoX

[LoRA](../layers/lora.html) freezes a pretrained weight $W$ and learns
$\Delta W = \frac{\alpha}{r} B A$ beside it,

$$y = W x + b + \frac{\alpha}{r} B A x,$$

training $r (d_\text{in} + d_\text{out})$ numbers instead of $d_\text{in} d_\text{out}$:
for GPT-NeoX's fused QKV projection of width $d$ ($d_\text{out} = 3d$), $4rd$
instead of $3d^2$. The adapted linear, PEFT's initialisation and the swap are
the shared page's; this one names GPT-NeoX's four projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

from torch import nn

# The shared mechanism, re-exported where GPT-NeoX's code and tests import it.
from labml_zero.layers.lora import (  # noqa: F401
    ADAPTER_NAMES,
    LoRA,
    LoRALinear,
    init_adapter,
    is_adapter,
    load_base_weights,
)
from labml_zero.neox.model import TransformerLayer
from labml_zero.planner.memory_model import OPTIMIZER_BYTES, zero_model_states
from labml_zero.zero3.trainable import TrainableCount

__all__ = ["LoRALinear", "FineTuneLoRA", "TARGETS", "ADAPTER_NAMES",
           "is_adapter", "init_adapter", "load_hf_layer", "base_layer",
           "sharded_count", "lora_model_states"]

# ## GPT-NeoX's targets
#
# PEFT's name of each projection `FineTuneLoRA` may adapt -> its path inside a
# `TransformerLayer`.
TARGETS = {
    "query_key_value": "attention.query_key_value",
    "dense": "attention.dense",
    "dense_h_to_4h": "mlp.dense_h_to_4h",
    "dense_4h_to_h": "mlp.dense_4h_to_h",
}


@dataclass(frozen=True)
class FineTuneLoRA(LoRA):
    r"""
    ## Adapt the chosen projections of every transformer layer

    [`LoRA`](../layers/lora.html) on `TransformerLayer`s: any non-empty subset
    of `query_key_value`, `dense` (attention output), `dense_h_to_4h`,
    `dense_4h_to_h`; default all four.
    """

    TARGETS: ClassVar[dict[str, str]] = TARGETS
    BLOCK: ClassVar[type[nn.Module]] = TransformerLayer


# ## Loading the base weights


def base_layer(module: nn.Module) -> nn.Module:
    """
    #### The layer as the checkpoint knows it

    A transformer layer with adapters has `lora_A`/`lora_B` entries that no
    Hugging Face checkpoint has; its twin without them, on the meta device
    (nothing allocated), has exactly the checkpoint's names and shapes. Other
    layers are returned as they are.
    """
    if isinstance(module, TransformerLayer):
        return TransformerLayer(module.config, module.layer_idx, device="meta")
    return module


def load_hf_layer(layer, checkpoint) -> None:
    """
    ### Load a sharded layer's base weights from a Hugging Face checkpoint

    `layer` is a `Zero3Layer`, with or without adapters; `checkpoint` an
    `HFCheckpoint` or a `NeoX20BCheckpoint` (anything with `layer_state_dict`),
    read for the layer's twin without adapters (`base_layer`).
    """
    # [one layer] on the host, shapes checked before any tensor is read
    load_base_weights(layer, checkpoint.layer_state_dict(base_layer(layer.module)))


# ## Memory
#
# The engine packs trainable and frozen parameters into different chunks (see
# [chunk layout](../zero3/chunk_layout.html)). A frozen chunk has only its
# two-byte (bf16 or fp16) shard: no gradient, no fp32 master, no Adam moments. So
# with $\Psi_\text{base}$ frozen elements (every base weight, the embedding and readout
# included) and $\Psi_\text{lora}$ adapter elements, the model states of a rank are
#
# $$M = \frac{2\,\Psi_\text{base} + (2 + 4 + 12)\,\Psi_\text{lora}}{N_d}$$
#
# bytes (tested: tests/neox/test_lora.py::test_memory_model_matches_the_bytes_held):
# the adapters' two-byte shard, their fp32 gradient shard (4 bytes, the reduce
# dtype's), and `AdamFP16`'s fp32 master and two moments ($K = 4 + 4 + 4$; with
# fp32 chunks the shard is its own master, so $p = 4$ and $K = 4 + 4$). Padding
# costs what the elements of its chunk cost; `lora_model_states` is this formula
# and `sharded_count` counts the padding in.
#
# The adapters are small beside the base: on all four projections a layer has
# $r (4d + 2d + 5d + 5d)$ adapter elements against the $(3 + 1 + 4 + 4) d^2$ of
# its frozen matrices, so their bytes are a share of order $r / d$ of the
# base's; at $r = 8$ it is under a tenth from width $d = 1024$ (tested:
# tests/neox/test_lora.py::test_adapters_cost_under_a_tenth_of_the_base_from_width_1024)
# on. A LoRA fine-tune costs about what holding the two-byte model costs.
#
# Its activations are another matter: each adapter's $A$ keeps its input for
# $\partial L / \partial A$, as a trained $W$ would, and its $B$ keeps
# $A x$ `[n, r]` ([activation memory](activation_memory.html) counts both).


def sharded_count(layers: Sequence) -> TrainableCount:
    """
    #### Elements in the chunks of sharded layers, padding included

    `layers` are `Zero3Layer`s. Frozen chunks hold the base, trainable chunks
    the adapters; every chunk's size is a multiple of $N_d$, so these totals
    over $N_d$ are exactly what each rank stores.
    """
    trainable = sum(layer.layout.total_numel(trainable=True) for layer in layers)
    total = sum(layer.layout.total_numel() for layer in layers)
    return TrainableCount(trainable, total)


def lora_model_states(count: TrainableCount, world_size: int, *,
                      param_bytes: int = 2, grad_bytes: int = 4,
                      optimizer_bytes: int = OPTIMIZER_BYTES) -> int:
    r"""
    ## Model-state bytes per rank of a LoRA fine-tune

    $$\frac{p\,\Psi_\text{base} + (p + g + K)\,\Psi_\text{lora}}{N_d}$$

    with $p = 2$ (two-byte chunks), $g = 4$ (fp32 gradient shards) and
    $K$ the [state layout](../zero3/state_layout.html)'s bytes per element
    (`OPTIMIZER_BYTES`: `AdamFP16`'s fp32 master and moments) by default.

    * `count` is what `FineTuneLoRA` returns ($\Psi_\text{lora}$ trainable of
      $\Psi_\text{base} + \Psi_\text{lora}$: the formula), or `sharded_count` of the
      sharded layers (what they store, padding included).
    * With fp32 chunks ($p = 4$) the engine uses the parameter shard as the
      master, so pass placement's `device_optimizer_bytes(4)`.
    """
    return zero_model_states(count.trainable, count.total - count.trainable,
                             world_size,
                             param_bytes=param_bytes, grad_bytes=grad_bytes,
                             optimizer_bytes=optimizer_bytes)
