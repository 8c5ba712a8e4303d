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

and any sample is one slice of it. The file is built once per corpus and
tokenizer, cached beside the data, and read memory-mapped by every rank.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, NamedTuple

import numpy as np
from tokenizers import Tokenizer

from labml_zero.files import atomic_file
from labml_zero.finetune.corpus import DataError, Source, find_sources, read_documents

__all__ = ["TOKEN_DTYPES", "is_token_file", "open_token_file", "cache_path",
           "build_token_file", "corpus_tokens", "token_dtype", "BATCH_BYTES",
           "TokenCache", "FileStamp", "prepare_token_file", "open_cache",
           "vocab_size", "checked_token_file"]

# Suffix → dtype of a pre-tokenised file. A file written by another tool
# (nanoGPT's train.bin, say) is used as it is; its size must be a whole number
# of tokens, every id below the vocabulary size, and its width plausible (see
# Note: a token file of the wrong width), all checked before any rank starts.
TOKEN_DTYPES = {".u16": np.uint16, ".uint16": np.uint16, ".bin": np.uint16,
                ".u32": np.uint32, ".uint32": np.uint32}
# Text per `encode_batch` call: enough pieces to keep every core busy.
BATCH_BYTES = 2 << 20
# Ids scanned at a time when checking a token file against the vocabulary.
SCAN_TOKENS = 1 << 24
DEFAULT_CACHE = Path.home() / ".cache" / "labml_zero" / "tokens"
# Bump when the file's layout or its key changes, so old caches get a new key.
FORMAT_VERSION = 2
# Bytes read at a time for a data file's digest.
DIGEST_BLOCK = 1 << 20


def vocab_size(tokenizer: Tokenizer) -> int:
    """$V$, the ids the tokenizer can produce, its added tokens included."""
    return tokenizer.get_vocab_size(with_added_tokens=True)


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
    `check_ids`) holds an id of at least `vocab` or looks twice as wide; the
    scan reads the file once, in blocks of `SCAN_TOKENS` ids.

    #### Note: why a memory map

    `np.memmap` maps the file into the process's address space without reading
    it: a page (4 KiB) is read from disk when a sample first touches it, and the
    kernel may drop it again when memory is short, since it can always be read
    back. So each rank holds only the pages of the samples it reads, the
    loader's resident memory does not grow with the corpus, ranks on one host
    share the page cache (one copy of a hot page for all of them), and opening a
    corpus larger than memory costs nothing.

    #### Note: a token file of the wrong width

    A `uint32` file read as `uint16` (nanoGPT-style `.bin` files come in both)
    passes the other checks: its ids fit in a `uint16`, so each is one
    little-endian `uint16` followed by a zero high half, every one below the
    vocabulary. Read as `uint16` it is the true ids interleaved with zeros, and
    a model trains on it without complaint. So a `uint16` file whose every odd
    token is 0 is refused, naming the width it looks like. The reverse, a
    `uint16` file read as `uint32`, pairs two ids into one larger than any
    `uint16`, past any vocabulary that fits one, and the vocabulary check
    refuses it.
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
    if not check_ids:
        return tokens
    odd_halves_zero = dtype == np.uint16 and len(tokens) % 2 == 0
    for start in range(0, len(tokens), SCAN_TOKENS):  # even: keeps halves aligned
        block = tokens[start:start + SCAN_TOKENS]
        if int(block.max()) >= vocab:
            at = start + int(np.argmax(block >= vocab))
            raise DataError(f"--data {path}: token {at} is id {int(tokens[at])},"
                            f" not below the vocabulary size {vocab}")
        odd_halves_zero = odd_halves_zero and not block[1::2].any()
    if odd_halves_zero:
        raise DataError(f"--data {path}: every second uint16 token is 0, as in a "
                        f"uint32 token file read as uint16; name it .u32 if it "
                        f"is one")
    return tokens


# ## The cache


class FileStamp(NamedTuple):
    """What a data file was when the launcher read it."""

    path: str
    """Resolved."""
    size: int
    mtime_ns: int
    digest: str
    """BLAKE2b-128 of the content, hex."""


def file_digest(path: Path) -> str:
    """The file's BLAKE2b-128, read in blocks of `DIGEST_BLOCK` bytes."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(DIGEST_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def stamp(path: Path) -> FileStamp:
    status = path.stat()
    return FileStamp(str(path.resolve()), status.st_size, status.st_mtime_ns,
                     file_digest(path))


class TokenCache(NamedTuple):
    """
    ## The token file the launcher decided on, handed to the ranks

    Built or found once, on the launcher's host; a rank opens it with
    `open_cache`, which first checks that `stamps` still hold.
    """

    data: str
    """`--data` (or `--valid-data`) as given."""
    path: Path
    """The token file."""
    key: str
    stamps: tuple[FileStamp, ...]
    """The data files as they were tokenised."""


def sources_key(stamps: list[FileStamp], tokenizer: Tokenizer, *, eot: int,
                text_field: str | None) -> str:
    """
    What the token file depends on, hashed: each file's path, size and content
    digest (not its time: touching a file re-tokenises nothing), the tokenizer,
    the separator and the JSON field.
    """
    facts = {"files": [(s.path, s.size, s.digest) for s in stamps], "eot": eot,
             "version": FORMAT_VERSION, "text_field": text_field,
             "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest()}
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def cache_dir(data: Path) -> Path:
    return data.parent if os.access(data.parent, os.W_OK) else DEFAULT_CACHE


def cache_prefix(data: Path) -> str:
    """`.<name>.<path id>.`: every cache of this `--data` path, and only its."""
    path_id = hashlib.sha256(str(data).encode()).hexdigest()[:8]
    return f".{data.name}.{path_id}."


def cache_path(data: str | os.PathLike, key: str, dtype: type) -> Path:
    """
    #### `.<name>.<path id>.<key>.tokens.u16` beside `data`, or in `DEFAULT_CACHE`

    Hidden, so a directory corpus never reads it back as text; in
    `~/.cache/labml_zero/tokens/` where the data's directory is not writable.
    The key hashes each file's content, so a stale cache is never read, and the
    second run finds the file and starts at once.
    """
    data = Path(data).resolve()
    suffix = ".u16" if dtype == np.uint16 else ".u32"
    return cache_dir(data) / f"{cache_prefix(data)}{key}.tokens{suffix}"


def prune_caches(data: str | os.PathLike, keep: Path) -> list[Path]:
    """
    #### Remove this `--data` path's older token files

    Only names this builder writes: `.<name>.<path id>.<key>.tokens.u16|u32`
    for this path, and, beside the data, the names of `FORMAT_VERSION` 1
    (`.<name>.<key>.tokens.u16|u32`, no path id: beside the data, the name
    alone says whose it is).
    """
    data = Path(data).resolve()
    names = [re.escape(cache_prefix(data)) + r"[0-9a-f]{16}\.tokens\.u(16|32)"]
    if cache_dir(data) == data.parent:
        names.append(re.escape(f".{data.name}.") + r"[0-9a-f]{16}\.tokens\.u(16|32)")
    ours = re.compile("|".join(f"(?:{n})" for n in names))
    removed = []
    for path in keep.parent.iterdir():
        if path != keep and ours.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def uncompressed_bytes(source: Source) -> int:
    """A file's size, or a gzip's as its trailer records it (modulo 4 GiB)."""
    size = source.path.stat().st_size
    if not source.gzipped or size < 4:
        return size
    with open(source.path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return max(size, int.from_bytes(f.read(4), "little"))


def check_room(data: str | os.PathLike, sources: list[Source], path: Path,
               itemsize: int) -> int:
    r"""
    #### Refuse to start a token file the disk cannot hold; returns its bound

    A byte-level BPE token covers at least one byte of text, and each document
    adds one end-of-text token and has at least one byte of its own (a JSON
    Lines line more: its braces and quotes), so a corpus of $b$ bytes in $f$
    files is at most $(b + f)$ tokens, $(b + f)\,s$ bytes. That bound is about
    four times the usual size of English text, so the check is cautious.
    It is a bound only: a disk that fills while the file is written still
    stops the build in one line, leaving no file.
    """
    need = (sum(uncompressed_bytes(s) for s in sources) + len(sources)) * itemsize
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise DataError(f"--data {data}: its token file {path} needs up to "
                        f"{need / 1e6:,.1f} MB and {path.parent} has "
                        f"{free / 1e6:,.1f} MB free ({(need - free) / 1e6:,.1f} "
                        f"MB short)")
    return need


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


def write_ids(f: BinaryIO, ids: np.ndarray) -> None:
    """Append `ids`; through `write`, so a full disk is an `OSError` with errno."""
    f.write(ids.data)


def build_token_file(sources: list[Source], tokenizer: Tokenizer, path: Path, *,
                     eot: int, text_field: str = "text",
                     batch_bytes: int = BATCH_BYTES) -> int:
    """
    ### Tokenise `sources` into the token file at `path`; returns its length

    1. the [corpus](corpus.html) is read as documents, in pieces;
    2. pieces are gathered into batches of about `BATCH_BYTES` and tokenised
       with `encode_batch`, which spreads a batch over all cores in Rust;
    3. after each document's last piece comes the end-of-text token, so the
       packed samples (see [the dataset](dataset.html)) know where one
       document ends and the next begins;
    4. the ids are appended to a temporary file, renamed when complete.

    Written to a temporary sibling and renamed when complete, so an interrupted
    or refused build (a `DataError`, an `Interrupted` signal, a full disk)
    leaves no file that a later run would trust, nor any other.
    """
    dtype = token_dtype(tokenizer)
    total = sum(s.path.stat().st_size for s in sources)
    progress = Progress(sources[0].path.name if len(sources) == 1
                        else f"{len(sources)} files", total)
    n_tokens = n_text = 0
    end = np.array([eot], dtype=dtype)
    try:
        with atomic_file(path) as tmp, open(tmp, "wb") as f:
            for pieces, ends in batches(read_documents(sources,
                                                       text_field=text_field),
                                        batch_bytes):
                # parallel over the batch's pieces, in Rust (no GIL)
                encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
                for encoding, last in zip(encodings, ends):
                    ids = np.asarray(encoding.ids, dtype=dtype)  # [n] uint16|32
                    write_ids(f, ids)
                    n_text += len(ids)
                    if last:
                        write_ids(f, end)
                    n_tokens += len(ids) + last
                progress.advance(sum(len(p.encode()) for p in pieces))
            if n_text == 0:
                raise DataError(f"--data {sources[0].path}: no text (every "
                                f"document is empty)")
    except OSError as e:  # reading the data is a DataError already: this is writing
        written = n_tokens * np.dtype(dtype).itemsize
        raise DataError(f"{path}: cannot write the token file after "
                        f"{written / 1e6:,.1f} MB ({e.strerror or e}); "
                        f"{shutil.disk_usage(path.parent).free / 1e6:,.1f} MB "
                        f"free there") from None
    progress.finish(n_tokens, path)
    return n_tokens


# ## Deciding once
#
# Under spawn the launcher decides before any rank starts and hands the
# decision, a `TokenCache`, to the ranks. Under torchrun every process is a
# launcher, so each decides; a lock beside the cache lets one of a host's
# processes build it while the others wait, then find it built.


def lock_path(data: str | os.PathLike) -> Path:
    """`.<name>.<path id>.tokens.lock`: the build lock of `data`'s caches."""
    data = Path(data).resolve()
    return cache_dir(data) / f"{cache_prefix(data)}tokens.lock"


@contextmanager
def build_lock(data: str | os.PathLike) -> Iterator[None]:
    """
    ### Hold `data`'s build lock: one builder per host

    #### Note: one builder per host

    Limitations: `flock(2)` is one builder per host. Hosts that share the
    cache's filesystem each build it unless that filesystem carries `flock`
    between hosts (Linux's NFS client does, as a whole-file lock; others may
    not); the atomic rename keeps that safe, not cheap. Build it first with
    `prepare_token_file` for a large corpus on several hosts. POSIX only, as
    `fcntl` is.

    Under torchrun every process runs the launcher's checks, so every process
    of a host may find the token file missing at once. Each takes an exclusive
    `flock(2)` on the lock file before looking again: the first builds, the
    others wait in the kernel and then find the file built (their stamps and
    key are their own, so `open_cache` checks the data as always).

    * The lock file is a hidden name of this path's caches (`lock_path`), and
      not one that `prune_caches` removes: the builder holds it while pruning.
    * The holder removes the name before it lets go, so no lock file is left
      behind. A waiter may then hold a lock on a file without a name, which
      locks out no one; so after taking it, a process checks that the name
      still points at the file it locked (same device and inode), and starts
      again if not.
    * A process that dies holding it, even by `SIGKILL`, releases it (the
      kernel drops a lock when its last descriptor closes); the name it
      leaves is locked and removed by the next builder. It leaves no partial
      token file: the build renames a complete file into place, or none.
    """
    path = lock_path(data)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise DataError(f"--data {data}: cannot open its token file's lock "
                            f"{path} ({e.strerror or e})") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another process tokenizing {data} ({path})",
                      flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks; a signal interrupts it
            locked = os.fstat(fd)
            try:
                named = os.stat(path)
            except FileNotFoundError:
                named = None
        except BaseException:
            os.close(fd)
            raise
        if named and (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino):
            break
        os.close(fd)  # the holder before removed that name: lock the new one
    try:
        yield
    finally:
        # still holding it: a process that opens the name now creates a new file
        path.unlink(missing_ok=True)
        os.close(fd)


def prepare_token_file(data: str | os.PathLike, tokenizer: Tokenizer, *, eot: int,
                       text_field: str = "text") -> TokenCache:
    """
    ## The launcher's decision: build or find `data`'s token file

    ### Note: deciding once

    1. The launcher *stamps* each source file: size, modification time and a
       BLAKE2b digest of its content, read in blocks of `DIGEST_BLOCK` (one
       read of the corpus at the disk's speed, far cheaper than tokenising it).
    2. The key hashes every file's path, size and digest, the tokenizer's whole
       definition, the end-of-text id and the JSON field: any change of the
       content makes a new key, a rewrite that keeps size and time included.
    3. A missing file is built after checking that its disk has room
       (`check_room`); then this path's older token files are removed
       (`prune_caches`: only names this builder writes).
    4. The ranks get the decision, a `TokenCache`, and do not decide again:
       `open_cache` compares each file's size and time with its stamp and
       digests it again (from the page cache when the corpus fits), and a file
       changed since stops the rank in one line naming it, before any step.

    Under torchrun each process is its own launcher and runs steps 1 to 3;
    the build in step 3 is done under `build_lock` (see Note: one builder per
    host), so one process of a host builds and the others find its file.
    """
    sources = find_sources(data)
    stamps = [stamp(s.path) for s in sources]
    uses_field = text_field if any(s.jsonl for s in sources) else None
    key = sources_key(stamps, tokenizer, eot=eot, text_field=uses_field)
    dtype = token_dtype(tokenizer)
    path = cache_path(data, key, dtype)
    # a token file appears whole (renamed into place), so one found needs no lock
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with build_lock(data):
            # another process may have built it while this one waited
            if not path.is_file():
                check_room(data, sources, path, np.dtype(dtype).itemsize)
                build_token_file(sources, tokenizer, path, eot=eot,
                                 text_field=text_field)
                prune_caches(data, path)
    return TokenCache(str(data), path, key, tuple(stamps))


def open_cache(cache: TokenCache, *, vocab: int) -> np.ndarray:
    """
    ## A rank's side: the launcher's token file, if its data is unchanged

    A file whose size or time differs, or whose content digest does (a rewrite
    that kept both), changed after the launcher tokenised it: the token file
    is no longer its tokens, so the rank stops before any step instead of
    training on them or tokenising again.
    """
    for was in cache.stamps:
        path = Path(was.path)
        try:
            status = path.stat()
        except OSError:
            status = None
        if status is None:
            what = "it is gone"
        elif status.st_size != was.size:
            what = f"{was.size:,} bytes then, {status.st_size:,} now"
        elif status.st_mtime_ns != was.mtime_ns:
            what = "its modification time differs"
        elif file_digest(path) != was.digest:
            what = "same size and time, other content"
        else:
            continue
        raise DataError(f"--data {path}: changed since the launcher read it "
                        f"({what}); start the run again to read it anew")
    if not cache.path.is_file():
        raise DataError(f"--data {cache.data}: its token file {cache.path} is gone")
    # ids of our own tokenizer: below its vocabulary by construction
    return open_token_file(cache.path, vocab=vocab, check_ids=False)


def checked_token_file(data: str | os.PathLike, *, vocab: int) -> TokenCache:
    """
    ## The launcher's decision for a token file: checked once, then stamped

    A token file is its own "token file": the launcher scans its ids against
    the vocabulary (`open_token_file`) and stamps it, so a rank opens it through
    `open_cache` like text's, and a file rewritten between the two (ids the
    scan never saw) stops the rank instead of training on them.
    """
    path = Path(data)
    open_token_file(path, vocab=vocab)
    return TokenCache(str(data), path, "", (stamp(path),))


def corpus_tokens(data: str | os.PathLike, tokenizer: Tokenizer, *, eot: int,
                  text_field: str = "text", check_ids: bool = True,
                  cache: TokenCache | None = None) -> np.ndarray:
    """
    ## `--data` as token ids, memory-mapped

    A token file is opened as it is. Text is opened through `cache`, the
    launcher's decision, when a rank has one; else it is decided here
    (`prepare_token_file`).
    """
    if is_token_file(data):
        return open_token_file(data, vocab=vocab_size(tokenizer),
                               check_ids=check_ids)
    if cache is None:
        cache = prepare_token_file(data, tokenizer, eot=eot, text_field=text_field)
    return open_cache(cache, vocab=vocab_size(tokenizer))
