"""`bench/export_memory.py` on CPU: the tiny model saved with and without
masters, exported by a child process, one line each; it removes what it
wrote and keeps the folders it was given."""

from __future__ import annotations

import json

import pytest

from bench import export_memory


@pytest.mark.distributed
def test_a_line_per_model_with_and_without_masters(tmp_path):
    out = tmp_path / "lines.jsonl"
    work, ckpts = tmp_path / "work", tmp_path / "ckpts"
    for frozen in (["--frozen"], []):
        export_memory.main(["--model", "tiny", *frozen, "--dir", str(work),
                            "--checkpoint-dir", str(ckpts), "--out", str(out)])
    frozen, trained = [json.loads(line) for line in out.read_text().splitlines()]
    assert (frozen["masters"], trained["masters"]) == (False, True)
    # the same bf16 export either way; the largest tensor read is the bf16
    # weight, or its fp32 master: twice the bytes
    assert frozen["export_bytes"] == trained["export_bytes"] > 0
    assert trained["largest_tensor_read_bytes"] == 2 * frozen["largest_tensor_read_bytes"]
    assert frozen["peak_rss_bytes"] > frozen["largest_tensor_read_bytes"]
    # what it wrote is gone; the folders it was given stay
    assert work.is_dir() and ckpts.is_dir()
    assert not any(work.iterdir()) and not any(ckpts.iterdir())
