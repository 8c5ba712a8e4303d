r"""
---
title: Reading a corpus
summary: A fine-tuning corpus as a stream of documents, from a text file, a gzip,
  a directory or a JSON Lines file, with every malformed input refused in one
  line that says where.
---

# Reading a corpus

`--data` names the text to fine-tune on. This page turns it into a stream of
*documents*, each a stream of text *pieces* that the
[token file](token_file.html) tokenises in parallel batches:

* a text file (`.txt`, anything not recognised below), or a gzip of one (`.gz`):
  one document;
* a JSON Lines file (`.jsonl`, `.jsonl.gz`): one document per line, its text in
  the field `text_field` (`--text-field`, default `text`);
* a directory: every file under it that is not hidden, in sorted path order, each
  read by its suffix as above.

A large file is read in blocks of `BLOCK_BYTES`, and a document is cut into
pieces at a line break between two printable ASCII characters. Byte-level BPE's
pre-tokenizer never joins a token across such a break (the newline is a
pre-token of its own on both sides), so tokenising the pieces one by one gives
exactly the ids of the whole text (tested:
tests/finetune/test_corpus.py::test_pieces_tokenize_like_the_whole_text), while
memory holds one block, not the corpus.

Every way the input can be wrong is a `DataError` with one line naming the file
and, where it has one, the line: a missing or empty file, a directory with no
text, a binary file (a NUL byte), invalid UTF-8 (the byte offset and the line), a
JSON Lines line that is not JSON, not an object, or without a text field.

## Limitations

* A text file with no line break between printable ASCII characters for a whole
  block is held in memory until one comes.
* Only UTF-8; no other encodings are guessed.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple

__all__ = ["DataError", "Source", "find_sources", "read_documents", "BLOCK_BYTES"]

# Read this many bytes at a time.
BLOCK_BYTES = 1 << 20
# Pieces of about this many bytes: many per batch, so every core gets some,
# and small encodings (each holds its tokens' strings and offsets too).
PIECE_BYTES = 1 << 16
# A safe cut: after a newline between two printable ASCII characters.
SAFE_CUT = re.compile(rb"(?<=[!-~])\n(?=[!-~])")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
NEWLINE = b"\n"


class DataError(ValueError):
    """Malformed or missing data; the message is one line naming where."""


class Source(NamedTuple):
    """One file of the corpus and how to read it."""

    path: Path
    jsonl: bool
    gzipped: bool


def source_of(path: Path) -> Source:
    name = path.name.lower()
    return Source(path, name.endswith(JSONL_SUFFIXES), name.endswith(".gz"))


def find_sources(data: str | os.PathLike) -> list[Source]:
    """
    ### The files of `--data`, checked to exist and hold something

    A directory's files are listed sorted by path, so the corpus (and its
    token file's key) does not depend on the order the filesystem lists them in.
    """
    path = Path(data)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
        files = [p for p in files if p.stat().st_size > 0]
        if not files:
            raise DataError(f"--data {path}: the directory has no text (no "
                            f"non-empty, non-hidden file under it)")
        return [source_of(p) for p in files]
    if not path.exists():
        raise DataError(f"--data {path}: no such file or directory")
    if not path.is_file():
        raise DataError(f"--data {path}: not a regular file or directory")
    if path.stat().st_size == 0:
        raise DataError(f"--data {path}: the file is empty")
    return [source_of(path)]


def open_bytes(source: Source) -> BinaryIO:
    return gzip.open(source.path, "rb") if source.gzipped else open(source.path, "rb")


# ## Checked decoding


def decode(raw: bytes, source: Source, *, offset: int, line: int) -> str:
    """
    #### Bytes → text, or a `DataError` saying where

    `offset` and `line` are those of `raw`'s first byte in the (decompressed)
    file, so the message points at the bad byte itself.
    """
    nul = raw.find(b"\0")
    if nul >= 0:
        at = line + raw.count(NEWLINE, 0, nul)
        raise DataError(f"{source.path}: a NUL byte at byte {offset + nul} (line "
                        f"{at}): a binary file, not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + raw.count(NEWLINE, 0, e.start)
        raise DataError(f"{source.path}: invalid UTF-8 at byte {offset + e.start}, "
                        f"line {at} ({e.reason})") from None


# ## Documents


def split_block(raw: bytes) -> list[bytes]:
    """`raw` cut at safe line breaks into pieces of about `PIECE_BYTES`."""
    pieces, start = [], 0
    for match in SAFE_CUT.finditer(raw):
        if match.end() - start >= PIECE_BYTES:
            pieces.append(raw[start:match.end()])
            start = match.end()
    if start < len(raw):
        pieces.append(raw[start:])
    return pieces


def text_pieces(source: Source) -> Iterator[str]:
    """
    ### One text file as pieces of about `PIECE_BYTES`, cut at safe line breaks

    The carry holds what follows the last safe cut; a gzip that ends early is a
    `DataError` like any other bad byte.
    """
    carry, offset, line = b"", 0, 1
    try:
        with open_bytes(source) as f:
            while block := f.read(BLOCK_BYTES):
                carry += block
                cut = None
                # the last safe cut in the block: search its tail first
                for match in SAFE_CUT.finditer(carry, max(0, len(carry) - 4096)):
                    cut = match.end()
                if cut is None:
                    for match in SAFE_CUT.finditer(carry):
                        cut = match.end()
                if cut is None:
                    continue
                done, carry = carry[:cut], carry[cut:]
                for piece in split_block(done):
                    yield decode(piece, source, offset=offset, line=line)
                    offset, line = offset + len(piece), line + piece.count(NEWLINE)
    except (OSError, EOFError) as e:
        raise DataError(f"{source.path}: cannot be read ({e})") from None
    if carry:
        yield decode(carry, source, offset=offset, line=line)


def jsonl_documents(source: Source, text_field: str) -> Iterator[str]:
    """
    ### A JSON Lines file: each line's `text_field`, one document each

    Blank lines are skipped; anything else must be an object with a string in
    `text_field`.
    """
    offset = 0
    try:
        with open_bytes(source) as f:
            for number, raw in enumerate(f, start=1):
                text = decode(raw, source, offset=offset, line=number)
                offset += len(raw)
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"{source.path}:{number}: not JSON "
                                    f"({e.msg})") from None
                if not isinstance(record, dict) or text_field not in record:
                    raise DataError(f"{source.path}:{number}: no {text_field!r} "
                                    f"field (see --text-field)")
                if not isinstance(record[text_field], str):
                    raise DataError(f"{source.path}:{number}: {text_field!r} is "
                                    f"not a string")
                yield record[text_field]
    except (OSError, EOFError) as e:
        raise DataError(f"{source.path}: cannot be read ({e})") from None


def read_documents(sources: list[Source], *, text_field: str = "text"
                   ) -> Iterator[Iterator[str]]:
    """
    ## The corpus as documents, each an iterator of text pieces

    A JSON Lines document is one piece; a text file's are cut by `text_pieces`.
    Consume each document before asking for the next.
    """
    for source in sources:
        if source.jsonl:
            for document in jsonl_documents(source, text_field):
                yield iter((document,))
        else:
            yield text_pieces(source)
