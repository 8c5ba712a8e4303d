"""Where LoRA's exports may go: each refusal is one line and status 2 before any
rank starts (so in process, in seconds), and a previous export of the same kind
is the only thing an export replaces (end to end, two gloo ranks)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from labml_zero.finetune.cli import main
from labml_zero.hf import export_destination
from labml_zero.neox import model as neox_model
from labml_zero.neox.hf_checkpoint import hf_named_tensors, save_hf_checkpoint
from labml_zero.neox.lora_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS,
                                         EXPORT_MARKER, check_export_destination,
                                         export_bytes, write_adapter_dir)
from labml_zero.neox.side_files import SIDE_FILES
from labml_zero.neox.tokenizer import load_tokenizer
from tests.test_finetune import check_ok, finetune


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    """A tiny Hugging Face snapshot, with a tokenizer file an export must not lose."""
    path = tmp_path_factory.mktemp("hf") / "base"
    layers = neox_model.build_layers(neox_model.tiny())
    save_hf_checkpoint(path, neox_model.tiny(), hf_named_tensors(layers))
    # a real tokenizer: the job loads the snapshot's own
    (path / "tokenizer.json").write_text(load_tokenizer().to_str())
    return path


def refused(tmp: Path, snapshot: Path, *args: str, capsys) -> str:
    """Run the command line in process; it must exit 2 with one line."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--finetune", "lora", "--checkpoint", str(snapshot),
              "--out", str(tmp / "out"), "--log-dir", str(tmp / "logs"), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def previous_export(path: Path, kind: str, names: tuple[str, ...]) -> None:
    path.mkdir(parents=True)
    (path / EXPORT_MARKER).write_text(json.dumps({"kind": kind}))
    for name in names:
        (path / name).write_text("old")


def test_a_snapshot_whose_tokenizer_does_not_load_is_refused_in_one_line(
        tmp_path, snapshot, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(snapshot, broken)  # the fixture is shared: break a copy
    (broken / "tokenizer.json").write_text("{}")
    err = refused(tmp_path, broken, capsys=capsys)
    assert "tokenizer.json does not load" in err


def test_an_export_is_never_the_runs_own_output(tmp_path, snapshot, capsys):
    err = refused(tmp_path, snapshot, "--checkpoint-every", "3",
                  "--export-adapter", str(tmp_path / "out"), capsys=capsys)
    assert f"--export-adapter {tmp_path / 'out'} is --out" in err
    assert not (tmp_path / "out").exists()  # nothing made for a refused run


@pytest.mark.parametrize("inside", [("out", "checkpoints"),
                                    ("out", "checkpoints", "merged"),
                                    ("logs", "zero3_neox", "merged")])
def test_an_export_is_never_where_the_run_writes_its_own_files(
        tmp_path, snapshot, capsys, inside):
    # empty at the start, so the export's own rules pass it; by the end it
    # holds the run's checkpoints or logs, and the export would fail after
    # the training
    target = tmp_path.joinpath(*inside)
    err = refused(tmp_path, snapshot, "--checkpoint-every", "3",
                  "--export-merged", str(target), capsys=capsys)
    written = tmp_path.joinpath(*inside[:2])
    assert f"--export-merged {target} is inside {written}, where the run" in err
    assert not target.exists() or not any(target.iterdir())


def test_an_export_is_never_the_base_checkpoint(tmp_path, snapshot, capsys):
    err = refused(tmp_path, snapshot, "--export-merged", str(snapshot),
                  capsys=capsys)
    assert "is --checkpoint" in err
    assert (snapshot / "tokenizer.json").is_file()


def test_an_export_is_never_above_the_log_dir(tmp_path, snapshot, capsys):
    err = refused(tmp_path, snapshot, "--log-dir", str(tmp_path / "a" / "logs"),
                  "--export-adapter", str(tmp_path / "a"), capsys=capsys)
    assert "contains --log-dir" in err


def test_one_export_is_never_inside_the_other(tmp_path, snapshot, capsys):
    err = refused(tmp_path, snapshot, "--export-merged", str(tmp_path / "m"),
                  "--export-adapter", str(tmp_path / "m" / "adapter"),
                  capsys=capsys)
    assert "contains --export-adapter" in err


def test_a_directory_of_other_files_is_refused(tmp_path, snapshot, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    err = refused(tmp_path, snapshot, "--export-adapter", str(mine), capsys=capsys)
    assert "holds files that are not an earlier export" in err and "notes.txt" in err
    assert (mine / "notes.txt").read_text() == "keep me"


def test_the_home_directory_is_refused(tmp_path, snapshot, capsys, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("")
    monkeypatch.setenv("HOME", str(home))
    err = refused(tmp_path, snapshot, "--export-adapter", "~", capsys=capsys)
    assert "holds files that are not an earlier export" in err
    assert (home / ".bashrc").exists()


def test_an_export_of_the_other_kind_is_refused(tmp_path, snapshot, capsys):
    merged = tmp_path / "merged"
    previous_export(merged, "merged_checkpoint", ("config.json",))
    err = refused(tmp_path, snapshot, "--export-adapter", str(merged), capsys=capsys)
    assert "not an earlier export of this kind" in err and "config.json" in err


def test_a_file_is_refused(tmp_path, snapshot, capsys):
    file = tmp_path / "adapter"
    file.write_text("data")
    err = refused(tmp_path, snapshot, "--export-adapter", str(file), capsys=capsys)
    assert "is a file, not a directory" in err
    assert file.read_text() == "data"


def test_a_destination_that_cannot_be_written_is_refused(tmp_path, snapshot,
                                                         capsys):
    # /proc/self takes no new files, even for root
    err = refused(tmp_path, snapshot, "--export-merged", "/proc/self/merged",
                  capsys=capsys)
    assert "--export-merged /proc/self/merged is not writable" in err


def test_a_destination_without_room_is_refused(tmp_path, snapshot, capsys,
                                               monkeypatch):
    usage = export_destination.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(export_destination.shutil, "disk_usage",
                        lambda path: usage._replace(free=1000))
    err = refused(tmp_path, snapshot, "--export-merged", str(tmp_path / "m"),
                  capsys=capsys)
    # both sizes in units that show them: not 0.0 GiB against 0.0 GiB
    assert re.search(r"has 1000 bytes free, the export needs [1-9][\d.]* MiB",
                     err), err


def test_an_adapter_needs_a_base_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--finetune", "lora", "--out", str(tmp_path / "out"),
              "--log-dir", str(tmp_path / "logs"),
              "--export-adapter", str(tmp_path / "a")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--export-adapter needs --checkpoint" in err


def test_export_sizes_follow_the_model():
    neox = neox_model.tiny()
    layers = neox_model.build_layers(neox, device="meta")
    base = sum(p.numel() for layer in layers for p in layer.parameters())
    from labml_zero.finetune.config import FinetuneConfig
    FinetuneConfig(finetune="lora").tuner()(layers)
    adapters = sum(p.numel() for layer in layers
                   for n, p in layer.named_parameters() if "lora_" in n)
    assert export_bytes(layers, "lora_adapter", torch.bfloat16) == 4 * adapters
    # the checkpoint is written in one dtype (the base's or the training one),
    # trainable weights too: 2 bytes each in bf16, the adapters folded in
    assert export_bytes(layers, "merged_checkpoint", torch.bfloat16) == 2 * base


def test_the_writer_refuses_what_appeared_after_the_checks(tmp_path):
    # between the checks and the end of training someone put a file there
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "later.txt").write_text("keep")
    with pytest.raises(ValueError, match="not an earlier export"):
        write_adapter_dir(out, {}, {"a": torch.zeros(1)}, overwrite=True)
    assert (out / "later.txt").read_text() == "keep"
    # a previous adapter export is replaced whole
    write_adapter_dir(tmp_path / "fresh", {"r": 1}, {"a": torch.zeros(1)},
                      overwrite=True)
    write_adapter_dir(tmp_path / "fresh", {"r": 2}, {"a": torch.ones(1)},
                      overwrite=True)
    assert json.loads((tmp_path / "fresh" / ADAPTER_CONFIG).read_text()) == {"r": 2}
    assert check_export_destination(tmp_path / "fresh", "lora_adapter",
                                    flag="x", protected={}) == tmp_path / "fresh"


def test_an_earlier_export_is_replaced(tmp_path: Path, snapshot: Path):
    # both directories hold a previous export of their kind (old files, marker)
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    previous_export(adapter_dir, "lora_adapter", (ADAPTER_CONFIG, ADAPTER_WEIGHTS))
    previous_export(merged_dir, "merged_checkpoint",
                    ("config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"))
    result = finetune(tmp_path / "run", "--checkpoint", str(snapshot),
                      "--finetune", "lora", "--steps", "2", "--sample-tokens", "0",
                      "--export-adapter", str(adapter_dir),
                      "--export-merged", str(merged_dir))
    check_ok(result)
    assert sorted(p.name for p in adapter_dir.iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPORT_MARKER])
    assert json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["r"] > 0
    # the checkpoint comes with its tokenizer and generation defaults
    assert sorted(p.name for p in merged_dir.iterdir()) == sorted(
        ["config.json", "model.safetensors", EXPORT_MARKER, *SIDE_FILES[:2],
         "generation_config.json"])
    assert not list(tmp_path.glob(".*")), "no temporary or old directory is left"


def test_export_hf_is_checked_for_every_finetune(tmp_path, snapshot, capsys):
    # a full fine-tune exports too, under the same rules: never the base
    with pytest.raises(SystemExit) as exit_info:
        main(["--finetune", "all", "--checkpoint", str(snapshot),
              "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs"),
              "--export-hf", str(snapshot)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--export-hf {snapshot} is --checkpoint" in err


@pytest.mark.parametrize("args, message", [
    (["--finetune", "lora", "--export-merged", "a", "--export-hf", "b"],
     "export_merged is the older name of export_hf"),
    (["--finetune", "all", "--export-hf", "d", "--export-adapter", "d"],
     "export_adapter needs finetune 'lora'"),
    (["--finetune", "lora", "--export-hf", "d", "--export-adapter", "d"],
     "export_hf and export_adapter must be different directories"),
    (["--finetune", "all", "--export-hf", "d", "--filter-layers", "0"],
     "export_hf needs the whole model"),
])
def test_export_flags_that_contradict(tmp_path, args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs"),
              *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_merged_alias_names_the_same_export():
    from labml_zero.finetune.config import FinetuneConfig

    config = FinetuneConfig(finetune="lora", export_merged="m")
    assert config.export_hf == "m"
