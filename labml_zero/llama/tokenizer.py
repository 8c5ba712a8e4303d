"""
---
title: Llama-family tokenizers
summary: A Llama, Qwen or Mistral snapshot's own tokenizer.json, loaded with the
  `tokenizers` library; its document separator and its size against the
  embedding.
---

# Llama-family tokenizers

GPT-NeoX ships one tokenizer, bundled with the package
([its page](../neox/tokenizer.html)); each model of this family has its own,
in the snapshot beside the weights, so the tokenizer comes from the checkpoint
and nothing is bundled. Encoding and decoding are GPT-NeoX's functions; what
differs is where the file is, which token ends a document (Llama 3's
`<|end_of_text|>`, Qwen's `<|endoftext|>`, Mistral's and SmolLM2's `</s>` or
`<|endoftext|>`), and that every id it can produce must be a row of the
embedding.

## Limitations

* No chat templates: documents are plain text joined by the end-of-text token.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer

# `tokenizer.json`, beside `config.json` in every snapshot on the hub
from labml_zero.hf.snapshot_layout import TOKENIZER_FILE
from labml_zero.llama.config import LlamaConfig
from labml_zero.neox.tokenizer import end_of_text_id, load_tokenizer, vocab_size
from labml_zero.zero3.checkpoint import CheckpointError

__all__ = ["TOKENIZER_FILE", "checkpoint_tokenizer"]



def checkpoint_tokenizer(path: str | os.PathLike, config: LlamaConfig
                         ) -> tuple[Tokenizer, int]:
    """
    ### The snapshot's tokenizer and its end-of-text id

    Refuses, in one `CheckpointError` line naming the file, a snapshot without
    `tokenizer.json`, a file `tokenizers` cannot read, one with no end-of-text
    token, and one that produces ids past the embedding's `n_vocab` rows (the
    lookup would fail inside a rank, on the first batch that has one).
    """
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        raise CheckpointError(f"{file}: not found; a Llama-family checkpoint "
                              f"brings its own tokenizer")
    try:
        tokenizer = load_tokenizer(file)
    except Exception as error:
        raise CheckpointError(f"{file}: not a tokenizer "
                              f"({str(error).splitlines()[0]})") from None
    try:
        eot = end_of_text_id(tokenizer)
    except ValueError as error:
        raise CheckpointError(f"{file}: {error}") from None
    if vocab_size(tokenizer) > config.n_vocab:
        raise CheckpointError(f"{file}: {vocab_size(tokenizer)} ids, more than "
                              f"config.json's vocab_size={config.n_vocab}")
    return tokenizer, eot
