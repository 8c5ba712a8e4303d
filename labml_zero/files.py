r"""
---
title: Atomic files
summary: Write a file or a directory so that a crash leaves either the old one or
  the new one, never a part of either.
---

# Atomic files

A checkpoint or an export that a crash cut in half must not load. On a POSIX
filesystem one operation is atomic, `rename(2)` within one filesystem, and one is
durable, `fsync(2)`. Every writer of checkpoints and exports in this project
goes through this page, in the same four steps:

1. write everything under a *temporary sibling* name (`temporary_sibling`);
2. `fsync` every file written, then the temporary directory (its entries are
   data too);
3. `rename` the temporary name to the target;
4. `fsync` the parent directory, so the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_file", "fsync_path", "give_default_mode", "replace_directory",
           "size_text", "temporary_sibling", "write_bytes_atomic"]


def fsync_path(path: str | os.PathLike) -> None:
    """
    Flush a file's data, or a directory's entries, to disk. Durability is what
    `fsync` gives: on a network filesystem that does not honour it, a power cut
    may still lose a rename.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def give_default_mode(path: str | os.PathLike) -> None:
    """
    Set a file's mode to what `open` would create: read and write for all, less
    the process's umask. safetensors creates its files readable by their owner
    only, which would make one file of a checkpoint or an export unreadable to a
    group that can read the rest; every writer calls this on what it wrote.
    """
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask: from `/proc` on Linux, which changes nothing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    # elsewhere it can only be read by setting it; set back at once
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def temporary_sibling(path: str | os.PathLike, token: str | None = None, *,
                      kind: str = "tmp") -> Path:
    """
    ### `.<name>.<kind>-<token>` next to `path`

    Next to the target: same directory, so same filesystem, and the rename in
    step 3 is atomic; a reader that lists the directory skips the dot-name. A
    process killed between steps 1 and 3 leaves its `.tmp-` sibling behind; it is
    never read and may be deleted.

    `token` defaults to random hex digits from `secrets`, which draws from no
    RNG that training uses (a checkpoint saves those RNGs' states).
    """
    path = Path(path)
    token = secrets.token_hex(6) if token is None else token
    return path.parent / f".{path.name}.{kind}-{token}"


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """
    ### Write one file atomically

    Yields a temporary path to write to; when the block ends normally the file
    is flushed and renamed to `path` (replacing any file there), and the
    directory flushed. If the block raises, the temporary file is deleted and
    `path` is untouched. A file can be renamed over an existing file
    (`os.replace`), so replacing a file needs one rename.

    ```python
    with atomic_file(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp))
    ```
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """`path` holds `data`, or what it held before; never a part of `data`."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def replace_directory(tmp: Path, path: Path, token: str | None = None) -> None:
    """
    ### Move a finished directory `tmp` to `path`, replacing what is there

    `tmp` must be complete and flushed (its files and its own entries): this is
    steps 3 and 4 of the introduction, with the old directory moved aside first.
    Replacing an existing *directory* needs two renames (a directory cannot be
    renamed over a non-empty one): the old one goes aside to
    `.<name>.old-<token>`, the new one to the target, then the old one is
    deleted. Between the two renames there is briefly no directory at the target,
    never a partial one; a crash there leaves the old one complete under its
    `.old-` name. If the second rename fails, the old directory is put back.
    """
    old = None
    if path.exists():
        old = temporary_sibling(path, token, kind="old")
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    fsync_path(path.parent)
    if old is not None:
        shutil.rmtree(old)


# ## Sizes in messages


def size_text(n_bytes: int | float) -> str:
    """
    ### A size as a message shows it: three significant digits in its own unit

    Bytes below 1 KiB, then KiB, MiB and GiB (binary units), so a
    shortage of room reads `2.00 MiB free, needs 26.2 MiB`, never `0.0 GiB`
    against `0.0 GiB`. Every message about room on a disk or in memory uses it.
    """
    value = float(n_bytes)
    if abs(value) < 1024:
        return f"{int(value)} byte" + ("" if int(value) == 1 else "s")
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "GiB":
            break
    # as many decimals as keep three significant digits
    decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:,.{decimals}f} {unit}"
