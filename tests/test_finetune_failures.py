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


def test_more_ranks_than_the_host_can_hold_are_refused(tmp_path, capsys,
                                                       monkeypatch):
    from labml_zero.finetune.cli import main
    from labml_zero.finetune import preflight

    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 8 * 2**30)
    with pytest.raises(SystemExit) as exit_info:
        main(["--world-size", "16", "--out", str(tmp_path / "out"),
              "--log-dir", str(tmp_path / "logs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--world-size 16: this host would run 16 ranks, about 16." in err
    assert "and has 8.00 GiB available" in err


RANK_PEAK = """
import resource, sys
from labml_zero.finetune.cli import main
status = main(sys.argv[1:])
# the largest peak resident size of a process this one waited for: a rank's
print("peak", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(status)
"""


def test_a_rank_fits_its_estimate(tmp_path):
    import os
    import subprocess
    import sys

    from labml_zero.finetune.preflight import RANK_BASE_BYTES
    from tests.test_finetune import REPO, SMALL
    from tests.distributed import skip_job_without_gpus

    skip_job_without_gpus(2)  # SMALL's world size

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", RANK_PEAK, *SMALL, "--steps", "3",
         "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    peak = int(result.stdout.split("peak ")[-1])
    # an estimate, not a bound of the allocator: within a factor of two, above
    assert RANK_BASE_BYTES / 2 < peak <= RANK_BASE_BYTES, peak / 2**20
