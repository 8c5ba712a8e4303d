"""`check_resumable`: a launcher refuses a resume that cannot work from the
manifest alone, in one line, before any process (or process group) exists."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labml_zero.zero3.checkpoint import (CheckpointError, CheckpointInfo,
                                         check_resumable, save_checkpoint,
                                         sequential_shapes)
from labml_zero.zero3.checkpoint.state import model_shapes
from tests.zero3.models import tiny_layers
from tests.zero3.test_checkpoint import Local, build, train

META = {"step": 2, "batch_size": 6, "seed": 0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("preflight") / "step-000002"
    model, optimizer = build(Local, torch.bfloat16, chunk_numel=64)
    train(Local, model, optimizer, range(2))
    save_checkpoint(path, model, optimizer, meta=META)
    return path


def one_line(call) -> str:
    with pytest.raises(CheckpointError) as raised:
        call()
    assert "\n" not in str(raised.value)
    return str(raised.value)


def test_sequential_shapes_are_the_engines_names():
    model, _ = build(Local, torch.float32)
    meta_layers = [layer.to("meta") for layer in tiny_layers()]
    assert sequential_shapes(meta_layers) == model_shapes(model.chunks)


def test_what_the_job_needs_to_compare(saved):
    shapes = sequential_shapes(tiny_layers())
    info = check_resumable(saved, world_size=1, shapes=shapes,
                           expect={"batch_size": 6, "seed": 0, "not saved": 1})
    assert info == CheckpointInfo(path=saved, world_size=1, resharded=False,
                                  optimizer_step=2, meta=META, verified=False)
    # another world size is fine: the load reshards
    info = check_resumable(saved, world_size=3, verify=True)
    assert (info.resharded, info.verified) == (True, True)
    # no process group was needed for any of it
    assert not dist.is_initialized()


def test_refused_in_one_line(saved, tmp_path):
    assert one_line(lambda: check_resumable(tmp_path / "nowhere", world_size=1)) \
        == f"no checkpoint at {tmp_path / 'nowhere'}"
    file = tmp_path / "notes.txt"
    file.write_text("not a checkpoint")
    assert one_line(lambda: check_resumable(file, world_size=1)) == (
        f"{file} is a file, not a checkpoint directory")
    assert one_line(lambda: check_resumable(tmp_path, world_size=1)) == (
        f"no manifest.json in {tmp_path}: not a checkpoint, or a save that did "
        "not finish")

    layers = tiny_layers()
    layers[4] = nn.Linear(13, 6)
    message = one_line(lambda: check_resumable(
        saved, world_size=1, shapes=sequential_shapes(layers)))
    assert message == (f"checkpoint {saved} is of a different model: parameter "
                       "'4.weight' has shape (5, 13) in the checkpoint, (6, 13) in "
                       "the model")

    assert one_line(lambda: check_resumable(
        saved, world_size=2, expect={"batch_size": 8})) == (
        f"checkpoint {saved} was saved with batch_size=6, this job has 8")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        check_resumable(saved, world_size=0)


def test_verify_reads_every_digest(saved, tmp_path):
    copy = Path(shutil.copytree(saved, tmp_path / "copy"))
    pt = copy / "rank-00000.pt"
    data = bytearray(pt.read_bytes())
    data[-1] ^= 0xFF
    pt.write_bytes(bytes(data))
    # without `verify` only the manifest and the sizes are read
    check_resumable(copy, world_size=1)
    assert one_line(lambda: check_resumable(copy, world_size=1, verify=True)) == (
        f"{pt}: checksum mismatch, the file was changed after it was saved")


def test_meta_must_be_json(tmp_path):
    model, optimizer = build(Local, torch.float32, chunk_numel=64)
    with pytest.raises(CheckpointError, match=r"^meta must hold only JSON values"):
        save_checkpoint(tmp_path / "ck", model, optimizer,
                        meta={"lr": float("nan")})
    with pytest.raises(CheckpointError, match=r"^meta must be a dict"):
        save_checkpoint(tmp_path / "ck", model, optimizer, meta=[1])
    assert list(tmp_path.iterdir()) == []
