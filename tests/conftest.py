"""Fixtures for every test."""

import os
import signal

import pytest

from tests.distributed import cli_on_cpu


@pytest.fixture(autouse=True, scope="session")
def signals_as_from_a_terminal():
    """A shell that starts the tests in the background (`nohup`, `cmd &` in a
    script) hands them SIGHUP or SIGINT ignored, and the job keeps a signal
    ignored at its launch ignored in every rank, by design (tested in
    test_launch.py). The tests that send these signals expect what a terminal
    gives, so the session gets a terminal's dispositions, and gives the
    inherited ones back at its end."""
    terminal = {signal.SIGINT: signal.default_int_handler,
                signal.SIGHUP: signal.SIG_DFL}
    inherited = {signum: signal.signal(signum, handler)
                 for signum, handler in terminal.items()}
    yield
    for signum, handler in inherited.items():
        signal.signal(signum, handler)


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
