"""The last in-rank failures, end to end at world size 2 on CPU: each ends the
job in one line on stderr, with no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_finetune import finetune


@pytest.fixture(scope="module")
def diverged(tmp_path_factory) -> tuple[Path, str]:
    """A run at an absurd learning rate: step 1 is finite (and saved), then not."""
    tmp = tmp_path_factory.mktemp("diverged")
    result = finetune(tmp, "--lr", "1e6", "--steps", "6", "--checkpoint-every", "1",
                      "--sample-tokens", "0")
    assert result.returncode == 1, result.stderr[-3000:]
    return tmp, result.stderr


def test_a_divergence_is_one_line_saying_to_lower_the_learning_rate(diverged):
    _, stderr = diverged
    assert stderr.count("\n") == 1, stderr
    assert "NonFiniteLoss: loss became non-finite at step 2" in stderr, stderr
    assert "lower the learning rate (--lr 1e+06)" in stderr
    assert "update_during_backward" not in stderr and "Traceback" not in stderr


def test_a_damaged_checkpoint_is_refused_in_one_line(diverged):
    tmp, _ = diverged
    checkpoint = tmp / "out" / "checkpoints" / "step-000001"
    shard = checkpoint / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100:-92] = b"\x7f" * 8  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    result = finetune(tmp / "resumed", "--resume", str(checkpoint), "--steps", "3",
                      "--sample-tokens", "0")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"{shard}: checksum mismatch" in result.stderr
