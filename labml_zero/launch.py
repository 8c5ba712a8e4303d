"""
---
title: Launching processes
summary: One process per GPU (NCCL) or several CPU processes (gloo); torchrun.
---

# Launching processes

ZeRO runs one process per rank. This page starts them and is the only place that
creates or destroys the process group:

* **one host**: `spawn(fn, world_size)` starts `world_size` processes with
  `torch.multiprocessing`, rendezvous on loopback at a free port; with CUDA each
  process takes GPU `rank` and NCCL, without it gloo on CPU;
* **torchrun** (several hosts): the processes already exist and `RANK`,
  `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` say who they are;
  `run_torchrun(fn)` reads them.

Either way `fn(ctx)` receives a `DistContext` with the rank, the world size and the
device.

## Failure

If a process raises or dies, `torch.multiprocessing` terminates the others and
`spawn` raises in the parent with the failing rank's traceback; no process waits
forever on a collective its peer will never join. Under torchrun, torchrun does the
same. The process group's timeout (`timeout_s`) bounds the rest.

## Limitations

* On one host every rank must see the same number of GPUs (`CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class DistContext:
    """
    ## Who this process is

    * `rank`, `world_size`: its place in the process group.
    * `local_rank`: its place on this host (the GPU it uses).
    * `device`: `cuda:<local_rank>` or `cpu`.
    * `backend`: `nccl` or `gloo`.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(
    rank: int, world_size: int, local_rank: int, *, backend: str, timeout_s: float
) -> DistContext:
    """Create the process group for this process and pick its device."""
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return DistContext(rank, world_size, local_rank, device, backend)


def _worker(
    local_rank: int,
    fn: Callable[..., Any],
    world_size: int,
    backend: str,
    addr: str,
    port: int,
    timeout_s: float,
    args: tuple,
) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)
    if backend == "gloo":
        # Ranks share the host's cores: one thread each keeps them from fighting.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ctx = init(local_rank, world_size, local_rank, backend=backend, timeout_s=timeout_s)
    try:
        fn(ctx, *args)
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> None:
    """
    ## Run `fn(ctx, *args)` in `world_size` processes on this host

    `fn` must be importable (a module-level function) because the processes are
    started with `spawn`, not `fork` (CUDA cannot be forked).
    """
    backend = backend or default_backend()
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"world_size {world_size} needs {world_size} GPUs, "
            f"found {torch.cuda.device_count()}"
        )
    port = free_port()
    mp.spawn(
        _worker,
        args=(fn, world_size, backend, "127.0.0.1", port, timeout_s, args),
        nprocs=world_size,
        join=True,
    )


def under_torchrun() -> bool:
    return (
        "RANK" in os.environ
        and "WORLD_SIZE" in os.environ
        and "LOCAL_RANK" in os.environ
    )


def run_torchrun(
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> None:
    """
    ## Run `fn(ctx, *args)` in a process started by torchrun
    """
    backend = backend or default_backend()
    ctx = init(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["LOCAL_RANK"]),
        backend=backend,
        timeout_s=timeout_s,
    )
    try:
        fn(ctx, *args)
    finally:
        dist.destroy_process_group()
