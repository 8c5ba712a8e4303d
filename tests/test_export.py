"""`labml_zero/export.py` and `--export-hf`: every fine-tune goes back to Hugging
Face. Two short runs (all parameters, LoRA) from a bf16 snapshot save a sharded
checkpoint and export at the end; the offline command turns the checkpoint
into the same checkpoint, tensor for tensor, which transformers loads with the
job's tokenizer; bad input is one line and status 2, with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from labml_zero import export
from labml_zero.neox import model as neox_model
from labml_zero.neox.hf_checkpoint import (HFCheckpoint, hf_named_tensors,
                                           load_layers, save_hf_checkpoint)
from labml_zero.neox.lora_export import EXPORT_MARKER
from labml_zero.neox.tokenizer import encode, load_tokenizer
from labml_zero.zero3.checkpoint import CheckpointReader, prefix_rename
from tests import tolerance
from tests.neox.test_lora_export import probe_ids
from tests.test_finetune import check_ok, finetune

TEXT = "First Citizen: Before we proceed any further, hear me speak."


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    """A tiny bf16 snapshot with its own tokenizer file."""
    path = tmp_path_factory.mktemp("hf") / "base"
    torch.manual_seed(3)
    layers = neox_model.build_layers(neox_model.tiny())
    save_hf_checkpoint(path, neox_model.tiny(), hf_named_tensors(layers),
                       dtype=torch.bfloat16)
    (path / "tokenizer.json").write_text(load_tokenizer().to_str())
    return path


def run(tmp: Path, snapshot: Path, finetune_kind: str) -> Path:
    """A 2-step run at world size 2 that saves step 2 and exports at the end."""
    result = finetune(tmp, "--checkpoint", str(snapshot), "--finetune",
                      finetune_kind, "--steps", "2", "--checkpoint-every", "2",
                      "--lr", "3e-2", "--sample-tokens", "0",
                      "--export-hf", str(tmp / "hf"))
    check_ok(result)
    return tmp


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, snapshot) -> Path:
    return run(tmp_path_factory.mktemp("all"), snapshot, "all")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, snapshot) -> Path:
    return run(tmp_path_factory.mktemp("lora"), snapshot, "lora")


def saved(run_dir: Path) -> Path:
    return run_dir / "out" / "checkpoints" / "step-000002"


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("model*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}
    return out


def exported(argv: list[str]) -> Path:
    assert export.main(argv) == 0
    return Path(argv[1])


def test_the_job_exports_a_full_fine_tune_in_the_base_dtype(full_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = full_run / "hf"
    # the base is bf16: the CPU run trained in fp32, the export is bf16 again
    assert {t.dtype for t in tensors(hf).values()} == {torch.bfloat16}
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.dtype == torch.bfloat16
    # the tokenizer encodes as the job's did, not to [] (issue: 2-token tokenizer)
    ids = AutoTokenizer.from_pretrained(hf)(TEXT)["input_ids"]
    assert ids == encode(load_tokenizer(), TEXT) and len(ids) > 5
    eot = load_tokenizer().token_to_id("<|endoftext|>")
    assert json.loads((hf / "generation_config.json").read_text())[
        "eos_token_id"] == eot


def test_the_offline_export_is_the_jobs_tensor_for_tensor(full_run, tmp_path):
    out = exported([str(saved(full_run)), str(tmp_path / "again")])
    ours, jobs = tensors(out), tensors(full_run / "hf")
    assert ours.keys() == jobs.keys()
    for name in ours:
        assert torch.equal(ours[name], jobs[name]), name


def test_fp32_export_holds_the_masters_and_gives_the_engines_logits(full_run,
                                                                     tmp_path):
    from transformers import AutoModelForCausalLM

    out = exported([str(saved(full_run)), str(tmp_path / "fp32"), "--dtype",
                    "float32", "--max-shard-size", "100KB"])
    # sharded above the size, with an index
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    # every tensor is the checkpoint's fp32 master, exactly
    reader = CheckpointReader(saved(full_run))
    record = reader.meta["export"]
    rename = prefix_rename(record["prefixes"])
    written = tensors(out)
    assert len(written) == len(reader.params)
    for name, param in reader.params.items():
        assert torch.equal(written[rename(name)],
                           reader.read(name, "master").view(param.shape)), name
    # transformers' logits are our model's on those weights (tests/tolerance.py)
    checkpoint = HFCheckpoint(out)
    layers = neox_model.build_layers(checkpoint.config)
    load_layers(checkpoint, layers)
    ids = probe_ids(checkpoint.config.n_vocab)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        ours = torch.nn.Sequential(*layers)(ids)
    torch.testing.assert_close(theirs, ours, **tolerance.parity(
        torch.float32, terms=tolerance.neox_terms(checkpoint.config,
                                                  seq=ids.shape[1])))


def test_lora_checkpoint_exports_merged_as_the_job_did(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = exported([str(saved(lora_run)), str(tmp_path / "merged")])
    ours, jobs = tensors(out), tensors(lora_run / "hf")
    assert not any("lora" in name for name in ours)
    assert ours.keys() == jobs.keys()
    for name in ours:
        assert torch.equal(ours[name], jobs[name]), name
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_an_earlier_export_is_replaced_and_nothing_else(full_run, tmp_path,
                                                        capsys):
    out = exported([str(saved(full_run)), str(tmp_path / "e")])
    (out / "model.safetensors").write_bytes(b"stale")
    exported([str(saved(full_run)), str(out)])
    assert tensors(out)  # the stale file was replaced by a whole export
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert export.main([str(saved(full_run)), str(other)]) == 2
    assert "not an earlier export" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def one_line_refusal(argv: list[str], capsys) -> str:
    assert export.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line_and_nothing_is_written(full_run, tmp_path, capsys):
    ckpt = saved(full_run)
    # the checkpoint itself, or a directory above it
    err = one_line_refusal([str(ckpt), str(ckpt.parent)], capsys)
    assert "contains CHECKPOINT" in err
    assert one_line_refusal([str(tmp_path / "none"), str(tmp_path / "o")],
                            capsys).startswith("error: no checkpoint at")
    err = one_line_refusal([str(ckpt), str(tmp_path / "o"), "--tokenizer",
                            str(tmp_path / "gone.json")], capsys)
    assert "--tokenizer" in err and "not found" in err
    # a manifest whose model has a layer the shards do not: not a whole model
    bigger = tmp_path / "bigger"
    shutil.copytree(ckpt, bigger)
    manifest = json.loads((bigger / "manifest.json").read_text())
    manifest["meta"]["export"]["hf_config"]["num_hidden_layers"] += 1
    (bigger / "manifest.json").write_text(json.dumps(manifest))
    err = one_line_refusal([str(bigger), str(tmp_path / "o")], capsys)
    assert "not a whole model" in err and "gpt_neox.layers.2." in err
    # a shard changed after it was saved
    changed = tmp_path / "changed"
    shutil.copytree(ckpt, changed)
    with open(changed / "rank-00001.safetensors", "r+b") as f:
        f.seek(-64, 2)
        flipped = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(-64, 2)
        f.write(flipped)
    assert "checksum mismatch" in one_line_refusal(
        [str(changed), str(tmp_path / "o")], capsys)
    # a checkpoint saved before the record
    del manifest["meta"]["export"]
    (bigger / "manifest.json").write_text(json.dumps(manifest))
    assert "records no model" in one_line_refusal(
        [str(bigger), str(tmp_path / "o")], capsys)
    assert not (tmp_path / "o").exists()
    assert not list(tmp_path.glob(".*")), "no temporary directory is left"


def test_an_export_goes_neither_into_a_checkpoint_nor_onto_its_base(
        full_run, snapshot, tmp_path, capsys):
    """Inside a checkpoint an export would go when pruning removes the
    checkpoint; onto the snapshot the run started from it would replace the
    base its adapters and the checkpoint refer to. Both are refused in one
    line, nothing written."""
    ckpt = saved(full_run)
    before = sorted(p.name for p in ckpt.iterdir())
    err = one_line_refusal([str(ckpt), str(ckpt / "hf")], capsys)
    assert f"is inside the checkpoint {ckpt}" in err
    assert sorted(p.name for p in ckpt.iterdir()) == before
    base = tmp_path / "base"
    shutil.copytree(snapshot, base)
    moved = tmp_path / "moved"
    shutil.copytree(ckpt, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["meta"]["export"]["snapshot"] = str(base)
    (moved / "manifest.json").write_text(json.dumps(manifest))
    err = one_line_refusal([str(moved), str(base)], capsys)
    assert f"is the checkpoint's base snapshot {base}" in err
    assert sorted(p.name for p in base.iterdir()) == sorted(
        p.name for p in snapshot.iterdir())


@pytest.mark.parametrize("text, size", [("1000", 1000), ("2GB", 2 * 10**9),
                                        ("512MiB", 512 * 2**20), ("1.5kb", 1500)])
def test_sizes(text, size):
    assert export.parse_size(text) == size


def test_a_bad_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        export.main(["a", "b", "--max-shard-size", "lots"])
    assert exit_info.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def test_marker_names_the_export(full_run):
    assert json.loads((full_run / "hf" / EXPORT_MARKER).read_text())["kind"] == \
        "merged_checkpoint"


def test_the_command_starts():
    from tests.test_layers import run_help

    shown = run_help("labml_zero.export")
    assert shown.returncode == 0, shown.stderr
    assert "usage: python -m labml_zero.export" in shown.stdout
