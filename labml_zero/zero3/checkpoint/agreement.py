r"""
---
title: Agreement between ranks
summary: Every phase of a save or a load ends with the ranks agreeing that all of
  them succeeded, so no rank waits forever and none goes on alone.
---

# Agreement between ranks

A rank that fails alone must neither leave the others waiting in a collective
nor let them go on with a half-saved checkpoint or a half-loaded model. So each
phase of a [save](save.html) or a [load](load.html) ends with an all-reduce of
one failure flag per rank,

$$f = \sum_{r} f_r \, e_r, \qquad f_r = 1 \text{ if rank } r \text{ failed},$$

($e_r$ the $r$-th unit vector), and if any flag is set, every rank raises.
"""

from __future__ import annotations

import secrets
from typing import Callable

import torch

from ..communication import Communicator
from .digest import DIGEST_BYTES, pack_digest, unpack_digest
from .format import CheckpointError

__all__ = ["agree", "agree_save_id", "gather_digests", "run_agreed"]


def agree(comm: Communicator, error: BaseException | None, what: str) -> None:
    """
    ### Raise on every rank if any rank failed; `error` is this rank's

    The failing rank raises its own error, the others "failed on rank $k$",
    $k$ the first rank whose flag is set: they learn *that* it failed, not why.
    A load reads everything into host memory *before* this agreement and
    changes the model only after it, so a refused checkpoint changes nothing. Each agreement is an all-reduce, counted by the
    communicator's `CommCounter` like the training collectives.
    """
    # [N_d] int32, one flag per rank
    flags = torch.zeros(comm.world_size, dtype=torch.int32, device=comm.device)
    flags[comm.rank] = int(error is not None)
    comm.all_reduce(flags)
    # host sync: every rank must know the outcome before going on
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0]}; see its error")


def run_agreed(comm: Communicator, fn: Callable[[], None], what: str) -> None:
    """Run one phase on this rank, then agree on the outcome. Collectives
    of the same kind carry the two other things ranks must share, below: the save
    id and the digests."""
    error = None
    try:
        fn()
    except Exception as caught:
        error = caught
    agree(comm, error, what)


def agree_save_id(comm: Communicator) -> str:
    """
    The save id: a random id drawn by rank 0 and summed into every rank (the
    others add 0).
    """
    # `secrets`, not `random`: the save must not move the RNG state it saves
    token = torch.tensor([secrets.randbits(48) if comm.rank == 0 else 0],
                         dtype=torch.int64, device=comm.device)
    comm.all_reduce(token)
    # host sync: .item()
    return f"{token.item():012x}"


def gather_digests(comm: Communicator, digests: list[str]) -> list[list[str]]:
    """
    ### Every rank's digests, on every rank

    The digests each rank computed of its own files. `digests` is this rank's
    list, of the same length on every rank; returns one list per rank, in rank
    order. See "Digests through a collective" on
    [the digest page](digest.html).
    """
    # [N_d, n, DIGEST_BYTES] int32: row r is rank r's digests, zero elsewhere
    # before the sum
    table = torch.zeros(comm.world_size, len(digests), DIGEST_BYTES,
                        dtype=torch.int32)
    for i, digest in enumerate(digests):
        table[comm.rank, i] = pack_digest(digest)
    table = table.to(comm.device)
    comm.all_reduce(table)
    # host sync: device-to-host copy
    table = table.cpu()
    return [[unpack_digest(row) for row in per_rank] for per_rank in table]
