r"""
---
title: The Llama family
summary: Llama 3, Qwen2.5, Mistral and SmolLM2 as one package, beside GPT-NeoX:
  configuration and presets, RMSNorm, SwiGLU, grouped-query attention with
  scaled rotary embeddings, tied embeddings, checkpoints, tokenizer, FLOPs and
  activations, saving checkpoints, LoRA, and the family as one object.
---

# The Llama family

The models people fine-tune today (Llama 3, Qwen2.5, Mistral, SmolLM2) are
one architecture with different shapes. Against [GPT-NeoX](../neox/index.html)
a layer is *sequential* where GPT-NeoX's is parallel,

$$h = x + \operatorname{Attn}(\operatorname{RMS}_1(x)), \qquad
x_{l+1} = h + \operatorname{MLP}(\operatorname{RMS}_2(h)),$$

and RMSNorm, SwiGLU, grouped-query attention and tied embeddings differ, each
beside its class on the [model page](model.html). The pages below follow a
model from its configuration to its checkpoints, and the last gathers what the
fine-tune job asks of a family into one object, `LLAMA`, a
[`ModelFamily`](../family.html).
"""
