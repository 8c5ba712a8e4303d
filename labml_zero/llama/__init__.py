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

and four parts differ, each for a reason a reader of the engine meets again:

* **RMSNorm** scales by the root mean square, with no mean and no bias: one
  vector of $d$ weights per norm, and one reduction instead of two.
* **SwiGLU** gates the MLP, three matrices of $d\, d_{ff}$ instead of two:
  the chunk layout sees three products per MLP.
* **Grouped-query attention**: $n_{kv}$ key-value heads serve $n_h$ query
  heads, so $W_k$ and $W_v$ have $n_{kv} d_h$ rows. The K and V projections
  shrink in parameters, FLOPs and saved activations; the attention scores do
  not, since every query head still reads a whole key head.
* **Tied embeddings** (SmolLM2, the small Qwen2.5 and Llama-3.2): the readout
  is the embedding's matrix, one parameter in the first and the last layer,
  which the engine lays out in the embedding layer, gathered for the whole
  step (the model page's Note: a tied embedding in the chunk layout).

Rotary embeddings turn the whole head, with a base per model and Llama 3's
scaling of the slow frequencies. A trained model leaves as a Hugging Face
checkpoint again, its tied embedding written once, and LoRA adapts the
seven projections of a layer, merged into the checkpoint or saved for PEFT.
The package's last page gathers what the fine-tune job asks of a family into
one object, `LLAMA`, a [`ModelFamily`](../family.html).
"""
