"""The fine-tune job on the Llama family, end to end on CPU (gloo): it asks the
family for the build, the weights, the tokenizer, the exports and the sample.
A random snapshot that transformers writes, with a small BPE `tokenizer.json`
built by `tokenizers`, trains at world sizes 1 and 2 with `--finetune all`
and `lora`; its exports load in transformers and PEFT with our logits; a
checkpoint resumes; a tied snapshot trains, exports, resumes and takes LoRA;
bad `config.json`s are refused in one line before start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from labml_zero.finetune.__main__ import main
from labml_zero.finetune.dataset import load_text
from labml_zero.llama.family import LLAMA
from labml_zero.llama.hf_checkpoint import LlamaCheckpoint, load_layers
from labml_zero.llama.model import LlamaChain, build_layers, count_parameters
from labml_zero.neox.family import NEOX
from tests import tolerance
from tests.llama.test_model import llama_terms
from tests.test_finetune import run_dirs, tracked

REPO = Path(__file__).resolve().parents[2]
EOT = "<|end_of_text|>"
TEXT = "First Citizen: Before we proceed any further, hear me speak."
# A tokenizer of 300 ids under an embedding of 320 rows (padded, as the real
# ones are); odd head counts: 6 query heads over 2 key-value heads.
COMMON = dict(vocab_size=320, hidden_size=48, intermediate_size=100,
              num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
CASES = {"llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0)),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6))}
# 2 ranks × 2 sequences of 32 tokens, a few steps: seconds per run.
SMALL = ["--batch-size", "2", "--seq-len", "32", "--valid-every", "3",
         "--valid-batches", "2", "--lr", "3e-3"]


def small_bpe() -> Tokenizer:
    """A byte-level BPE of 300 ids learned from the job's default corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([load_text()[:200_000]], trainer)
    return tokenizer


def write_snapshot(path: Path, case: str, **overrides) -> Path:
    """transformers' random model of `case`, saved with the tokenizer."""
    import transformers

    config_class, model_class, extra = CASES[case]
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(1234)
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(path, safe_serialization=True)
    small_bpe().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama_snapshots")
    return {case: write_snapshot(root / case, case) for case in CASES}


def job(tmp: Path, *args: str, world: int) -> subprocess.CompletedProcess:
    """`python -m labml_zero.finetune` in `tmp`, its outputs there."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "labml_zero.finetune", *SMALL, "--world-size",
         str(world), "--out", str(tmp / "out"), "--log-dir", str(tmp / "logs"),
         *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def our_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """The engine's model (labml_zero's Llama layers) with a snapshot's weights."""
    checkpoint = LlamaCheckpoint(directory)
    layers = build_layers(checkpoint.config)
    load_layers(checkpoint, layers)
    with torch.no_grad():
        return LlamaChain(*layers)(ids)


def probe(n_vocab: int) -> torch.Tensor:
    return torch.randint(0, n_vocab, (2, 23),
                         generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def trained(snapshots, tmp_path_factory) -> Path:
    """A full fine-tune of the Llama snapshot at world size 2, checkpointing
    every 3 steps, exporting at the end."""
    tmp = tmp_path_factory.mktemp("llama_all")
    result = job(tmp, "--checkpoint", str(snapshots["llama"]), "--steps", "6",
                 "--checkpoint-every", "3", "--sample-tokens", "4",
                 "--export-hf", str(tmp / "export"), world=2)
    check_ok(result)
    (tmp / "stdout.txt").write_text(result.stdout)
    return tmp


def test_a_llama_snapshot_trains_at_world_2(trained):
    stdout = (trained / "stdout.txt").read_text()
    assert "Llama: 2 layers of width 48" in stdout
    assert "Sample after 6 steps" in stdout
    losses = tracked(run_dirs(trained, LLAMA.experiment)[0])["loss.train"]
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    # from near ln 320 of a random model, six steps at 3e-3 bring it down
    assert losses[6] < losses[1] - 0.1, losses
    # a Llama run is its family's labml experiment, not GPT-NeoX's
    assert [d.name for d in (trained / "logs").iterdir()] == [LLAMA.experiment]
    assert LLAMA.experiment != NEOX.experiment


def test_the_export_loads_in_transformers_with_our_logits(trained, snapshots):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = trained / "export"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.model_type == "llama"
    config = LlamaCheckpoint(out).config
    ids = probe(config.n_vocab)
    with torch.no_grad():
        theirs = model(ids).logits
    torch.testing.assert_close(theirs, our_logits(out, ids), **tolerance.parity(
        torch.float32, terms=llama_terms(config, seq=ids.shape[1])))
    # the training moved the weights away from the snapshot's
    assert not torch.equal(our_logits(out, ids), our_logits(snapshots["llama"], ids))
    # the tokenizer the job encoded with, shipped beside the weights
    job_ids = Tokenizer.from_file(str(snapshots["llama"] / "tokenizer.json")
                                  ).encode(TEXT, add_special_tokens=False).ids
    assert AutoTokenizer.from_pretrained(out)(
        TEXT, add_special_tokens=False)["input_ids"] == job_ids


def test_a_llama_checkpoint_resumes_to_the_same_losses(trained, snapshots,
                                                       tmp_path):
    saved = trained / "out" / "checkpoints" / "step-000003"
    result = job(tmp_path, "--checkpoint", str(snapshots["llama"]), "--steps", "6",
                 "--resume", str(saved), "--sample-tokens", "0", world=2)
    check_ok(result)
    full = tracked(run_dirs(trained, LLAMA.experiment)[0])
    resumed = tracked(run_dirs(tmp_path, LLAMA.experiment)[0])
    assert sorted(resumed["loss.train"]) == [4, 5, 6]
    # the same ranks summing in the same order: the same numbers
    for step in (4, 5, 6):
        assert resumed["loss.train"][step] == full["loss.train"][step]


def test_a_resume_without_its_snapshot_names_the_snapshot(trained, snapshots,
                                                         tmp_path, capsys):
    # without --checkpoint the run builds the default model, another one
    saved = trained / "out" / "checkpoints" / "step-000003"
    with pytest.raises(SystemExit) as info:
        main(["--resume", str(saved), "--steps", "6", "--world-size", "2",
              "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "is of a different model" in err, err
    assert err.rstrip().endswith(
        f"(it trained from --checkpoint {snapshots['llama'].resolve()}: give it "
        f"again) (see --help)"), err


def test_lora_on_qwen2_at_world_1_exports_for_peft_and_transformers(snapshots,
                                                                    tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = snapshots["qwen2"]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    result = job(tmp_path, "--checkpoint", str(base), "--finetune", "lora",
                 "--lora-rank", "4", "--lora-alpha", "8",
                 "--lora-targets", "q_proj,v_proj,down_proj", "--steps", "4",
                 "--lr", "3e-2", "--sample-tokens", "4",
                 "--export-hf", str(merged), "--export-adapter", str(adapter),
                 world=1)
    check_ok(result)
    losses = tracked(run_dirs(tmp_path, LLAMA.experiment)[0])["loss.train"]
    assert sorted(losses) == [1, 2, 3, 4]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    ids = probe(COMMON["vocab_size"])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        base_logits = plain(ids).logits
        adapted = PeftModel.from_pretrained(plain, adapter).eval()
        adapted_logits = adapted(ids).logits
        merged_model = AutoModelForCausalLM.from_pretrained(merged).eval()
        merged_logits = merged_model(ids).logits
    assert not any("lora" in n for n, _ in merged_model.named_parameters())
    # four steps at a high rate moved the adapters away from B = 0
    assert (adapted_logits - base_logits).abs().max() > 1e-3
    # merged: each adapted weight adds B A's sum over the rank and one addition
    terms = llama_terms(LlamaCheckpoint(merged).config, seq=ids.shape[1]) + 4 + 1
    torch.testing.assert_close(merged_logits, adapted_logits,
                               **tolerance.parity(torch.float32, terms=terms))
    torch.testing.assert_close(our_logits(merged, ids), merged_logits,
                               **tolerance.parity(torch.float32, terms=terms))


# ## Refused before any rank starts, one line, exit 2


def refused(capsys, tmp_path: Path, snapshot: Path) -> str:
    capsys.readouterr()  # what writing the snapshot printed
    with pytest.raises(SystemExit) as info:
        main(["--checkpoint", str(snapshot), "--steps", "2", "--world-size", "1",
              "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())
    return err


def edited(snapshots, tmp_path: Path, **changes) -> Path:
    """A copy of the Llama snapshot whose config.json has `changes` (`None`
    deletes a key)."""
    copy = tmp_path / "edited"
    shutil.copytree(snapshots["llama"], copy)
    hf = json.loads((copy / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key)
        else:
            hf[key] = value
    (copy / "config.json").write_text(json.dumps(hf))
    return copy


def test_a_shape_the_weights_contradict(snapshots, tmp_path, capsys):
    err = refused(capsys, tmp_path, edited(snapshots, tmp_path,
                                           intermediate_size=90))
    assert "model.safetensors" in err and "intermediate_size" in err


def test_a_missing_num_key_value_heads_is_refused(snapshots, tmp_path, capsys):
    # transformers would default it to num_attention_heads: a guess, refused
    err = refused(capsys, tmp_path, edited(snapshots, tmp_path,
                                           num_key_value_heads=None))
    assert "config.json" in err and "no 'num_key_value_heads'" in err


def test_heads_that_do_not_divide(snapshots, tmp_path, capsys):
    err = refused(capsys, tmp_path, edited(snapshots, tmp_path,
                                           num_key_value_heads=4))
    assert "config.json" in err
    assert "num_attention_heads=6 is not divisible by num_key_value_heads=4" in err


# ## A tied snapshot (SmolLM2, Llama 3.2): the embedding layer owns the matrix


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    """A full fine-tune of a tied Llama snapshot at world size 2, checkpointing
    every 3 steps, exporting at the end."""
    tmp = tmp_path_factory.mktemp("llama_tied")
    write_snapshot(tmp / "snapshot", "llama", tie_word_embeddings=True)
    result = job(tmp, "--checkpoint", str(tmp / "snapshot"), "--steps", "6",
                 "--checkpoint-every", "3", "--sample-tokens", "0",
                 "--export-hf", str(tmp / "export"), world=2)
    check_ok(result)
    (tmp / "stdout.txt").write_text(result.stdout)
    return tmp


def test_a_tied_snapshot_trains_and_exports_its_matrix_once(tied):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = LlamaCheckpoint(tied / "snapshot").config
    assert config.tie_embeddings
    # the tied matrix counted once
    n = count_parameters(build_layers(config, device="meta"))
    assert f"{n:,} parameters" in (tied / "stdout.txt").read_text()
    losses = tracked(run_dirs(tied, LLAMA.experiment)[0])["loss.train"]
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1] - 0.1, losses
    out = tied / "export"
    saved = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.tie_word_embeddings
    ids = probe(config.n_vocab)
    with torch.no_grad():
        theirs = model(ids).logits
    ours = our_logits(out, ids)
    torch.testing.assert_close(theirs, ours, **tolerance.parity(
        torch.float32, terms=llama_terms(config, seq=ids.shape[1])))
    assert not torch.equal(ours, our_logits(tied / "snapshot", ids))


def test_a_tied_checkpoint_exports_offline_as_the_job_did(tied, tmp_path):
    """`python -m labml_zero.export` expects the tied matrix once, as the job
    saved and exported it, and sizes its room so."""
    from labml_zero import export
    from labml_zero.hf.export_destination import export_bytes
    from tests.test_export import tensors

    out = tmp_path / "again"
    assert export.main([str(tied / "out" / "checkpoints" / "step-000006"),
                        str(out)]) == 0
    ours, jobs = tensors(out), tensors(tied / "export")
    assert ours.keys() == jobs.keys()
    for name in ours:
        assert torch.equal(ours[name], jobs[name]), name
    config = LlamaCheckpoint(tied / "snapshot").config
    layers = build_layers(config, device="meta")
    assert export_bytes(layers, "hf", torch.float32) == \
        4 * sum(t.numel() for t in ours.values())


def test_a_tied_checkpoint_resumes_to_the_same_losses(tied, tmp_path):
    saved = tied / "out" / "checkpoints" / "step-000003"
    result = job(tmp_path, "--checkpoint", str(tied / "snapshot"), "--steps", "6",
                 "--resume", str(saved), "--sample-tokens", "0", world=2)
    check_ok(result)
    full = tracked(run_dirs(tied, LLAMA.experiment)[0])
    resumed = tracked(run_dirs(tmp_path, LLAMA.experiment)[0])
    assert sorted(resumed["loss.train"]) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed["loss.train"][step] == full["loss.train"][step]


def test_lora_on_a_tied_model_exports_a_peft_adapter(tied, tmp_path):
    """The tied matrix frozen in the embedding layer, read by the readout;
    `lm_head` is no target, so the adapter holds the projections' only."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tied / "snapshot"
    adapter = tmp_path / "adapter"
    result = job(tmp_path, "--checkpoint", str(base), "--finetune", "lora",
                 "--lora-rank", "4", "--lora-alpha", "8",
                 "--lora-targets", "q_proj,v_proj", "--steps", "3",
                 "--lr", "3e-2", "--sample-tokens", "0",
                 "--export-adapter", str(adapter), world=2)
    check_ok(result)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]
    ids = probe(COMMON["vocab_size"])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        base_logits = plain(ids).logits
        adapted = PeftModel.from_pretrained(plain, adapter).eval()
        adapted_logits = adapted(ids).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-3


def test_the_offline_export_of_a_llama_checkpoint_is_the_jobs(trained):
    """`python -m labml_zero.export` asks the family the manifest names."""
    from safetensors.torch import load_file

    from labml_zero.export import main as export_main

    out = trained / "offline"
    assert export_main([str(trained / "out" / "checkpoints" / "step-000006"),
                        str(out)]) == 0
    ours, jobs = (load_file(str(d / "model.safetensors"))
                  for d in (out, trained / "export"))
    assert ours.keys() == jobs.keys()
    for name in ours:  # the same fp32 values, gathered two ways
        assert torch.equal(ours[name], jobs[name]), name
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "tokenizer.json").read_text() == (
        trained / "export" / "tokenizer.json").read_text()


def test_random_weights_take_the_bundled_tokenizer_where_it_fits():
    """A preset with random weights has no tokenizer of its own: the family
    takes the bundled GPT-NeoX one (50,281 ids) where the embedding holds it,
    and refuses in one line where it does not (Mistral's 32,000 rows)."""
    from labml_zero.llama.config import llama_3_1_8b, mistral_7b
    from labml_zero.neox.tokenizer import BUNDLED_TOKENIZER
    from labml_zero.zero3.checkpoint import CheckpointError

    assert LLAMA.tokenizer_file(None) == BUNDLED_TOKENIZER
    tokenizer, eot = LLAMA.tokenizer(None, llama_3_1_8b())
    assert tokenizer.id_to_token(eot) == "<|endoftext|>"
    with pytest.raises(CheckpointError,
                       match="more than the model's vocab_size=32000; give "
                             "--checkpoint"):
        LLAMA.tokenizer(None, mistral_7b())
