"""
---
title: GPT-NeoX tokenizer
summary: Load the GPT-NeoX-20B BPE tokenizer (bundled, gzipped) with the
  `tokenizers` library; encode and decode.
---

# GPT-NeoX tokenizer

GPT-NeoX-20B and every Pythia model share one byte-level BPE tokenizer:
50,254 (tested: tests/neox/test_tokenizer.py::test_figures_in_the_notes)
learned tokens plus 27 (tested: tests/neox/test_tokenizer.py::test_figures_in_the_notes)
added ones (special tokens and runs of spaces),
50,281
(tested: tests/neox/test_tokenizer.py::test_figures_in_the_notes)
ids in all.

## Limitations

* No special-token handling: `encode` adds no BOS/EOS (see `encode`).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from tokenizers import Tokenizer

__all__ = ["load_tokenizer", "encode", "decode", "vocab_size", "BUNDLED_TOKENIZER",
           "job_tokenizer_path", "end_of_text_id", "END_OF_TEXT"]

# The tokenizer's `tokenizer.json` ships gzipped in `labml_zero/data/`
# (EleutherAI, Apache-2.0; see `data/NOTICE`), so nothing is downloaded.
BUNDLED_TOKENIZER = (Path(__file__).resolve().parent.parent / "data"
                     / "gpt_neox_20b_tokenizer.json.gz")
# Names of a document separator, in the order they are looked for.
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """
    ### Load a `tokenizer.json`

    `None` loads the bundled GPT-NeoX-20B tokenizer; a path may be a
    `tokenizer.json` or a gzip of one (`.gz`).
    """
    path = BUNDLED_TOKENIZER if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return Tokenizer.from_str(f.read())
    return Tokenizer.from_file(str(path))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """
    Token ids of `text`, with no special tokens added: no BOS/EOS (GPT-NeoX was
    trained without a BOS token; documents were separated by `<|endoftext|>`,
    id 0). `"First Citizen: Before we proceed any further"` encodes to
    `[6407, 47422, 27, 9613, 359, 4262, 667, 2007]`; the tests check this vector.
    """
    return tokenizer.encode(text, add_special_tokens=False).ids


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Text of `ids`; byte-level BPE decodes any id sequence losslessly."""
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def vocab_size(tokenizer: Tokenizer) -> int:
    """
    Number of ids the tokenizer can produce, special tokens included. The
    models' embedding matrices have more rows than that (50,304
    (tested: tests/neox/test_tokenizer.py::test_figures_in_the_notes) to 50,688
    (tested: tests/neox/test_tokenizer.py::test_figures_in_the_notes), padded
    for fast matmuls); ids past it are never produced here, and the sampler in
    [generate](generate.html) never picks them.
    """
    return tokenizer.get_vocab_size(with_added_tokens=True)


def job_tokenizer_path(checkpoint: str | os.PathLike | None) -> Path:
    """A checkpoint's own `tokenizer.json` when it has one, else the bundled one."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").is_file():
        return Path(checkpoint) / "tokenizer.json"
    return BUNDLED_TOKENIZER


def end_of_text_id(tokenizer: Tokenizer) -> int:
    """The id that separates documents: the first of `END_OF_TEXT` it knows."""
    for name in END_OF_TEXT:
        if (token := tokenizer.token_to_id(name)) is not None:
            return token
    raise ValueError(f"the tokenizer has no end-of-text token (none of "
                     f"{', '.join(END_OF_TEXT)})")
