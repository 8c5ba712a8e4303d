"""Fixtures for every test."""

import pytest

from tests.distributed import cli_on_cpu


@pytest.fixture(autouse=True)
def command_line_on_cpu(monkeypatch):
    cli_on_cpu(monkeypatch)
