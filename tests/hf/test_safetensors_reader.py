"""The shared reader's own refusals (labml_zero/hf/safetensors_reader.py); the
families' tests read real snapshots through it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from labml_zero.hf.safetensors_reader import (SafetensorsSnapshot,
                                              SnapshotFileMissing, Wanted)
from labml_zero.hf.snapshot_layout import shard_file_name
from labml_zero.zero3.checkpoint import CheckpointError


def test_a_missing_snapshot_is_both_a_checkpoint_error_and_not_found(tmp_path):
    # GPT-NeoX's callers catch FileNotFoundError, the launcher CheckpointError
    for path in (tmp_path / "nope", tmp_path):
        with pytest.raises(SnapshotFileMissing) as raised:
            SafetensorsSnapshot(path)
        assert isinstance(raised.value, FileNotFoundError)
        assert isinstance(raised.value, CheckpointError)


def test_a_shape_is_checked_before_its_tensor_is_read(tmp_path):
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4)},
              str(tmp_path / "model.safetensors"))
    snapshot = SafetensorsSnapshot(tmp_path)
    assert snapshot.weight_map == {"a": "model.safetensors",
                                   "b": "model.safetensors"}
    out = snapshot.read_tensors({"ours": Wanted("b", (4,))}, dtype=torch.bfloat16)
    assert out["ours"].dtype == torch.bfloat16 and out["ours"].sum() == 4
    with pytest.raises(CheckpointError, match=r"tensor 'a' in .* has shape "
                                              r"\(2, 3\), the model expects "
                                              r"\(3, 2\) \(from config.json's d\)"):
        snapshot.read_tensors({"a": Wanted("a", (3, 2))}, shape_from=lambda n: "d")
    with pytest.raises(CheckpointError, match="no tensor 'c'"):
        snapshot.check_tensors({"c": (1,)})


def test_an_index_that_names_no_files_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": ["x"]}}))
    with pytest.raises(CheckpointError, match="maps 'a' to list"):
        SafetensorsSnapshot(tmp_path)


def test_shard_names_as_transformers_writes_them():
    assert shard_file_name(0, 1) == "model.safetensors"
    assert [shard_file_name(k, 3) for k in range(3)] == [
        f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    with pytest.raises(ValueError, match="shard 3 of 3"):
        shard_file_name(3, 3)
