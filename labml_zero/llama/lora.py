r"""
---
title: LoRA for the Llama family
summary: Low-rank adapters on the seven projections of each decoder layer,
  the shared adapted linear reused; the merged model and PEFT's adapter files
  for LlamaForCausalLM, Qwen2 and Mistral.
---

# LoRA for the Llama family

The same update as [GPT-NeoX's LoRA](../neox/lora.html), on a layer with
seven projections instead of four:

$$y = W x + \frac{\alpha}{r} B A x, \qquad
W \in \{W_q, W_k, W_v, W_o, W_\text{gate}, W_\text{up}, W_\text{down}\},$$

each adapted matrix of $d_\text{out} \times d_\text{in}$ gaining
$r(d_\text{in} + d_\text{out})$ trainable numbers. The adapted linear and the
swap are [the shared LoRA page's](../layers/lora.html), the merge and PEFT's
files [the PEFT adapter's](../hf/peft_adapter.html); this page names the
targets and writes the merged model and the adapter alone.

## Limitations

* As [the shared page's](../layers/lora.html): no dropout, rsLoRA or DoRA;
  the embedding and readout cannot be adapted.
* Biases (Qwen2's q, k, v) stay frozen and are not in the adapter file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterable, Sequence

import torch
from torch import nn

from labml_zero.hf.peft_adapter import merged, save_layers_adapter
from labml_zero.layers.lora import LoRA
from labml_zero.llama.config import LlamaConfig
from labml_zero.llama.hf_export import save_llama_checkpoint
from labml_zero.llama.model import DecoderLayer, hf_prefix

__all__ = ["LlamaLoRA", "TARGETS", "base_layer", "save_merged_llama",
           "save_llama_adapter"]

# PEFT's name of each target (the last part of the module's name in
# `LlamaForCausalLM`, which PEFT matches) -> its path inside a `DecoderLayer`.
TARGETS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


@dataclass(frozen=True)
class LlamaLoRA(LoRA):
    r"""
    ## Adapt the chosen projections of every decoder layer

    [`LoRA`](../layers/lora.html) on `DecoderLayer`s: any non-empty subset of
    `TARGETS`; default all seven.

    ### Default targets: all seven

    PEFT's own default for Llama is `q_proj, v_proj` only (the LoRA paper's
    choice for GPT-3). The QLoRA paper (Dettmers et al.) found that adapting
    *every* linear layer is what matches full fine-tuning, and the cost stays
    small: per layer $r(2d + 2(n_{kv} d_h + d) + 2 n_h d_h + 3(d + d_{ff}))$
    numbers against the frozen $d(2 n_h d_h + 2 n_{kv} d_h) + 3 d\, d_{ff}$.
    So the default is all seven, as GPT-NeoX's is all four;
    `targets=('q_proj', 'v_proj')` gives PEFT's.
    """

    TARGETS: ClassVar[dict[str, str]] = TARGETS
    BLOCK: ClassVar[type[nn.Module]] = DecoderLayer


def base_layer(module: nn.Module) -> nn.Module:
    """
    #### The layer as the checkpoint knows it

    A decoder layer with adapters has `lora_A`/`lora_B` entries no Hugging
    Face checkpoint has; its twin on the meta device has exactly the
    checkpoint's names and shapes. Other layers are returned as they are.
    """
    if isinstance(module, DecoderLayer):
        return DecoderLayer(module.config, module.layer_idx,
                            module.self_attn.rotary, device="meta")
    return module


def save_merged_llama(out_dir: str | os.PathLike, config: LlamaConfig,
                      tensors: Iterable[tuple[str, torch.Tensor]],
                      lora: LlamaLoRA, **options) -> Path:
    r"""
    ### The merged model: $W' = W + \frac{\alpha}{r} B A$, then the writer

    `tensors` yields `(hf_name, tensor)` with the adapters
    (`hf_named_tensors(layers)`, or a sharded model's gathered tensors);
    `merged` holds each adapted $W$ until its $A$ and $B$ have come
    and rounds once, to the export's dtype; [the family's
    writer](hf_export.html) takes the rest. `options` are
    `save_llama_checkpoint`'s.
    """
    return save_llama_checkpoint(out_dir, config,
                                 merged(tensors, lora, dtype=options.get("dtype")),
                                 **options)


def save_llama_adapter(out_dir: str | os.PathLike, layers: Sequence[nn.Module],
                       lora: LlamaLoRA, *, base_model_name_or_path: str | None = None,
                       overwrite: bool = False) -> Path:
    """
    ### The adapter alone, in PEFT's format

    `layers` are unsharded layers with adapters; each $A$ and $B$ is written
    in its own dtype under PEFT's key for `LlamaForCausalLM`,
    `base_model.model.model.layers.`$i$`.self_attn.q_proj.lora_A.weight`.
    With only some layers built, `adapter_config.json`'s
    `layers_to_transform` names them.
    """
    return save_layers_adapter(out_dir, layers, lora, hf_prefix=hf_prefix,
                               base_model_name_or_path=base_model_name_or_path,
                               overwrite=overwrite)
