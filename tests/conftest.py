"""Fixtures for every test."""

import os

import pytest

from tests.distributed import cli_on_cpu


@pytest.fixture(autouse=True)
def command_line_on_cpu(monkeypatch):
    cli_on_cpu(monkeypatch)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` record CUDA graphs or time kernels: they run where
    `LABML_ZERO_TEST_DEVICE=cuda` (the device machine) and are deselected, each
    with a CPU twin beside it, where the tests run on the CPU."""
    if os.environ.get("LABML_ZERO_TEST_DEVICE", "cpu") == "cuda":
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item not in gpu]
