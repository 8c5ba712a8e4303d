r"""
---
title: Sharded checkpoints
summary: Each rank saves its own shards in parallel, with digests; resume is
  bit-exact, a checkpoint loads at any world size, and a launcher checks one
  before any process starts.
---

# Sharded checkpoints

A ZeRO-3 rank holds $\frac{1}{N_d}$ of every chunk, so a checkpoint is those
shards, one file per rank, written in parallel and never gathered
([saving](save.html) counts its bytes). It must give a
{{term: bit-exact resume}} (every step after the load computes what the uninterrupted run computed, to the last bit), load at
any world size or chunk size ({{term: resharding}}), and either load exactly or
be refused with one line naming the file.
"""

# ## Pages in this folder
#
# Each page is one concept, and each line below imports its public names; saving
# writes through [atomic files](../../files.html).
#
# {{contents}}
#
# ## In use
#
# ```python
# save_checkpoint(out / "step-000100", model, optimizer, extra=extra,
#                 meta={"step": 100, "batch_size": 16, "seed": 0})
# prune_checkpoints(out, keep=3)                       # on rank 0
# ...
# info = check_resumable(out / "step-000100", world_size=2,
#                        shapes=sequential_shapes(meta_layers),
#                        expect={"batch_size": 16, "seed": 0})
# loaded = load_checkpoint(info.path, model, optimizer)
# ```
from .export import (consolidated_tensors, export_full_state_dict, prefix_rename,
                     saved_tensors)
from .format import CheckpointError
from .load import LoadedCheckpoint, load_checkpoint
from .preflight import (CheckpointInfo, check_resumable, sequential_parameters,
                        sequential_shapes, sequential_trainables)
from .pruning import prune_checkpoints
from .reader import CheckpointReader
from .save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointReader",
    "LoadedCheckpoint",
    "check_resumable",
    "consolidated_tensors",
    "export_full_state_dict",
    "load_checkpoint",
    "prefix_rename",
    "prune_checkpoints",
    "save_checkpoint",
    "saved_tensors",
    "sequential_parameters",
    "sequential_shapes",
    "sequential_trainables",
]
