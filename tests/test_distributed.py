"""The test harness's own rule: a test needing more GPUs than the machine has is
skipped under NCCL (one GPU per rank), and runs under gloo at any world size."""

import pytest
import torch

from tests import distributed
from tests.distributed import gpus_missing, run_distributed, skip_job_without_gpus


def test_nccl_needs_one_gpu_per_rank():
    assert gpus_missing(1, "nccl", 1) is None
    assert gpus_missing(2, "nccl", 1) == (
        "world_size 2 needs 2 GPUs, this machine has 1")
    assert gpus_missing(3, "nccl", 8) is None
    # gloo puts every rank on the CPU
    assert gpus_missing(6, "gloo", 0) is None


def never_called(ctx):
    raise AssertionError("a skipped test must not spawn its ranks")


def test_run_distributed_skips_on_too_few_gpus(monkeypatch):
    # a one-GPU NCCL machine, faked: the skip happens before any process starts
    monkeypatch.setattr(distributed, "BACKEND", "nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception,
                       match="world_size 2 needs 2 GPUs, this machine has 1"):
        run_distributed(never_called, 2)


def test_the_fine_tune_job_is_skipped_on_too_few_gpus(monkeypatch):
    # where CUDA is, the job itself takes NCCL: one GPU a rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    skip_job_without_gpus(1)
    with pytest.raises(pytest.skip.Exception,
                       match="world_size 4 needs 4 GPUs, this machine has 1"):
        skip_job_without_gpus(4)
    # without CUDA it runs on gloo at any size
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    skip_job_without_gpus(4)
