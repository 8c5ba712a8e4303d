"""The fine-tune job with `--finetune lora`, end to end at world size 2 on CPU:
it trains the adapters of a Hugging Face checkpoint and writes both exports,
which load in peft and transformers with the same logits; bad LoRA flags are
refused in one line before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from labml_zero.finetune.cli import main
from labml_zero.neox import model as neox_model
from labml_zero.neox.hf_checkpoint import hf_named_tensors, save_hf_checkpoint
from labml_zero.neox.lora_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS,
                                         EXPORT_MARKER)
from tests import tolerance
from tests.neox.test_lora_export import probe_ids
from tests.test_finetune import check_ok, finetune, run_dirs, tracked


def test_lora_trains_and_exports_load_in_peft_and_transformers(tmp_path: Path):
    from peft import PeftModel
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(7)
    layers = neox_model.build_layers(neox_model.tiny())
    save_hf_checkpoint(tmp_path / "hf", neox_model.tiny(), hf_named_tensors(layers))
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    result = finetune(tmp_path / "run", "--checkpoint", str(tmp_path / "hf"),
                      "--finetune", "lora", "--lora-rank", "4", "--lora-alpha", "8",
                      "--lora-targets", "query_key_value,dense_4h_to_h",
                      "--steps", "4", "--lr", "3e-2", "--sample-tokens", "0",
                      "--export-adapter", str(adapter_dir),
                      "--export-merged", str(merged_dir))
    check_ok(result)
    losses = tracked(run_dirs(tmp_path / "run")[0])["loss.train"]
    assert sorted(losses) == [1, 2, 3, 4]

    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPORT_MARKER]
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["query_key_value", "dense_4h_to_h"]
    assert config["base_model_name_or_path"] == str(tmp_path / "hf")

    ids = probe_ids(neox_model.tiny().n_vocab)
    base = GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
        adapted_logits = adapted(ids).logits
        merged = GPTNeoXForCausalLM.from_pretrained(merged_dir).eval()
        merged_logits = merged(ids).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # four steps at a high rate moved the adapters away from B = 0
    assert (adapted_logits - base_logits).abs().max() > 1e-3
    # merged: each weight adds B A's sum over the rank and one addition
    # (tests/tolerance.py)
    torch.testing.assert_close(merged_logits, adapted_logits, **tolerance.parity(
        torch.float32, terms=tolerance.neox_terms(neox_model.tiny(), seq=ids.shape[1])
        + 4 + 1))


@pytest.mark.parametrize("args, message", [
    (["--export-merged", "m"], "export_merged needs finetune 'lora'"),
    (["--finetune", "ffn", "--export-adapter", "a"],
     "export_adapter needs finetune 'lora'"),
    (["--finetune", "lora", "--export-merged", "d", "--export-adapter", "d"],
     "must be different directories"),
    (["--finetune", "lora", "--lora-targets", "dense,mlp"],
     "--lora-targets: lora_targets names an unknown projection 'mlp'"),
    (["--finetune", "lora", "--lora-targets", "dense,dense"],
     "names a projection twice"),
    (["--finetune", "lora", "--lora-targets", ","], "at least one projection"),
    (["--finetune", "lora", "--lora-rank", "0"], "--lora-rank"),
    (["--finetune", "lora", "--lora-alpha", "0"], "lora_alpha must be"),
])
def test_bad_lora_flags_exit_2_with_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_resume_keeps_the_adapters_alpha_or_refuses_another(tmp_path: Path, capsys):
    """LoRA's $\\alpha$ scales the adapters a checkpoint trained, but no chunk
    has its shape: `--resume` keeps the saved one when the flag is left out,
    and refuses a different one in one line before any rank starts."""
    from labml_zero.finetune.checkpoints import resume_settings
    from labml_zero.finetune.config import FinetuneConfig

    check_ok(finetune(tmp_path, "--finetune", "lora", "--lora-alpha", "256",
                      "--steps", "2", "--checkpoint-every", "2", "--sample-tokens", "0"))
    saved = tmp_path / "out" / "checkpoints" / "step-000002"
    config = FinetuneConfig(model="tiny", finetune="lora", resume=str(saved), steps=4)
    assert config.lora_alpha != 256
    kept, _ = resume_settings(config, {"finetune", "resume", "steps"})
    assert kept.lora_alpha == 256
    given, _ = resume_settings(FinetuneConfig(model="tiny", finetune="lora",
                                              resume=str(saved), steps=4,
                                              lora_alpha=8.0),
                               {"finetune", "resume", "steps", "lora_alpha"})
    assert given.lora_alpha == 8.0
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "tiny", "--finetune", "lora", "--lora-alpha", "8",
              "--resume", str(saved), "--steps", "4", "--seq-len", "32",
              "--batch-size", "2", "--world-size", "2",
              "--out", str(tmp_path / "again"), "--log-dir", str(tmp_path / "logs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "trained its adapters with --lora-alpha 256, this run gives 8" in err
    assert not (tmp_path / "again").exists()  # nothing written, nothing made
