r"""
---
title: File digests
summary: Each checkpoint file's SHA-256, recorded when it is saved and checked
  before it is loaded, so a changed byte is refused rather than trained on.
---

# File digests

A file's size and its safetensors header catch a truncated or garbled file, but
not a changed byte inside the tensor data: a few KiB of garbage in a shard, or
one flipped exponent bit, which multiplies an fp32 weight below 2 in magnitude
by $2^{128}$ (tested:
tests/zero3/test_checkpoint_digest.py::test_one_flipped_exponent_bit), load
without complaint and train to NaN. So every file of a checkpoint has its
digest in the manifest,

$$h = \text{SHA-256}(\text{the file's bytes}),$$

written as `"sha256:<hex digits>"`, and a reader recomputes $h$ before it
uses a file.
"""

from __future__ import annotations

import hashlib
import os

import torch

__all__ = ["file_digest", "pack_digest", "unpack_digest"]

ALGORITHM = "sha256"
"""The `hashlib` name, also the prefix of every recorded digest. SHA-256 because a
checkpoint is an input someone may hand you: a cryptographic hash cannot be matched
by accident nor, in practice, on purpose; and `hashlib`'s is OpenSSL's, which uses
the CPU's SHA instructions where there are some."""
DIGEST_BYTES = 32
"""Bytes of a SHA-256 digest."""


def file_digest(file: str | os.PathLike) -> str:
    """
    ### `"sha256:<hex>"` of a file, read in blocks (`hashlib.file_digest`)

    Streamed through the hash in blocks, so checking a file costs one sequential
    read and no memory beyond one block. Each rank hashes the files it wrote,
    after they are flushed, so it hashes what is on disk and the ranks hash in
    parallel; rank 0 collects the digests into the manifest
    ([saving](save.html)). A digest tells *that* a file changed, not *where*:
    the reader then looks at the file's header and save id to say more when it
    can. The manifest itself has no digest: it is JSON that is parsed and
    checked key by key, and a changed manifest changes what every file is
    checked against.
    """
    with open(file, "rb") as f:
        digest = hashlib.file_digest(f, ALGORITHM)
    return f"{ALGORITHM}:{digest.hexdigest()}"


# ## Digests through a collective
#
# The ranks' digests reach rank 0 through one all-reduce: rank $r$ writes its
# digests' bytes into row $r$ of a zero tensor and the sum over ranks is every
# row filled. Integer sums are exact, so the bytes arrive unchanged.


def pack_digest(digest: str) -> torch.Tensor:
    """`"sha256:<hex>"` as its `DIGEST_BYTES` bytes, one per `int32` element."""
    algorithm, _, hex_digits = digest.partition(":")
    assert algorithm == ALGORITHM, digest
    # [DIGEST_BYTES] int32, each a byte value; any backend sums int32
    return torch.tensor(list(bytes.fromhex(hex_digits)), dtype=torch.int32)


def unpack_digest(packed: torch.Tensor) -> str:
    """The inverse of `pack_digest`."""
    return f"{ALGORITHM}:{bytes(packed.tolist()).hex()}"
