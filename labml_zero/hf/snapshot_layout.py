r"""
---
title: The files of a Hugging Face snapshot
summary: The names every family reads and writes in a Hugging Face model
  directory, a PEFT adapter directory and our export marker, written once.
---

# The files of a Hugging Face snapshot

A model on the hub is a directory, and `from_pretrained` finds each part of it
by a fixed name. This page names them once; a model of $B$ bytes written with
at most $B_\text{shard}$ bytes a shard has $N \ge \lceil B / B_\text{shard}
\rceil$ shard files.
"""

from __future__ import annotations

__all__ = ["CONFIG_FILE", "SINGLE_FILE", "INDEX_FILE", "SHARD_PATTERN",
           "shard_file_name", "TOKENIZER_FILE", "TOKENIZER_CONFIG",
           "SPECIAL_TOKENS", "GENERATION_CONFIG", "CHAT_TEMPLATES", "SIDE_FILES",
           "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "EXPORT_MARKER"]

# ## The model's shape and weights
#
# `config.json` holds the model's shape (each family's config page reads and
# writes it). The weights are one `model.safetensors`, or shards and an index,
# `model.safetensors.index.json`, whose `weight_map` names the file of each
# tensor.
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A shard's name, as a regular expression: five digits each, as transformers
# writes them (the first of three is model-00001-of-00003.safetensors).
SHARD_PATTERN = r"model-\d{5}-of-\d{5}\.safetensors"


def shard_file_name(k: int, n: int) -> str:
    """
    The name of shard `k` (from 0) of `n`, five digits each; with one shard,
    `model.safetensors` and no index, as `save_pretrained` writes it.
    """
    if not 0 <= k < n:
        raise ValueError(f"shard {k} of {n} does not exist")
    return SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


# ## Beside the weights
#
# `AutoTokenizer` reads the tokenizer's three files and the chat template
# (transformers 5 writes it as `chat_template.jinja`, older versions as
# `chat_template.json`; a chat prompt cannot be built without it), `generate`
# the generation config (its end-of-text id); without `tokenizer.json`
# transformers builds a 2-token tokenizer that encodes any text to `[]`.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATES = ("chat_template.jinja", "chat_template.json")
SIDE_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS, *CHAT_TEMPLATES,
              GENERATION_CONFIG)

# ## A PEFT adapter, and our exports' marker
#
# The two files of an adapter directory, by the names
# `PeftModel.from_pretrained` loads.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The file each of our exports writes beside its own, `{"kind": ...}`: what
# tells a previous export, which may be replaced, from a directory of anything
# else (see [where an export may go](export_destination.html)).
EXPORT_MARKER = "labml_zero_export.json"
