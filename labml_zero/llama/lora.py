r"""
---
title: LoRA for the Llama family
summary: Low-rank adapters on the seven projections of each decoder layer,
  GPT-NeoX's adapted linear reused; the merged model and PEFT's adapter files
  for LlamaForCausalLM, Qwen2 and Mistral.
---

# LoRA for the Llama family

The same update as [GPT-NeoX's LoRA](../neox/lora.html), on a layer with
seven projections instead of four:

$$y = W x + \frac{\alpha}{r} B A x, \qquad
W \in \{W_q, W_k, W_v, W_o, W_\text{gate}, W_\text{up}, W_\text{down}\},$$

each adapted matrix of $d_\text{out} \times d_{in}$ gaining $r(d_{in} + d_\text{out})$
trainable numbers. The adapted linear, its initialisation ($B = 0$, so step 0
is the base model), the merge $W' = W + \frac{\alpha}{r} B A$ and PEFT's
file layout are GPT-NeoX's, imported; this page names the targets, swaps them
into `DecoderLayer`s, and writes the two exports:

* **merged**: every adapted $W$ replaced by $W'$, written by
  [the family's checkpoint writer](hf_export.html);
* **the adapter alone**, `adapter_config.json` and
  `adapter_model.safetensors`, whose keys are PEFT's for
  `LlamaForCausalLM`,
  `base_model.model.model.layers.`$i$`.self_attn.q_proj.lora_A.weight`.

## Default targets: all seven

PEFT's own default for Llama is `q_proj, v_proj` only (the LoRA paper's
choice for GPT-3). The QLoRA paper (Dettmers et al.) found that adapting
*every* linear layer is what matches full fine-tuning, and the cost stays
small: per layer $r(2d + 2(n_{kv} d_h + d) + 2 n_h d_h + 3(d + d_{ff}))$
numbers against the frozen $d(2 n_h d_h + 2 n_{kv} d_h) + 3 d\, d_{ff}$. So
the default is all seven, as GPT-NeoX's is all four; `targets=('q_proj',
'v_proj')` gives PEFT's.

## Limitations

* As GPT-NeoX's: no dropout, rsLoRA or DoRA; the embedding and readout
  cannot be adapted.
* Biases (Qwen2's q, k, v) stay frozen and are not in the adapter file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterable, Sequence

import torch
from torch import nn

from labml_zero.llama.config import LlamaConfig
from labml_zero.llama.hf_export import save_llama_checkpoint
from labml_zero.llama.model import DecoderLayer, hf_prefix
from labml_zero.neox.lora import ADAPTER_NAMES, FineTuneLoRA, LoRALinear, is_adapter
from labml_zero.neox.lora_export import (merged, peft_adapter_config, peft_name,
                                         write_adapter_dir)
from labml_zero.zero3.trainable import TrainableCount, mark_trainable

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
class LlamaLoRA:
    """
    ## Adapt the chosen projections of every decoder layer

    As `FineTuneLoRA`: call it on the layers (meta or real) before the engine
    shards them; each target `nn.Linear` becomes a `LoRALinear` sharing its
    weight and bias, and only the adapters keep `requires_grad`.
    """

    name: ClassVar[str] = "lora"
    rank: int = 8
    r"""$r$, PEFT's default."""
    alpha: float = 16.0
    r"""$\alpha$; the update is scaled by $\alpha / r$."""
    targets: tuple[str, ...] = field(default_factory=lambda: tuple(TARGETS))
    """PEFT's names of the adapted projections, a non-empty subset of
    `TARGETS`; default all seven (see Default targets)."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        targets = ((self.targets,) if isinstance(self.targets, str)
                   else tuple(self.targets))
        if not targets:
            raise ValueError("LoRA targets must name at least one projection")
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target {unknown[0]!r}; expected some of "
                             f"{', '.join(TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"LoRA targets name a projection twice: {targets}")
        object.__setattr__(self, "targets", targets)

    # GPT-NeoX's: alpha / r, and the initialiser for `zero3_layers` that gives
    # adapters PEFT's initialisation and every other parameter `base`'s.
    scale = FineTuneLoRA.scale
    init_param = FineTuneLoRA.init_param

    def paths(self) -> list[str]:
        """The targets' paths inside a `DecoderLayer`, e.g. `self_attn.q_proj`."""
        return [TARGETS[t] for t in self.targets]

    def __call__(self, layers: Sequence[nn.Module]) -> TrainableCount:
        r"""
        ### Add the adapters and freeze the rest

        Returns $\Psi_\text{lora}$ trainable of $\Psi_\text{base} + \Psi_\text{lora}$; a
        second call raises rather than stack two adapters.
        """
        for layer in layers:
            if not isinstance(layer, DecoderLayer):
                continue
            for path in self.paths():
                owner_name, _, leaf = path.rpartition(".")
                owner = layer.get_submodule(owner_name)
                linear = getattr(owner, leaf)
                if isinstance(linear, LoRALinear):
                    raise ValueError(f"layer {layer.layer_idx} {path} already has "
                                     f"a LoRA adapter")
                setattr(owner, leaf, LoRALinear.wrap(linear, rank=self.rank,
                                                     alpha=self.alpha))
        return mark_trainable(layers, lambda layer, name: is_adapter(name))


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
    GPT-NeoX's `merged` holds each adapted $W$ until its $A$ and $B$ have come
    and rounds once, to the export's dtype. `options` are
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
    in its own dtype under PEFT's key. With only some layers built,
    `adapter_config.json`'s `layers_to_transform` names them.
    """
    decoders = [layer for layer in layers if isinstance(layer, DecoderLayer)]
    if not decoders:
        raise ValueError("save_llama_adapter: no decoder layers")
    adapter = {peft_name(hf_prefix(layer) + name): t.detach().cpu()
               for layer in decoders for name, t in layer.state_dict().items()
               if name.rpartition(".")[2] in ADAPTER_NAMES}
    if not adapter:
        raise ValueError("save_llama_adapter: the layers have no LoRA adapters")
    config = peft_adapter_config(lora, [layer.layer_idx for layer in decoders],
                                 decoders[0].config.n_layers,
                                 base_model_name_or_path=base_model_name_or_path)
    out_dir = Path(out_dir)
    write_adapter_dir(out_dir, config, adapter, overwrite=overwrite)
    return out_dir
