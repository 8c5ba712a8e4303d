"""The checks before any rank starts (`labml_zero/finetune/preflight.py`): bad
snapshots, outputs and numbers are refused on this host, in one line naming the
file or the setting, and the command line exits 2 without starting a process.
The snapshot checks themselves are the checkpoint loader's (tests/neox/
test_checkpoint.py); here they are reached through the command line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from labml_zero.finetune.checkpoints import check_global_batch
from labml_zero.finetune.cli import main, make_parser, parse_config
from labml_zero.finetune.config import FinetuneConfig
from labml_zero.finetune.job import banner, token_flops
from labml_zero.files import size_text
from labml_zero.llama import config as llama_config
from labml_zero.finetune.preflight import (PreflightError, check_writable_dir,
                                           checkpoint_bytes, preflight,
                                           saves_at_peak)
from labml_zero.neox import model as neox_model
from labml_zero.neox.finetuners import finetuner
from labml_zero.neox.hf_checkpoint import hf_named_tensors, save_hf_checkpoint

CPU = torch.device("cpu")


def small_config() -> neox_model.NeoXConfig:
    return dataclasses.replace(neox_model.tiny(), n_vocab=128)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    """A random small GPT-NeoX written as a Hugging Face snapshot."""
    path = tmp_path_factory.mktemp("hf") / "snapshot"
    torch.manual_seed(0)
    layers = neox_model.build_layers(small_config())
    save_hf_checkpoint(path, small_config(), hf_named_tensors(layers))
    return path


def broken_copy(snapshot: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "broken"
    shutil.copytree(snapshot, copy)
    return copy


def test_output_directories(tmp_path, capsys):
    # checked where they would be made, and not made: a run refused by a later
    # check leaves nothing behind
    assert check_writable_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(PreflightError, match="--out .* is a file"):
        check_writable_dir(file, "--out")
    with pytest.raises(PreflightError, match="--log-dir .*file is a file"):
        check_writable_dir(file / "logs", "--log-dir")
    run_main(["--data", str(tmp_path / "missing.txt"), "--out",
              str(tmp_path / "out" / "a"), "--log-dir", str(tmp_path / "logs" / "x")],
             capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_checkpoint_bytes_is_p_psi_plus_k_psi_t():
    layers = neox_model.build_layers(small_config(), device="meta")
    counts = finetuner("biases")(layers)
    assert checkpoint_bytes(layers, torch.bfloat16) == (
        2 * counts.total + 12 * counts.trainable)
    # an fp32 shard is its own master: only the two moments more
    assert checkpoint_bytes(layers, torch.float32) == (
        4 * counts.total + 8 * counts.trainable)


def marked_layers(config: FinetuneConfig) -> list:
    """The layers preflight sizes: on the meta device, marked by the fine-tuner."""
    layers = neox_model.build_layers(config.model_config(), device="meta")
    config.tuner()(layers)
    return layers


def free_bytes(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10 * free, 0, free))


@pytest.mark.parametrize("keep, at_once", [(1, 2), (3, 4), (0, 5)])
def test_room_for_the_kept_checkpoints_and_the_new_one(tmp_path, monkeypatch,
                                                       keep, at_once):
    # keep k: the k kept and the one being saved are on the disk together;
    # keep 0 keeps every one of the run's 5 saves
    config = FinetuneConfig(out=str(tmp_path / "out"), log_dir=str(tmp_path / "l"),
                            checkpoint_every=1, keep_checkpoints=keep, steps=5)
    one = checkpoint_bytes(marked_layers(config), torch.float32)
    free_bytes(monkeypatch, at_once * one)
    assert preflight(config, world_size=2, device=CPU).resumed_step is None
    free_bytes(monkeypatch, at_once * one - 1)
    with pytest.raises(PreflightError) as refused:
        preflight(config, world_size=2, device=CPU)
    assert str(refused.value) == (
        f"--out {config.out} has {size_text(at_once * one - 1)} free, the run needs "
        f"{size_text(at_once * one)}: {at_once} new checkpoints of {size_text(one)} "
        f"on the disk at once with --keep-checkpoints {keep}"
        + (" (all kept)" if keep == 0 else ""))
    # the sizes show the shortage: the tiny model's checkpoint is megabytes
    assert "MiB" in size_text(one) and "0.0 GiB" not in str(refused.value)


def test_saves_at_peak_counts_the_checkpoints_already_there():
    config = FinetuneConfig(checkpoint_every=10, keep_checkpoints=2)
    # steps 10..120: 12 saves; 3 on the disk at once
    assert saves_at_peak(config, first_step=0, total_steps=120, existing=0) == 3
    # resumed from step 40 with 2 kept already: one more at once
    assert saves_at_peak(config, first_step=40, total_steps=120, existing=2) == 1
    # more there than kept (an earlier run kept all): the first save needs room
    assert saves_at_peak(config, first_step=40, total_steps=120, existing=9) == 1
    # a last step off the period is saved too: 125 gives 13 saves
    every = dataclasses.replace(config, keep_checkpoints=0)
    assert saves_at_peak(every, first_step=0, total_steps=125, existing=0) == 13
    assert saves_at_peak(every, first_step=120, total_steps=120, existing=4) == 0


def run_main(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_command_line_refuses_before_starting(snapshot, tmp_path, capsys):
    outputs = ["--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")]
    file = tmp_path / "file"
    file.write_text("")
    assert "is a file" in run_main(["--out", str(file)], capsys)
    copy = broken_copy(snapshot, tmp_path)
    (copy / "config.json").write_text("[]")
    err = run_main(["--checkpoint", str(copy), *outputs], capsys)
    assert f"error: --checkpoint: {copy / 'config.json'}: expected a JSON object" \
        in err
    (copy / "config.json").write_text((snapshot / "config.json").read_text())
    (copy / "model.safetensors").write_bytes(b"garbage")
    err = run_main(["--checkpoint", str(copy), *outputs], capsys)
    assert f"error: --checkpoint: {copy / 'model.safetensors'}: not a safetensors" \
        in err
    err = run_main(["--resume", str(tmp_path), *outputs], capsys)
    assert f"--resume: no manifest.json in {tmp_path}" in err, err


@pytest.mark.parametrize("args, message", [
    (["--lr", "nan"], "argument --lr: invalid finite number value: 'nan'"),
    (["--clip-grad", "inf"], "argument --clip-grad: invalid finite number"),
    (["--hang-timeout", "0"], "--hang-timeout: hang_timeout must be > 0"),
    (["--keep-checkpoints", "-1"], "argument --keep-checkpoints"),
    # NumPy's data order refuses a negative seed, and one past a signed
    # 8-byte integer overflows: found in a rank, before this check
    (["--seed", "-1"], "argument --seed: invalid non-negative integer value: '-1'"),
    (["--seed", str(2**63)], f"--seed: seed must be in [0, 2**63 - 1], got {2**63}"),
])
def test_numbers_must_be_finite_and_in_range(args, message, capsys):
    assert message in run_main(args, capsys)


def test_config_refuses_non_finite_numbers():
    with pytest.raises(ValueError, match="lr must be a finite number, got nan"):
        FinetuneConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="weight_decay must be a finite number"):
        FinetuneConfig(weight_decay=float("inf"))
    with pytest.raises(ValueError, match="seed must be in"):
        FinetuneConfig(seed=-1)
    assert FinetuneConfig(seed=2**63 - 1).seed == 2**63 - 1


def test_valid_data_errors_name_valid_data(tmp_path, capsys):
    outputs = ["--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")]
    train = tmp_path / "train.txt"
    train.write_text("Train on these words, all of them. " * 50)
    missing, empty = tmp_path / "missing.txt", tmp_path / "empty.txt"
    empty.write_text("")
    err = run_main(["--data", str(train), "--valid-data", str(missing), *outputs],
                   capsys)
    assert f"error: --valid-data {missing}: no such file or directory" in err
    err = run_main(["--data", str(train), "--valid-data", str(empty), *outputs],
                   capsys)
    assert f"error: --valid-data {empty}: the file is empty" in err
    # and `--data`'s own errors still name `--data`
    err = run_main(["--data", str(missing), *outputs], capsys)
    assert f"error: --data {missing}: no such file or directory" in err


def test_a_layer_kept_twice_is_refused(capsys):
    err = run_main(["--filter-layers", "0,0"], capsys)
    assert "--filter-layers: filter_layers names a layer twice: 0,0" in err


def test_lora_options_without_lora_are_refused(capsys):
    err = run_main(["--lora-rank", "4"], capsys)
    assert "--lora-rank needs --finetune lora (this run fine-tunes 'all')" in err
    err = run_main(["--finetune", "biases", "--lora-alpha", "8"], capsys)
    assert "--lora-alpha needs --finetune lora (this run fine-tunes 'biases')" in err


def test_lora_options_with_lora_or_left_at_their_defaults_pass():
    parser = make_parser()
    # the defaults (rank 8 among them) are never "given"
    config, _ = parse_config([], parser)
    assert config.finetune == "all" and config.lora_rank == 8
    config, _ = parse_config(["--finetune", "lora", "--lora-rank", "4"], parser)
    assert (config.finetune, config.lora_rank) == ("lora", 4)


@pytest.mark.parametrize("filter_layers, words", [
    (None, "GPT-NeoX: 2 layers of width"), ((1,), "GPT-NeoX: 1 layer of width")])
def test_the_banner_counts_the_layers_kept(filter_layers, words):
    config = FinetuneConfig(filter_layers=filter_layers)
    counts = finetuner("all")(neox_model.build_layers(
        config.model_config(), filter_layers=filter_layers, device="meta"))
    line = banner(config, config.model_config(), counts, step=0, world_size=1)
    assert line.startswith(words) and line.endswith("(all) on 1 rank")


def test_the_mfu_counts_the_layers_kept_and_what_trains():
    # --filter-layers 0 of the two-layer tiny model: one layer's products and
    # attention; with LoRA the frozen products' weight gradients do not count
    config = FinetuneConfig(filter_layers=(0,))
    neox = config.model_config()
    d, ff, vocab = neox.d_model, neox.ff_dim, neox.n_vocab
    matmul = 1 * (4 * d * d + 2 * d * ff) + d * vocab
    attention = 12 * 1 * d * config.seq_len
    assert token_flops(config, neox) == 6 * matmul + attention
    lora = FinetuneConfig(filter_layers=(0,), finetune="lora")
    assert token_flops(lora, neox) == 4 * matmul + attention


def test_a_global_batch_over_one_rank_says_1_rank():
    refusal = check_global_batch(Path("ck"), {"global_batch": 16},
                                 FinetuneConfig(batch_size=8, grad_accum=1), 1)
    assert "--grad-accum 1 × 1 rank = 8" in refusal
    assert "at 1 rank use --grad-accum 2" in refusal


def test_a_bad_app_url_names_its_flag(capsys):
    err = run_main(["--app-url", "ftp://x"], capsys)
    assert "error: --app-url: app_url must start with http:// or https://" in err


def test_out_defaults_to_the_familys_experiment(tmp_path, monkeypatch):
    """Without `--out` a run writes under `runs/<experiment>` of its model's
    family, a preset's or a checkpoint's, so one family's checkpoints never
    land among another's; `--out` given wins."""
    from labml_zero.families import FAMILIES
    from labml_zero.finetune.checkpoints import checkpoint_path

    for family in FAMILIES:
        preset = next(iter(family.presets))
        config = FinetuneConfig(model=preset)
        assert config.family is family
        assert config.out_dir == Path("runs") / family.experiment
        assert checkpoint_path(config, 7) == (
            Path("runs") / family.experiment / "checkpoints" / "step-000007")
    assert {f.experiment for f in FAMILIES} == {"zero3_neox", "zero3_llama"}
    given = FinetuneConfig(model="llama-3.2-1b", out=str(tmp_path / "mine"))
    assert given.out_dir == tmp_path / "mine"
    # parsed from the command line: the flag left out is the family's default
    config, _ = parse_config(["--model", "llama-3.2-1b"], make_parser())
    assert config.out_dir == Path("runs/zero3_llama")


def test_a_resume_keeps_the_runs_cadence_and_precision_unless_flagged():
    """A preempted run started again with `--resume` alone saves, validates and
    computes as before (it used to stop saving and fall back to the default
    dtype); a flag still overrides, and says so."""
    from labml_zero.finetune.checkpoints import override_settings, saved_settings

    was = FinetuneConfig(dtype="bf16", checkpoint_every=3, keep_checkpoints=2,
                         valid_every=5, valid_batches=1)
    kept, line = override_settings(FinetuneConfig(), {"resume"}, saved_settings(was))
    assert (kept.dtype, kept.checkpoint_every, kept.keep_checkpoints,
            kept.valid_every, kept.valid_batches) == ("bf16", 3, 2, 5, 1)
    assert line is None
    given, line = override_settings(FinetuneConfig(checkpoint_every=10),
                                    {"resume", "checkpoint_every"},
                                    saved_settings(was))
    assert given.checkpoint_every == 10 and given.dtype == "bf16"
    assert line == "--resume: flags override saved settings: checkpoint_every 3 → 10"


@pytest.mark.parametrize("args, message", [
    (["--min-lr", "1e-4"], "--min-lr needs --lr-schedule linear or cosine"),
    (["--keep-checkpoints", "5"], "--keep-checkpoints needs --checkpoint-every"),
    (["--text-field", "body"], "--text-field needs a JSON Lines --data"),
    (["--valid-fraction", "0.5", "--valid-data", "{readme}"],
     "--valid-fraction has no effect with --valid-data"),
    (["--sample-tokens", "0", "--prompt", "Hello"],
     "--prompt needs --sample-tokens above 0"),
    (["--sample-tokens", "0", "--top-k", "3"], "--top-k needs --sample-tokens above 0"),
    (["--data", "{readme}", "--valid-data", "{readme}"],
     "is --data: the run would validate on the text it trains on"),
    (["--plan", "--gpu", "h100", "--world-size", "3", "--gpus", "2"],
     "--world-size 3 disagrees with --gpus 2 x --nodes 1"),
    # no --gpus given: the message names only what was
    (["--plan", "--gpu", "h100", "--world-size", "3", "--nodes", "2"],
     "--world-size 3 is not a whole number of GPUs a node over --nodes 2"),
    # a shard group of one rank holds whole chunks: no peer to read from
    (["--peer-memory", "--world-size", "1", "--steps", "1"],
     "--peer-memory needs more than one rank"),
    (["--peer-memory", "--world-size", "2", "--shard-group-size", "1",
      "--steps", "1"], "--peer-memory needs shard groups of more than one rank"),
])
def test_a_flag_this_run_would_ignore_is_refused(args, message, capsys):
    readme = str(Path(__file__).resolve().parents[2] / "README.md")
    err = run_main([a.format(readme=readme) for a in args], capsys)
    assert message in err, err


def test_peer_memory_under_torchrun_is_judged_by_its_world_size(
        tmp_path, monkeypatch, capsys):
    # torchrun's WORLD_SIZE is the world size: known before any rank starts
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "0")):
        monkeypatch.setenv(name, value)
    err = run_main(["--peer-memory", "--steps", "1", "--sample-tokens", "0",
                    "--out", str(tmp_path / "out"), "--log-dir",
                    str(tmp_path / "logs")], capsys)
    assert "--peer-memory needs more than one rank" in err


def write_text(path: Path, words: str = "Words to train on, all of them. ") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(words * 100)
    return path


def test_validation_text_that_data_reads_too_is_refused(tmp_path, capsys):
    """Not only the same path: a file of a `--data` directory, a directory
    holding `--data`'s file, one directory inside the other, a link to one of
    `--data`'s files. The run would validate on text it trains on."""
    outputs = ["--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")]
    corpus = tmp_path / "corpus"
    a = write_text(corpus / "a.txt")
    b = write_text(corpus / "sub" / "b.txt")
    link = tmp_path / "link.txt"
    link.symlink_to(b)
    for data, valid, shared in [(corpus, b, b), (a, corpus, a),
                                (corpus, corpus / "sub", b), (corpus, link, b)]:
        err = run_main(["--data", str(data), "--valid-data", str(valid),
                        *outputs], capsys)
        assert f"--valid-data {valid} overlaps --data {data} ({shared} is in " \
            f"both): the run would validate on the text it trains on" in err, err
    # files beside each other share nothing
    other = write_text(tmp_path / "other.txt")
    config, _ = parse_config(["--data", str(a), "--valid-data", str(other)],
                             make_parser())
    assert config.valid_data == str(other)


def test_text_field_is_used_by_either_flags_json_lines(tmp_path, capsys):
    """`--text-field` reads JSON Lines `--valid-data` too (it was refused, and
    without it the run could not read the file); a `--data` directory of
    text files alone would ignore it, so it is refused there."""
    train = write_text(tmp_path / "train.txt")
    valid = tmp_path / "valid.jsonl"
    valid.write_text("".join(json.dumps({"content": "Validate on these words. "
                                                    * 20}) + "\n"
                             for _ in range(10)))
    config, world_size = parse_config(
        ["--data", str(train), "--valid-data", str(valid), "--text-field",
         "content", "--world-size", "1", "--batch-size", "2", "--seq-len", "32",
         "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")],
        make_parser())
    assert config.text_field == "content"
    checked = preflight(config, world_size=world_size, device=CPU)
    assert len(checked.data.valid) >= 2
    texts = tmp_path / "texts"
    write_text(texts / "a.txt")
    write_text(texts / "more" / "b.txt")
    err = run_main(["--data", str(texts), "--text-field", "content"], capsys)
    assert "--text-field needs a JSON Lines --data or --valid-data" in err


def test_a_file_where_the_run_makes_a_folder_is_refused(tmp_path, capsys):
    """`checkpoints` under `--out` (when the run saves) and the experiment's
    folder under `--log-dir` are made by the ranks: a file there failed the
    first save after training, or labml's start in a rank."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    experiment = FinetuneConfig().family.experiment
    write_text(out / "checkpoints")
    write_text(logs / experiment)
    err = run_main(["--out", str(out), "--log-dir", str(tmp_path / "l"),
                    "--checkpoint-every", "1"], capsys)
    assert f"--out {out}: {out / 'checkpoints'} is a file, not a directory" in err
    # a run that saves nothing does not write there
    assert check_writable_dir(out, "--out") == out
    err = run_main(["--out", str(tmp_path / "o"), "--log-dir", str(logs)], capsys)
    assert f"--log-dir {logs}: {logs / experiment} is a file, not a " \
        f"directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "out"]


def test_a_sequence_longer_than_a_sliding_window_is_refused(tmp_path, capsys):
    """A Mistral's model refuses a sequence past its window, as the plan does:
    refused before start, naming `--seq-len` and the window."""
    path = tmp_path / "mistral"
    path.mkdir()
    hf = llama_config.to_hf_config(dataclasses.replace(
        llama_config.mistral_7b(), sliding_window=16))
    (path / "config.json").write_text(json.dumps(hf))
    err = run_main(["--checkpoint", str(path), "--seq-len", "32"], capsys)
    assert "--seq-len: seq_len 32 exceeds the model's sliding_window 16" in err
    config = FinetuneConfig(checkpoint=str(path), seq_len=16)
    assert config.model_config().sliding_window == 16
