r"""
---
title: The Llama family
summary: Llama 3, Qwen 2.5, Mistral and SmolLM2 as one package: configuration
  and presets, RMSNorm, SwiGLU, grouped-query attention with scaled rotary
  embeddings, tied embeddings, checkpoints, tokenizer, FLOPs and activations.
---

# The Llama family

placeholder
"""
