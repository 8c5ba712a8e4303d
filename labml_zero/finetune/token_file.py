r"""
---
title: The token file
summary: A corpus tokenised once, in parallel batches, into a flat file of token
  ids cached next to the data, and read memory-mapped by every rank.
---

# The token file

A fine-tune reads each token many times but the text's tokenisation never
changes, so it is done once. The result is a *token file*: the corpus's token
ids, one after the other, as `uint16` when the tokenizer's $V$ ids fit in
one (GPT-NeoX's do) and `uint32` otherwise. A corpus of $N$
tokens is a file of $2N$ or $4N$ bytes with no header, so

$$\text{token}_i = \text{file}[\,i \cdot s : (i + 1) \cdot s\,], \qquad s \in \{2, 4\}$$

and any sample is one slice of it. It is built like this:

1. the [corpus](corpus.html) is read as documents, in pieces;
2. pieces are gathered into batches of about `BATCH_BYTES` and tokenised with
   the `tokenizers` batch API (`encode_batch`), which spreads a batch over all
   cores in Rust;
3. after each document's last piece comes the tokenizer's end-of-text token, so
   the packed samples (see [the dataset](dataset.html)) know where one document
   ends and the next begins;
4. the ids are appended to a temporary file, renamed into place when complete.

The file is cached beside the data, as `.<name>.<key>.tokens.u16`, hidden so a
directory corpus never reads it back as text. The key is a hash of every
source file's path, size and modification time, the tokenizer's whole
definition, the end-of-text id and the JSON field: any change makes a new
key, so a stale cache is never read, and the second run finds the file and
starts at once. Where the data's directory is not writable the cache goes to
`~/.cache/labml_zero/tokens/`.

## Note: why a memory map

`np.memmap` maps the file into the process's address space without reading it:
a page (4 KiB) is read from disk when a sample first touches it, and the kernel
may drop it again when memory is short, since it can always be read back. So
each rank holds only the pages of the samples it reads, the loader's resident
memory does not grow with the corpus, ranks on one host share the page cache
(one copy of a hot page for all of them), and opening a corpus larger than
memory costs nothing.

A file written by another tool (nanoGPT's train.bin, say) is used as it is:
`.u16`, `.uint16` and `.bin` are read as `uint16`, `.u32` and `.uint32` as
`uint32`. Its size must be a whole number of tokens and every id below the
vocabulary size; both are checked before any rank starts.

## Limitations

* An old cache is not removed when its data changes; it is a hidden file beside
  the data.
* Under torchrun every process builds the file if it is missing; the atomic
  rename makes that safe, not cheap. Start one process first, or build it with
  `build_token_file`, for a large corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from labml_zero.files import atomic_file
from labml_zero.finetune.corpus import DataError, Source, find_sources, read_documents
from labml_zero.neox.tokenizer import vocab_size

__all__ = ["TOKEN_DTYPES", "is_token_file", "open_token_file", "cache_path",
           "build_token_file", "corpus_tokens", "token_dtype", "BATCH_BYTES"]

# Suffix → dtype of a pre-tokenised file.
TOKEN_DTYPES = {".u16": np.uint16, ".uint16": np.uint16, ".bin": np.uint16,
                ".u32": np.uint32, ".uint32": np.uint32}
# Text per `encode_batch` call: enough pieces to keep every core busy.
BATCH_BYTES = 2 << 20
# Ids scanned at a time when checking a token file against the vocabulary.
SCAN_TOKENS = 1 << 24
DEFAULT_CACHE = Path.home() / ".cache" / "labml_zero" / "tokens"
# Bump when the file's layout changes, so old caches get a new key.
FORMAT_VERSION = 1


def token_dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if vocab_size(tokenizer) <= 1 << 16 else np.uint32


def is_token_file(path: str | os.PathLike) -> bool:
    return Path(path).is_file() and Path(path).suffix.lower() in TOKEN_DTYPES


# ## Reading


def open_token_file(path: str | os.PathLike, *, vocab: int,
                    check_ids: bool = True) -> np.ndarray:
    """
    ### A token file, memory-mapped: `[N]` `uint16` or `uint32`

    Refuses a file that is empty, not a whole number of tokens, or (with
    `check_ids`) holds an id of at least `vocab`; the scan reads the file once,
    in blocks of `SCAN_TOKENS` ids.
    """
    path = Path(path)
    dtype = np.dtype(TOKEN_DTYPES.get(path.suffix.lower(), np.uint16))
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"--data {path}: the token file is empty")
    if size % dtype.itemsize:
        raise DataError(f"--data {path}: {size} bytes is not a whole number of "
                        f"{dtype.name} tokens ({dtype.itemsize} bytes each)")
    tokens = np.memmap(path, dtype=dtype, mode="r")  # [N] on disk
    if check_ids:
        for start in range(0, len(tokens), SCAN_TOKENS):
            block = tokens[start:start + SCAN_TOKENS]
            if int(block.max()) >= vocab:
                at = start + int(np.argmax(block >= vocab))
                raise DataError(f"--data {path}: token {at} is id {int(tokens[at])},"
                                f" not below the vocabulary size {vocab}")
    return tokens


# ## The cache


def sources_key(sources: list[Source], tokenizer: Tokenizer, *, eot: int,
                text_field: str) -> str:
    """What the token file depends on, hashed: files, tokenizer, separator."""
    files = [(str(s.path.resolve()), s.path.stat().st_size, s.path.stat().st_mtime_ns)
             for s in sources]
    uses_field = any(s.jsonl for s in sources)
    facts = {"files": files, "eot": eot, "version": FORMAT_VERSION,
             "text_field": text_field if uses_field else None,
             "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest()}
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def cache_path(data: str | os.PathLike, key: str, dtype: type) -> Path:
    """`.<name>.<key>.tokens.u16` beside `data`, or in `DEFAULT_CACHE`."""
    data = Path(data).resolve()
    suffix = ".u16" if dtype == np.uint16 else ".u32"
    name = f".{data.name}.{key}.tokens{suffix}"
    if os.access(data.parent, os.W_OK):
        return data.parent / name
    return DEFAULT_CACHE / name


# ## Building


class Progress:
    """
    #### A progress line on a terminal, one summary line either way

    The bar is redrawn in place (`\\r`) at most twice a second, only when
    stderr is a terminal, so a log or a test's captured output gets the summary
    alone.
    """

    def __init__(self, name: str, total_bytes: int):
        self.name, self.total, self.done = name, total_bytes, 0
        self.start = self.shown = time.monotonic()
        self.live = sys.stderr.isatty()

    def advance(self, n_bytes: int) -> None:
        self.done += n_bytes
        now = time.monotonic()
        if self.live and now - self.shown > 0.5:
            self.shown = now
            rate = self.done / 1e6 / max(now - self.start, 1e-9)
            share = min(1.0, self.done / max(self.total, 1))
            bar = "#" * int(30 * share)
            print(f"\rtokenizing {self.name} [{bar:<30}] {share:4.0%} "
                  f"{self.done / 1e6:.0f}/{self.total / 1e6:.0f} MB, "
                  f"{rate:.1f} MB/s", end="", file=sys.stderr, flush=True)

    def finish(self, n_tokens: int, path: Path) -> None:
        if self.live:
            print(file=sys.stderr)
        took = time.monotonic() - self.start
        print(f"tokenized {self.done / 1e6:.1f} MB of text into {n_tokens:,} tokens "
              f"in {took:.1f} s ({self.done / 1e6 / max(took, 1e-9):.1f} MB/s): "
              f"{path}", flush=True)


def batches(documents: Iterator[Iterator[str]], batch_bytes: int
            ) -> Iterator[tuple[list[str], list[bool]]]:
    """
    #### Pieces in batches of about `batch_bytes`, each flagged if it ends a document
    """
    batch, ends, size = [], [], 0
    for document in documents:
        piece = next(document, None)
        while piece is not None:
            following = next(document, None)
            batch.append(piece)
            ends.append(following is None)
            size += len(piece)
            if size >= batch_bytes:
                yield batch, ends
                batch, ends, size = [], [], 0
            piece = following
    if batch:
        yield batch, ends


def build_token_file(sources: list[Source], tokenizer: Tokenizer, path: Path, *,
                     eot: int, text_field: str = "text",
                     batch_bytes: int = BATCH_BYTES) -> int:
    """
    ### Tokenise `sources` into the token file at `path`; returns its length

    Written to a temporary sibling and renamed when complete, so an interrupted
    or refused build leaves no file that a later run would trust.
    """
    dtype = token_dtype(tokenizer)
    total = sum(s.path.stat().st_size for s in sources)
    progress = Progress(sources[0].path.name if len(sources) == 1
                        else f"{len(sources)} files", total)
    n_tokens = n_text = 0
    end = np.array([eot], dtype=dtype)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        for pieces, ends in batches(read_documents(sources, text_field=text_field),
                                    batch_bytes):
            # parallel over the batch's pieces, in Rust (no GIL)
            encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
            for encoding, last in zip(encodings, ends):
                ids = np.asarray(encoding.ids, dtype=dtype)  # [n] uint16|uint32
                ids.tofile(f)
                n_text += len(ids)
                if last:
                    end.tofile(f)
                n_tokens += len(ids) + last
            progress.advance(sum(len(p.encode()) for p in pieces))
        if n_text == 0:
            raise DataError(f"--data {sources[0].path}: no text (every document "
                            f"is empty)")
    progress.finish(n_tokens, path)
    return n_tokens


def corpus_tokens(data: str | os.PathLike, tokenizer: Tokenizer, *, eot: int,
                  text_field: str = "text", check_ids: bool = True) -> np.ndarray:
    """
    ## `--data` as token ids, memory-mapped

    A token file is opened as it is; text is tokenised into the cached token
    file first, unless it is there already.
    """
    if is_token_file(data):
        return open_token_file(data, vocab=vocab_size(tokenizer),
                               check_ids=check_ids)
    sources = find_sources(data)
    key = sources_key(sources, tokenizer, eot=eot, text_field=text_field)
    path = cache_path(data, key, token_dtype(tokenizer))
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        build_token_file(sources, tokenizer, path, eot=eot, text_field=text_field)
    # ids of our own tokenizer: below its vocabulary by construction
    return open_token_file(path, vocab=vocab_size(tokenizer), check_ids=False)
