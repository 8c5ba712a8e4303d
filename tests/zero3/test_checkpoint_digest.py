"""Digests: every file of a checkpoint is checked before it is used; a changed
file is refused in one line naming it, and nothing is loaded."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from labml_zero.zero3.checkpoint import (CheckpointError, CheckpointReader,
                                         load_checkpoint, save_checkpoint)
from labml_zero.zero3.checkpoint import reader as reader_module
from labml_zero.zero3.checkpoint.digest import (file_digest, pack_digest,
                                                unpack_digest)
from labml_zero.zero3.checkpoint.format import FORMAT_1
from tests.zero3.test_checkpoint import Local, build, train, weights


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Two fp32 checkpoints of one model after 2 and 3 steps (so the same sizes)."""
    root = tmp_path_factory.mktemp("digest")
    model, optimizer = build(Local, torch.float32, chunk_numel=64)
    train(Local, model, optimizer, range(2))
    save_checkpoint(root / "a", model, optimizer, extra={"step": 2})
    train(Local, model, optimizer, range(2, 3))
    save_checkpoint(root / "b", model, optimizer, extra={"step": 3})
    return root


@pytest.fixture
def ck(saved, tmp_path) -> Path:
    """A fresh copy of checkpoint `a`, for one test to damage."""
    return Path(shutil.copytree(saved / "a", tmp_path / "ck"))


def refused_unchanged(path: Path) -> str:
    """Load into a fresh model: must raise, and leave the model as it was."""
    model, optimizer = build(Local, torch.float32, chunk_numel=64, seed=5)
    before = weights(model)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, model, optimizer)
    after = weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not optimizer.state
    message = str(raised.value)
    assert "\n" not in message
    return message


def tensor_bytes(file: Path, key: str) -> tuple[int, int]:
    """Where a tensor's data lies in a safetensors file: [start, end) bytes."""
    data = file.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    start, end = header[key]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


SHARD = "rank-00000.safetensors"


def test_manifest_records_every_files_sha256(saved):
    manifest = json.loads((saved / "a" / "manifest.json").read_text())
    assert sorted(manifest["digests"]) == sorted(manifest["files"])
    for name, digest in manifest["digests"].items():
        expected = hashlib.sha256((saved / "a" / name).read_bytes()).hexdigest()
        assert digest == f"sha256:{expected}" == file_digest(saved / "a" / name)


def test_digest_survives_the_collective_encoding():
    digest = file_digest(__file__)
    packed = pack_digest(digest)
    assert packed.dtype == torch.int32 and packed.shape == (32,)
    assert unpack_digest(packed) == digest


def test_random_bytes_in_the_middle_of_a_shard(ck):
    shard = ck / SHARD
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2 - 2048)
        f.write(os.urandom(4096))
    assert shard.stat().st_size == size
    message = refused_unchanged(ck)
    assert message == (f"{shard}: checksum mismatch, the file was changed after "
                       "it was saved")


def test_one_flipped_exponent_bit(ck):
    shard = ck / SHARD
    start, _ = tensor_bytes(shard, "0.param")
    data = bytearray(shard.read_bytes())
    # bit 30 of an fp32 is the top bit of its exponent, 0 below 2 in magnitude:
    # setting it adds 128 to the exponent
    (value,) = struct.unpack("<f", data[start : start + 4])
    assert 0 < abs(value) < 2
    data[start + 3] ^= 0x40
    (flipped,) = struct.unpack("<f", data[start : start + 4])
    assert flipped == value * 2.0**128
    shard.write_bytes(bytes(data))
    assert refused_unchanged(ck) == (f"{shard}: checksum mismatch, the file was "
                                     "changed after it was saved")


def test_a_shard_swapped_in_from_another_save(ck, saved):
    shutil.copyfile(saved / "b" / SHARD, ck / SHARD)
    assert (ck / SHARD).stat().st_size == (saved / "a" / SHARD).stat().st_size
    assert refused_unchanged(ck) == (f"shard file {ck / SHARD} belongs to another "
                                     "save than its manifest")


def test_a_garbled_header(ck):
    shard = ck / SHARD
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00\x01garbage-garbage-garbage-garba"
    shard.write_bytes(bytes(data))
    message = refused_unchanged(ck)
    assert message.startswith(f"corrupted shard file {shard}: ")


@pytest.mark.parametrize("name", ["rank-00000.pt", "extra.pt"])
def test_the_small_files_are_checked_too(ck, name):
    file = ck / name
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    assert refused_unchanged(ck) == (f"{file}: checksum mismatch, the file was "
                                     "changed after it was saved")


def test_a_manifest_of_format_2_must_have_digests(ck):
    manifest = json.loads((ck / "manifest.json").read_text())
    del manifest["digests"]
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert refused_unchanged(ck) == (f"corrupted manifest {ck / 'manifest.json'}: "
                                     "no 'digests'")


def test_format_1_loads_without_digests(ck, saved):
    """A checkpoint written before digests: loads, and a changed byte is not seen."""
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["format"] = FORMAT_1
    del manifest["digests"], manifest["meta"]
    (ck / "manifest.json").write_text(json.dumps(manifest))
    model, optimizer = build(Local, torch.float32, chunk_numel=64, seed=5)
    load_checkpoint(ck, model, optimizer)
    expected = CheckpointReader(saved / "a")
    loaded = weights(model)
    assert all(torch.equal(loaded[n].reshape(-1), expected.read(n, "param"))
               for n in loaded)
    # the limitation, as documented: a flipped bit in format 1 goes unseen
    start, _ = tensor_bytes(ck / SHARD, "0.param")
    data = bytearray((ck / SHARD).read_bytes())
    data[start + 3] ^= 0x40
    (ck / SHARD).write_bytes(bytes(data))
    load_checkpoint(ck, model, optimizer)
    assert weights(model)["0.weight"].abs().max() > 1e30


def test_verify_files_reads_every_file_once(ck, monkeypatch):
    hashed = []
    real = reader_module.file_digest
    monkeypatch.setattr(reader_module, "file_digest",
                        lambda file: (hashed.append(Path(file).name), real(file))[1])
    reader = CheckpointReader(ck)
    reader.verify_files()
    reader.verify_files()
    assert sorted(hashed) == sorted(reader.manifest["files"])
    monkeypatch.undo()
    file = ck / "rank-00000.pt"
    file.write_bytes(file.read_bytes()[::-1])
    with pytest.raises(CheckpointError, match=r"rank-00000\.pt: checksum mismatch"):
        CheckpointReader(ck).verify_files()
