r"""
---
title: Keeping the newest checkpoints
summary: Old checkpoints are removed only once a newer one is complete, and only
  directories that are checkpoints of this layout.
---

# Keeping the newest checkpoints

A job that saves every $n$ steps fills its disk: each checkpoint holds every
shard, master and moment. `prune_checkpoints(directory, keep)` keeps the `keep`
newest and removes the others, under six rules, each beside its lines, that
make it safe to call after every save: only after the newest is complete, only
checkpoints of this layout, never half removed, leftovers go, only what a save
wrote, and, when asked, only this run's.

With $k$ = `keep`, the disk holds at most $k + 1$ checkpoints: the $k$ kept ones
and, during a save, the new one being written.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

from ...files import temporary_sibling
from .format import MANIFEST, CheckpointError
from .reader import CheckpointReader

__all__ = ["checkpoint_dirs", "foreign_entries", "is_complete",
           "prune_checkpoints"]

STEP_NAME = re.compile(r"step-(\d{6,})")
"""`step-NNNNNN`: the fine-tune's `checkpoints/step-{step:06d}`."""
LEFTOVER_NAME = re.compile(r"\.step-\d{6,}\.(tmp|pruned)-[0-9A-Za-z_-]+")
"""A killed save's temporary directory, or a crashed prune's (rule 4)."""


def checkpoint_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """
    `(step, path)` of every `step-NNNNNN` directory, by step.

    Rule 2, **only checkpoints of this layout**: a candidate is a directory named
    `step-NNNNNN` (at least six digits, as the fine-tune names them) that is
    itself a complete checkpoint. Anything else in the directory (a half-written
    `step-…`, a `.tmp-` sibling, a file, a directory of notes) is left alone.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = STEP_NAME.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def is_complete(path: str | os.PathLike) -> bool:
    """
    A valid manifest and every file it lists, at its size. Not the digests:
    reading every byte of every old checkpoint at each save would cost more than
    the save.
    """
    try:
        CheckpointReader(path)
    except CheckpointError:
        return False
    return True


def foreign_entries(path: str | os.PathLike) -> list[str]:
    """What a complete checkpoint's directory holds beside its manifest and the
    files the manifest lists: what its save did not write."""
    written = {name.split("/")[0] for name in CheckpointReader(path).manifest["files"]}
    return sorted(entry.name for entry in Path(path).iterdir()
                  if entry.name not in written | {MANIFEST})


def prune_checkpoints(directory: str | os.PathLike, keep: int, *,
                      just_saved: str | os.PathLike | None = None,
                      same_meta: str | None = None) -> list[Path]:
    r"""
    ## Remove all but the `keep` newest complete checkpoints

    Call it on one rank (rank 0), after `save_checkpoint` returned on every
    rank.

    * `directory` holds the `step-NNNNNN` checkpoints.
    * `keep` $\geq 1$ is how many to keep, counting the newest.
    * `just_saved` is the checkpoint the job has just written: it is the newest
      whatever its step (a job that resumed from an earlier step may find later
      ones from a previous run) and is never removed.
    * `same_meta` names a key of the manifests' `meta` that says which run
      wrote a checkpoint (the fine-tune's `lineage`): only checkpoints with
      `just_saved`'s value count, kept or removed (rule 6).

    Returns the removed paths, oldest first; `[]` when the newest is not
    complete.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
    found = [path for _, path in checkpoint_dirs(directory)]
    if just_saved is not None:
        newest = Path(just_saved)
        if newest.parent.resolve() != Path(directory).resolve():
            raise ValueError(f"just_saved {newest} is not in {directory}")
        found = [p for p in found if p.name != newest.name] + [newest]
    # Rule 1, **only after the newest is complete**: the newest checkpoint (the
    # highest step, or `just_saved`) must have a valid manifest and every file it
    # lists, at its recorded size; otherwise nothing is removed, because the older
    # ones may be the only ones that load.
    if not found or not is_complete(found[-1]):
        return []
    complete = [path for path in found if is_complete(path)]
    # Rule 6, **only this run's**: with `same_meta`, a checkpoint another run
    # wrote into the same directory is neither counted nor removed.
    if same_meta is not None:
        owner = CheckpointReader(found[-1]).meta.get(same_meta)
        complete = [path for path in complete
                    if CheckpointReader(path).meta.get(same_meta) == owner]
    # Rule 4, **leftovers go**: a save killed outright (`SIGKILL`, a power cut)
    # cannot remove its `.step-NNNNNN.tmp-<id>` directory, nor a crash mid-delete
    # its `.pruned-` one, and nothing loads either. This job's own save is
    # complete, so every such directory is a leftover of one that was killed.
    for entry in Path(directory).iterdir():
        if LEFTOVER_NAME.fullmatch(entry.name) and entry.is_dir() \
                and not entry.is_symlink():
            shutil.rmtree(entry)
    removed = []
    for path in complete[:-keep]:
        # Rule 5, **only what a save wrote**: a checkpoint that holds anything
        # else (an export written into it, a user's notes) is kept, and said.
        foreign = foreign_entries(path)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            warnings.warn(f"kept checkpoint {path}: it holds {foreign[0]!r}{more}, "
                          f"which its save did not write")
            continue
        # Rule 3, **never half removed**: renamed first to a hidden
        # `.step-NNNNNN.pruned-<token>` name, which nothing loads, then deleted;
        # a crash during the deletion leaves a hidden directory, not a checkpoint
        # with files missing.
        aside = temporary_sibling(path, kind="pruned")
        os.rename(path, aside)
        shutil.rmtree(aside)
        removed.append(path)
    return removed
