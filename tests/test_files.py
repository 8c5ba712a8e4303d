"""`labml_zero/files.py`: a crash leaves the old file or directory, or the new one."""

import os

import pytest

from labml_zero import files
from labml_zero.files import (atomic_file, replace_directory, temporary_sibling,
                              write_bytes_atomic)


def test_temporary_sibling_is_hidden_next_to_the_target(tmp_path):
    tmp = temporary_sibling(tmp_path / "ck", "00ab")
    assert tmp == tmp_path / ".ck.tmp-00ab"
    old = temporary_sibling(tmp_path / "ck", "00ab", kind="old")
    assert old == tmp_path / ".ck.old-00ab"
    # random tokens by default: two calls, two names
    assert temporary_sibling(tmp_path / "ck") != temporary_sibling(tmp_path / "ck")


def test_atomic_file_replaces_only_when_the_block_ends(tmp_path):
    target = tmp_path / "sub" / "model.bin"
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"first")
        # nothing at the target while the block writes
        assert not target.exists()
    assert target.read_bytes() == b"first"

    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_file(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"first"
    assert os.listdir(target.parent) == ["model.bin"]

    write_bytes_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["model.bin"]


def test_every_write_is_flushed(tmp_path, monkeypatch):
    """The file and then its directory: the rename must survive a power cut."""
    flushed = []
    real = files.fsync_path
    monkeypatch.setattr(files, "fsync_path",
                        lambda p: (flushed.append(os.path.basename(p)), real(p)))
    write_bytes_atomic(tmp_path / "a.txt", b"x")
    assert flushed[0].startswith(".a.txt.tmp-")
    assert flushed[1:] == [tmp_path.name]


def test_replace_directory_swaps_and_restores(tmp_path, monkeypatch):
    target = tmp_path / "snapshot"
    target.mkdir()
    (target / "old.txt").write_text("old")
    new = temporary_sibling(target)
    new.mkdir()
    (new / "new.txt").write_text("new")
    replace_directory(new, target)
    assert os.listdir(target) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["snapshot"]

    # the second rename fails: the old directory is put back, complete
    newer = temporary_sibling(target)
    newer.mkdir()
    real_rename = os.rename

    def failing(src, dst):
        if src == newer:
            raise OSError("no space left (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="no space left"):
        replace_directory(newer, target)
    monkeypatch.setattr(os, "rename", real_rename)
    assert os.listdir(target) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == sorted(["snapshot", newer.name])


def test_a_safetensors_file_gets_the_mode_open_would_give(tmp_path):
    from safetensors.torch import save_file
    import torch

    from labml_zero.files import current_umask, give_default_mode

    plain = tmp_path / "plain"
    plain.write_text("x")
    shard = tmp_path / "shard.safetensors"
    save_file({"t": torch.zeros(2)}, str(shard))
    give_default_mode(shard)
    assert shard.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 \
        == 0o666 & ~current_umask()


def test_sizes_in_messages_show_their_magnitude():
    # a shortage below 1 GiB reads in MiB, never as 0.0 GiB against 0.0 GiB
    assert files.size_text(2 * 2**20) == "2.00 MiB"
    assert files.size_text(26.2 * 2**20) == "26.2 MiB"
    assert files.size_text(1.04 * 2**30) == "1.04 GiB"
    assert files.size_text(700 * 2**30) == "700 GiB"
    assert files.size_text(1536) == "1.50 KiB"
    assert (files.size_text(1), files.size_text(1023)) == ("1 byte", "1023 bytes")
