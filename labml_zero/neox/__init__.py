r"""
---
title: GPT-NeoX
summary: The GPT-NeoX / Pythia model as a list of layers, its kernels, Hugging
  Face checkpoints, the tokenizer, fine-tuners, its memory budget and a sampler;
  the fine-tune job is a package of its own, above it.
---

# GPT-NeoX

The model we fine-tune with ZeRO-3 is GPT-NeoX
([Black et al.](https://arxiv.org/abs/2204.06745)): the architecture of
GPT-NeoX-20B and of the Pythia suite (Pythia-70M to Pythia-12B). A layer of it
computes

$$x_{l+1} = x_l + \operatorname{Attn}(\operatorname{LN}_1(x_l))
                + \operatorname{MLP}(\operatorname{LN}_2(x_l))$$

(the *parallel residual*: both branches read $x_l$), and attention rotates only
the first quarter of each head's dimensions by their position (*partial
rotary embeddings*). A model with $L$ layers of width $d$ and a vocabulary of
$V$ has about $12 L d^2 + 2 V d$
(tested: tests/neox/test_model.py::test_parameter_count_formula)
parameters:
{{py: neox_model.count_parameters(neox_model.build_layers(
    neox_model.gpt_neox_20b(), device='meta')) / 1e9 | .2f}}
billion for GPT-NeoX-20B (counted from its layers), whose bf16 weights alone take
{{py: 2 * neox_model.count_parameters(neox_model.build_layers(
    neox_model.gpt_neox_20b(), device='meta')) / 1e9 | .0f}}
GB and whose model states for training, at
$2 + 4 + 12 = 18$
(tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
bytes a parameter, about 370
(tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
GB: what ZeRO-3 spreads over the ranks. The model is a plain **list of layers**,
the unit the engine gathers and releases; [the fine-tune](../finetune/index.html),
a package above this one, builds it through [the assembly](../assembly.html).
What the job asks of the family (presets, checkpoints, fine-tuners, cost)
is one object, `NEOX`, on [its own page](family.html).
"""
