r"""
---
title: Reading a corpus
summary: A fine-tuning corpus as a stream of documents, from a text file, a gzip,
  a directory or a JSON Lines file, with every malformed input refused in one
  line that says where.
---

# Reading a corpus

`--data` names the text to fine-tune on: a text file, a gzip of one, a
directory, or a JSON Lines file. This page turns it into a stream of
*documents*, each a stream of text *pieces* of at most $P$ = `PIECE_BYTES`
bytes that the [token file](token_file.html) tokenises in parallel batches, and
refuses every malformed input in one line that says where.
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
# Pieces of at most this many bytes: many per batch, so every core gets some.
# The tokenizer's memory grows with the piece it is given (each token of an
# encoding carries its string and offsets, well over a hundred bytes for a byte
# of text), so bounded pieces bound the preparation's memory whatever the
# length of a line: a block, the carry after the last cut, and a batch of
# pieces.
PIECE_BYTES = 1 << 16
# A JSON Lines record is parsed whole (parsing holds about twice its size); a
# longer line is refused.
MAX_RECORD_BYTES = 64 << 20

# ## Note: where a piece may be cut
#
# Byte-level BPE tokenises each *pre-token* on its own, and GPT-NeoX's
# pre-tokenizer (GPT-2's pattern) never lets a pre-token run across a space or
# a newline that has a non-space on both sides: a space may only *start* a
# pre-token (` word`), a newline between two printable characters is one of its
# own. So a cut
#
# 1. after a newline between two printable ASCII characters, or
# 2. before a space between two printable ASCII characters
#
# falls on a pre-token boundary, and tokenising the pieces one by one gives
# exactly the ids of the whole text (tested:
# tests/finetune/test_corpus.py::test_pieces_tokenize_like_the_whole_text), a
# long line cut at its spaces included (tested:
# tests/finetune/test_corpus.py::test_a_long_line_is_cut_at_spaces). A window
# with neither (a run of $P$ bytes without a space: a long URL, base64, text in
# a script without spaces) is cut at $P$ bytes (`best_cut`): only the one
# pre-token it splits changes its tokens (tested:
# tests/finetune/test_corpus.py::test_a_byte_cut_changes_one_pre_token).
SAFE_CUT = re.compile(rb"(?<=[!-~])\n(?=[!-~])")
SAFE_SPACE = re.compile(rb"(?<=[!-~])(?= [!-~])")
# Where a cut is looked for first: the last this many bytes of a window.
TAIL_BYTES = 4096
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
NEWLINE = b"\n"


class DataError(ValueError):
    """Malformed or missing data; the message is one line naming the file and,
    where it has one, the line: a missing or empty file, a directory with no
    text, a binary file (a NUL byte), invalid UTF-8 (only UTF-8 is read; no other
    encoding is guessed), a JSON Lines line that is not JSON, not an object, or
    without a text field."""

    # a rank that raises it is reported in that line alone, no traceback
    user_error = True


class Source(NamedTuple):
    """One file of the corpus and how to read it."""

    path: Path
    jsonl: bool
    gzipped: bool


def source_of(path: Path) -> Source:
    """A JSON Lines file (`.jsonl`, `.jsonl.gz`) is one document per line, its
    text in the field `--text-field`; any other file is one text document; a
    `.gz` is read through gzip."""
    name = path.name.lower()
    return Source(path, name.endswith(JSONL_SUFFIXES), name.endswith(".gz"))


# A `.json` file's first line read to tell JSON Lines (`misnamed_json_lines`).
FIRST_LINE_BYTES = 1 << 20


def misnamed_json_lines(source: Source) -> None:
    """
    #### Refuse JSON Lines saved as `.json`

    Only the suffix says a file is JSON Lines, but some tools write JSON Lines
    under `.json` (as Hugging Face `datasets` does when asked for JSON): read as text, the run
    would train on the records' markup, `{"text": ...}` and all. A `.json` file
    whose first line is a whole JSON object by itself is such a file.
    """
    name = source.path.name.lower()
    if not name.endswith((".json", ".json.gz")):
        return
    try:
        with open_bytes(source) as f:
            first = f.readline(FIRST_LINE_BYTES)
        record = json.loads(first)
    except (OSError, EOFError, ValueError):
        return  # not one object on its first line: read as text, as named
    if isinstance(record, dict):
        raise DataError(f"{source.path}: JSON Lines under a .json name; name it "
                        f".jsonl (or .jsonl.gz) to read its --text-field, or it "
                        f"would train on the records' markup")


def find_sources(data: str | os.PathLike) -> list[Source]:
    """
    ### The files of `--data`, checked to exist and hold something

    A directory's files, every one under it that is not hidden, are listed
    sorted by path, so the corpus (and its token file's key) does not depend on
    the order the filesystem lists them in; each is read by its suffix.
    """
    path = Path(data)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
        files = [p for p in files if p.stat().st_size > 0]
        if not files:
            raise DataError(f"--data {path}: the directory has no text (no "
                            f"non-empty, non-hidden file under it)")
        sources = [source_of(p) for p in files]
        for source in sources:
            misnamed_json_lines(source)
        return sources
    if not path.exists():
        raise DataError(f"--data {path}: no such file or directory")
    if not path.is_file():
        raise DataError(f"--data {path}: not a regular file or directory")
    if path.stat().st_size == 0:
        raise DataError(f"--data {path}: the file is empty")
    source = source_of(path)
    misnamed_json_lines(source)
    return [source]


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


# ## Cutting


def best_cut(buf: bytes, start: int, end: int) -> tuple[int, bool]:
    """
    #### The cut for the piece `buf[start:…]` of at most `end - start` bytes

    Returns the position and whether it is exact (changes no token): the last
    safe line break, else the last safe space, in `buf[start:end]` (see Note:
    where a piece may be cut); with neither, `end` moved back to the start of
    a UTF-8 character (at most 3 bytes: a character is at most 4), which
    changes the tokens of the one pre-token it splits and no others.
    """
    for pattern in (SAFE_CUT, SAFE_SPACE):
        # the window's tail first: in ordinary text a cut is near its end
        for lo in dict.fromkeys((max(start + 1, end - TAIL_BYTES), start + 1)):
            last = None
            # endpos one past `end`: the lookahead reads the byte after a cut
            for last in pattern.finditer(buf, lo, end + 1):
                pass
            if last is not None:
                return last.end(), True
    cut = end
    for _ in range(3):
        if buf[cut] & 0xC0 != 0x80:  # not a continuation byte 10xxxxxx
            break
        cut -= 1
    return cut, False


def cuts(buf: bytes, start: int = 0) -> Iterator[int]:
    """The ends of the pieces of `buf[start:]` while more than `PIECE_BYTES` remain."""
    while len(buf) - start > PIECE_BYTES:
        start = best_cut(buf, start, start + PIECE_BYTES)[0]
        yield start


# ## Documents


def text_pieces(source: Source) -> Iterator[str]:
    """
    ### One text file as pieces of at most `PIECE_BYTES`

    Memory holds one block and the carry, the less than `PIECE_BYTES` after the
    last cut, whatever the length of a line; a gzip that ends early is a
    `DataError` like any other bad byte.
    """
    carry, offset, line = b"", 0, 1
    try:
        with open_bytes(source) as f:
            while True:
                block = f.read(BLOCK_BYTES)
                buf, start = carry + block, 0
                ends = list(cuts(buf))
                if not block and len(buf):
                    ends.append(len(buf))
                for end in ends:
                    piece = buf[start:end]
                    yield decode(piece, source, offset=offset, line=line)
                    offset, line = offset + len(piece), line + piece.count(NEWLINE)
                    start = end
                carry = buf[start:]
                if not block:
                    return
    except (OSError, EOFError) as e:
        raise DataError(f"{source.path}: cannot be read ({e})") from None


def record_pieces(raw: bytes) -> Iterator[str]:
    """One record's text, as UTF-8, cut like a file's into small pieces."""
    start = 0
    for end in (*cuts(raw), len(raw)):
        yield raw[start:end].decode("utf-8")
        start = end


def jsonl_documents(source: Source, text_field: str) -> Iterator[Iterator[str]]:
    """
    ### A JSON Lines file: each line's `text_field`, one document each

    Blank lines are skipped; anything else must be an object with a string in
    `text_field`. A line is parsed whole, so one longer than `MAX_RECORD_BYTES`
    is refused, read no further than that. Each step frees what came before
    it (the line's bytes, its text, the parsed string), so about twice the
    line is held at once.
    """
    offset, number = 0, 0
    try:
        with open_bytes(source) as f:
            while raw := f.readline(MAX_RECORD_BYTES + 1):
                number += 1
                if len(raw) > MAX_RECORD_BYTES:
                    raise DataError(
                        f"{source.path}:{number}: a line longer than "
                        f"{MAX_RECORD_BYTES >> 20} MiB; split the record (a "
                        f"record is parsed whole)")
                text = decode(raw, source, offset=offset, line=number)
                offset += len(raw)
                del raw
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"{source.path}:{number}: not JSON "
                                    f"({e.msg})") from None
                del text
                if not isinstance(record, dict) or text_field not in record:
                    raise DataError(f"{source.path}:{number}: no {text_field!r} "
                                    f"field (see --text-field)")
                if not isinstance(record[text_field], str):
                    raise DataError(f"{source.path}:{number}: {text_field!r} is "
                                    f"not a string")
                try:
                    # the string is freed here: the bytes alone are held
                    document = record.pop(text_field).encode("utf-8")
                except UnicodeEncodeError as e:  # JSON allows a lone surrogate
                    raise DataError(f"{source.path}:{number}: {text_field!r} "
                                    f"holds a lone surrogate ({e.reason})") from None
                del record
                yield record_pieces(document)
                del document
    except (OSError, EOFError) as e:
        raise DataError(f"{source.path}: cannot be read ({e})") from None


def read_documents(sources: list[Source], *, text_field: str = "text"
                   ) -> Iterator[Iterator[str]]:
    """
    ## The corpus as documents, each an iterator of text pieces

    Both kinds are cut by `cuts`; consume each document before asking for the
    next.
    """
    for source in sources:
        if source.jsonl:
            yield from jsonl_documents(source, text_field)
        else:
            yield text_pieces(source)
