"""Run a test body in several gloo processes and collect what each rank returns."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from labml_zero import launch


def _collect(ctx: launch.DistContext, fn: Callable, out_dir: str, args: tuple) -> None:
    result = fn(ctx, *args)
    # Results travel through files; move tensors off the GPU first.
    result = _to_cpu(result)
    torch.save(result, os.path.join(out_dir, f"rank{ctx.rank}.pt"))
    # The result is on disk: end the process without the interpreter's teardown,
    # where torch 2.13's gloo sometimes aborts ("terminate called without an
    # active exception", about one run in six of the checkpoint tests) after all
    # the work is done, which mp.spawn would report as a failed rank.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The same tests run on GPUs with NCCL when this says `nccl` (on the device machine).
BACKEND = os.environ.get("LABML_ZERO_TEST_BACKEND", "gloo")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def gpus_missing(world_size: int, backend: str, gpus: int) -> str | None:
    """Why `world_size` ranks cannot run on this machine, or `None` if they can.

    NCCL takes one GPU per rank; gloo runs any number of ranks on the CPU.
    `gpus` is passed in (not read here) so the rule is tested without a GPU.
    """
    if backend == "nccl" and world_size > gpus:
        return (f"world_size {world_size} needs {world_size} GPUs, "
                f"this machine has {gpus}")
    return None


def cli_on_cpu(monkeypatch) -> None:
    """Make the command line, run in this process, start gloo ranks on the CPU.

    The CLI picks NCCL, one GPU a rank, wherever CUDA is. The tests that call
    its `main` in process check its refusals before start and its small CPU
    runs at 2 to 4 ranks: they must give the same result on a one-GPU machine
    as on CI's. (`tests/conftest.py` applies this to every test; a job started
    as a subprocess picks for itself and is skipped where it cannot run, by
    `skip_job_without_gpus`.)
    """
    monkeypatch.setattr(launch, "default_backend", lambda: "gloo")


# How a job started as a subprocess picks its backend, whatever `cli_on_cpu`
# makes this process's command line pick.
job_backend = launch.default_backend


def skip_job_without_gpus(world_size: int) -> None:
    """Skip a test that starts the fine-tune job at `world_size` where it cannot
    run: the job takes NCCL and one GPU a rank wherever CUDA is
    (`launch.default_backend`), gloo on the CPU otherwise."""
    backend = job_backend()
    reason = gpus_missing(world_size, backend,
                          torch.cuda.device_count() if backend == "nccl" else 0)
    if reason is not None:
        pytest.skip(reason)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(ctx, *args)` on `world_size` ranks; returns the ranks' results in order.

    gloo on CPU by default, NCCL when `LABML_ZERO_TEST_BACKEND=nccl`; under NCCL
    a test that needs more GPUs than the machine has is skipped, with that reason.
    `fn` must be a module-level function of an importable module (processes spawn).
    """
    reason = gpus_missing(world_size, BACKEND,
                          torch.cuda.device_count() if BACKEND == "nccl" else 0)
    if reason is not None:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory() as out_dir:
        launch.spawn(
            _collect, world_size, fn, out_dir, args, backend=BACKEND, timeout_s=120
        )
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
