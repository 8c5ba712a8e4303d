r"""
---
title: GPT-NeoX
summary: The GPT-NeoX / Pythia model as a list of layers, its kernels, Hugging
  Face checkpoints, the tokenizer, fine-tuners, its activation count and a sampler;
  the fine-tune job is a package of its own, above it.
---

# GPT-NeoX

The model we fine-tune with ZeRO-3 is GPT-NeoX
([Black et al.](https://arxiv.org/abs/2204.06745)), the architecture of
GPT-NeoX-20B and of the Pythia suite. A model with $L$ layers of width $d$ and
a vocabulary of $V$ has about

$$12 L d^2 + 2 V d$$
(tested: tests/neox/test_model.py::test_parameter_count_formula)

parameters:
{{py: neox_model.count_parameters(neox_model.build_layers(
    neox_model.gpt_neox_20b(), device='meta')) / 1e9 | .2f}}
billion for GPT-NeoX-20B, whose model states for training, at
$2 + 4 + 12 = 18$
(tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
bytes a parameter, take about 370
(tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)
GB: what ZeRO-3 spreads over the ranks. What the job asks of the family is
one object, `NEOX`, on [its own page](family.html).
"""
