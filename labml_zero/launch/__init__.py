"""
---
title: Processes
summary: Starting one process per rank (or joining torchrun's), and watching them so
  that a failing, hanging or interrupted rank ends the whole job with one line.
---

# Processes

ZeRO runs one process per rank. This package starts them (`spawn`, or
`run_torchrun` under torchrun) and watches them, and is the only code that
creates or destroys the process group; its public names are re-exported here.
"""

from .spawn import (DistContext, Heartbeat, Interrupted, RankFailed, default_backend,
                    free_port, ranks_text, run_torchrun, spawn, under_torchrun)

__all__ = ["DistContext", "Heartbeat", "Interrupted", "RankFailed", "spawn",
           "run_torchrun", "under_torchrun", "free_port", "default_backend",
           "ranks_text"]
