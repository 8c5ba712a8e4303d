"""`prune_checkpoints`: older checkpoints go only after the newest is complete,
and nothing that is not a complete checkpoint of this layout is touched."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from labml_zero.zero3.checkpoint import prune_checkpoints, save_checkpoint
from labml_zero.zero3.checkpoint.pruning import checkpoint_dirs, is_complete
from tests.zero3.test_checkpoint import Local, build, train


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prune") / "one"
    model, optimizer = build(Local, torch.bfloat16, chunk_numel=64)
    train(Local, model, optimizer, range(1))
    save_checkpoint(path, model, optimizer)
    return path


def run_dir(root: Path, one: Path, steps) -> Path:
    """`checkpoints/step-NNNNNN` copies of one checkpoint, plus things to keep."""
    out = root / "checkpoints"
    for step in steps:
        shutil.copytree(one, out / f"step-{step:06d}")
    (out / "notes").mkdir()
    (out / "step-000000.txt").write_text("a file with a checkpoint-like name")
    (out / "step-12").mkdir()  # too few digits: not the fine-tune's layout
    (out / "step-000001").mkdir()  # a step directory with no manifest
    (out / "step-000001" / "mine.txt").write_text("keep me")
    (out / LEFTOVER).mkdir()  # a save that was killed (SIGKILL)
    (out / LEFTOVER / "rank-00000.safetensors").write_bytes(b"half")
    return out


LEFTOVER = ".step-000009.tmp-0123"
OTHERS = ["notes", "step-000000.txt", "step-12", "step-000001"]


def listing(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def test_keeps_the_newest_and_removes_only_checkpoints(tmp_path, one):
    out = run_dir(tmp_path, one, [2, 4, 6, 8])
    assert [step for step, _ in checkpoint_dirs(out)] == [1, 2, 4, 6, 8]
    removed = prune_checkpoints(out, keep=2)
    assert removed == [out / "step-000002", out / "step-000004"]
    # the killed save's temporary directory went with the first prune
    assert listing(out) == sorted(OTHERS + ["step-000006", "step-000008"])
    assert (out / "step-000001" / "mine.txt").read_text() == "keep me"
    # idempotent, and `keep` larger than what is there removes nothing
    assert prune_checkpoints(out, keep=2) == []
    assert prune_checkpoints(out, keep=10) == []
    assert prune_checkpoints(out, keep=1) == [out / "step-000006"]
    assert is_complete(out / "step-000008")


def test_a_checkpoint_holding_what_its_save_did_not_write_is_kept(tmp_path, one):
    """Rule 5: an export or a note written into an old checkpoint keeps it,
    said in one warning; the others go as before."""
    out = run_dir(tmp_path, one, [2, 4, 6])
    (out / "step-000002" / "hf").mkdir()
    (out / "step-000002" / "hf" / "model.safetensors").write_bytes(b"mine")
    with pytest.warns(UserWarning, match=r"kept checkpoint .*step-000002: it "
                      r"holds 'hf', which its save did not write"):
        removed = prune_checkpoints(out, keep=1)
    assert removed == [out / "step-000004"]
    assert (out / "step-000002" / "hf" / "model.safetensors").read_bytes() == b"mine"
    assert is_complete(out / "step-000002") and is_complete(out / "step-000006")


def test_nothing_is_removed_until_the_newest_is_complete(tmp_path, one):
    out = run_dir(tmp_path, one, [2, 4])
    # a newest step directory whose save has not finished (no manifest yet)
    shutil.copytree(one, out / "step-000006")
    (out / "step-000006" / "manifest.json").unlink()
    assert prune_checkpoints(out, keep=1) == []
    # one whose shard file is cut short
    (out / "step-000006" / "manifest.json").write_bytes(
        (one / "manifest.json").read_bytes())
    shard = out / "step-000006" / "rank-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert prune_checkpoints(out, keep=1) == []
    # until then, leftovers too stay: nothing is touched
    assert listing(out) == sorted(OTHERS + [LEFTOVER, "step-000002",
                                            "step-000004", "step-000006"])


def test_the_checkpoint_just_saved_is_never_removed(tmp_path, one):
    """A job resumed from step 2 into a directory with a later, older run's step 8."""
    out = run_dir(tmp_path, one, [2, 3, 8])
    removed = prune_checkpoints(out, keep=1, just_saved=out / "step-000003")
    assert removed == [out / "step-000002", out / "step-000008"]
    assert (out / "step-000003").is_dir()
    with pytest.raises(ValueError, match="is not in"):
        prune_checkpoints(out, keep=1, just_saved=tmp_path / "step-000003")


@pytest.mark.parametrize("keep", [0, -1, 1.5, True, "2"])
def test_keep_must_be_a_positive_integer(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        prune_checkpoints(tmp_path, keep=keep)


def test_a_missing_directory_has_nothing_to_prune(tmp_path):
    assert prune_checkpoints(tmp_path / "nowhere", keep=3) == []


def test_every_file_of_a_checkpoint_has_the_same_mode(one):
    # safetensors alone would make the shards owner-only beside 0644 files
    modes = {p.name: p.stat().st_mode & 0o777 for p in one.iterdir()}
    assert len(set(modes.values())) == 1, modes
