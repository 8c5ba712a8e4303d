"""Run a test body in several gloo processes and collect what each rank returns."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch

from labml_zero import launch


def _collect(ctx: launch.DistContext, fn: Callable, out_dir: str, args: tuple) -> None:
    result = fn(ctx, *args)
    torch.save(result, os.path.join(out_dir, f"rank{ctx.rank}.pt"))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(ctx, *args)` on `world_size` gloo ranks; returns the ranks' results in order.

    `fn` must be a module-level function of an importable module (processes spawn).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        launch.spawn(_collect, world_size, fn, out_dir, args, backend="gloo", timeout_s=120)
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
