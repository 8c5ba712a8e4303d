r"""
---
title: Hugging Face files
summary: What every model family shares with the Hugging Face hub: the files
  of a snapshot, reading and writing safetensors one layer at a time, the
  PEFT adapter, and where an export may go.
---

# Hugging Face files

A model comes in as a Hugging Face snapshot and leaves as one, whatever its
architecture, so these pages serve every family; a family adds only its
config keys and its tensor names, $\text{name} = \operatorname{prefix}(\text{layer}) +
\text{local name}$.
"""
