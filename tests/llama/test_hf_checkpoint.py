"""`labml_zero/llama/hf_checkpoint.py`: a snapshot whose config.json is wrong
for its weights, or wrong in itself, is refused in one line naming the file and
the field, before any tensor data is read."""

import json

import pytest

from labml_zero.llama.hf_checkpoint import (LlamaCheckpoint, check_llama_snapshot,
                                            hf_name)
from labml_zero.llama.model import build_layers
from labml_zero.zero3.checkpoint import CheckpointError
from tests.llama.conftest import hf_model


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "llama"
    hf_model("llama").save_pretrained(path, safe_serialization=True)
    return path


def edited(snapshot, tmp_path, **changes):
    """A copy of the snapshot (the weights linked) with config.json edited;
    a value `None` removes the key."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for file in snapshot.iterdir():
        (copy / file.name).symlink_to(file)
    hf = json.loads((snapshot / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps(hf))
    return copy


def refusal(path) -> str:
    with pytest.raises(CheckpointError) as error:
        check_llama_snapshot(path)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_good_snapshot_passes(snapshot):
    config = check_llama_snapshot(snapshot)
    assert (config.n_heads, config.n_kv_heads, config.head_width) == (6, 2, 8)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0


def test_missing_num_key_value_heads(snapshot, tmp_path):
    """transformers would quietly take n_kv = n_h and then fail, or worse."""
    message = refusal(edited(snapshot, tmp_path, num_key_value_heads=None))
    assert "config.json" in message and "'num_key_value_heads'" in message


def test_heads_that_do_not_divide(snapshot, tmp_path):
    message = refusal(edited(snapshot, tmp_path, num_key_value_heads=4))
    assert "config.json" in message
    assert "num_attention_heads=6 is not divisible by num_key_value_heads=4" \
        in message


def test_a_width_the_heads_do_not_divide(snapshot, tmp_path):
    message = refusal(edited(snapshot, tmp_path, hidden_size=50, head_dim=None))
    assert "config.json" in message and "hidden_size=50" in message


def test_a_shape_the_weights_contradict(snapshot, tmp_path):
    """Three key-value heads divide six query heads, but the K projection in
    the file has rows for two: the header says so before any data is read."""
    message = refusal(edited(snapshot, tmp_path, num_key_value_heads=3))
    assert "model.safetensors" in message
    assert "k_proj.weight" in message and "(16, 48)" in message
    assert "(24, 48)" in message and "num_key_value_heads" in message


def test_an_unsupported_family_and_a_non_integer(snapshot, tmp_path):
    assert "model_type 'gpt2'" in refusal(
        edited(snapshot, tmp_path, model_type="gpt2"))
    (tmp_path / "edited" / "config.json").write_text(json.dumps(
        {**json.loads((snapshot / "config.json").read_text()),
         "hidden_size": "48"}))
    assert "'hidden_size' must be an integer, got the string '48'" in refusal(
        tmp_path / "edited")


def test_a_tied_readout_reads_the_embedding(hf_case):
    """A tied checkpoint has no `lm_head.weight`; untied ones do."""
    case, model, path = hf_case
    checkpoint = LlamaCheckpoint(path)
    readout = build_layers(checkpoint.config, device="meta")[-1]
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in checkpoint.weight_map) == (not tied)
    assert hf_name(readout, "lm_head.weight") == (
        "model.embed_tokens.weight" if tied else "lm_head.weight")


def test_a_tied_snapshot_with_another_readout_stored_is_refused(tmp_path):
    """transformers loads a stored `lm_head.weight` even when the config ties
    it; this job reads the embedding. An equal copy is accepted, a different
    one refused in one line before any rank starts (the logits would differ)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "tied"
    hf_model("llama_tied").save_pretrained(path, safe_serialization=True)
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    assert check_llama_snapshot(path).tie_embeddings
    tensors["lm_head.weight"][3, 5] += 1.0
    save_file(tensors, file, metadata={"format": "pt"})
    assert "ties the readout to the embedding (tie_word_embeddings), but its " \
           "lm_head.weight differs from model.embed_tokens.weight" in refusal(path)
