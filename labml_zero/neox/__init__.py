r"""
---
title: GPT-NeoX
summary: The GPT-NeoX / Pythia model as a list of layers, Hugging Face
  checkpoints, the tokenizer, the Tiny Shakespeare dataset, fine-tuners and a
  sampler.
---

# GPT-NeoX

The model we fine-tune with ZeRO-3 is GPT-NeoX
([Black et al., 2022](https://arxiv.org/abs/2204.06745)): the architecture of
GPT-NeoX-20B and of the Pythia suite (70M to 12B). A layer of it computes

$$x_{l+1} = x_l + \operatorname{Attn}(\operatorname{LN}_1(x_l))
                + \operatorname{MLP}(\operatorname{LN}_2(x_l))$$

(the *parallel residual*: both branches read $x_l$), and attention rotates only
the first quarter of each head's dimensions by their position (*partial
rotary embeddings*). A model with $L$ layers of width $d$ and a vocabulary of
$V$ has about $12 L d^2 + 2 V d$ parameters: $20.55 \cdot 10^9$ for 20B, whose
fp16 weights alone (41 GB) and Adam states ($16 \Psi$ bytes = 329 GB) are what
ZeRO-3 spreads over the ranks.

The model is a plain **list of layers**, the unit the engine gathers and
releases, with Hugging Face's parameter names inside each layer, so a
checkpoint streams into it one layer at a time.

Pages, in reading order:

1. [The model](model.html): config and presets, partial rotary embeddings,
   attention, the parallel-residual layer, `build_layers`.
2. [Activation memory](activation_memory.html): what autograd keeps per layer,
   per fine-tuner and with recomputation, and the loss's fp32 peak.
3. [Hugging Face checkpoints](checkpoint.html): streaming per-layer loading
   with checked shapes, atomic sharded export.
4. [The tokenizer](tokenizer.html).
5. [The dataset](dataset.html): tokenise once, split, fixed-length samples,
   a deterministic and resumable per-rank order.
6. [Fine-tuners](finetuners.html): which parameters train.
7. [Sampling](generate.html): greedy and top-k generation.
8. [The fine-tune](finetune.html): configuration, the sharded model, the training
   loop, checkpoints; started by [`finetune_neox`](../finetune_neox.html).
"""
