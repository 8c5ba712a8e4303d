"""`labml_zero/neox/hf_checkpoint.py`: streaming load, checked shapes, atomic
sharded export that Hugging Face reads back."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from labml_zero.neox import model as M
from tests import tolerance
from labml_zero.neox.hf_checkpoint import (HFCheckpoint, hf_named_tensors,
                                           load_layers, save_hf_checkpoint)


def logits(layers, ids):
    with torch.no_grad():
        return nn.Sequential(*layers)(ids)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))


def test_layer_state_dict_reads_only_that_layer(hf_checkpoint_dir, monkeypatch):
    """Only the layer's tensors are read (get_tensor), and only from the files
    that hold them."""
    from labml_zero.hf import safetensors_reader as C

    opened, read = [], []
    real_safe_open = C.safe_open

    class Recording:
        def __init__(self, path, **kwargs):
            opened.append(os.path.basename(path))
            self.f = real_safe_open(path, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    ckpt = HFCheckpoint(hf_checkpoint_dir)
    block = M.build_layers(ckpt.config, filter_layers=[2], device="meta")[1]
    monkeypatch.setattr(C, "safe_open", Recording)
    sd = ckpt.layer_state_dict(block)
    assert set(sd) == set(block.state_dict())
    assert sorted(read) == sorted(f"gpt_neox.layers.2.{name}" for name in sd)
    assert set(opened) == {ckpt.weight_map[name] for name in read}
    # Onto a meta-built layer: to_empty, then load.
    block.to_empty(device="cpu")
    block.load_state_dict(sd)


def test_dtype_cast(hf_checkpoint_dir):
    ckpt = HFCheckpoint(hf_checkpoint_dir)
    head = M.build_layers(ckpt.config, filter_layers=[], device="meta")[-1]
    sd = ckpt.layer_state_dict(head, dtype=torch.bfloat16)
    assert sd["embed_out.weight"].dtype == torch.bfloat16


def test_shape_mismatch_names_tensor_and_both_shapes(hf_checkpoint_dir):
    ckpt = HFCheckpoint(hf_checkpoint_dir)
    wrong = M.NeoXConfig(n_vocab=97, d_model=72, n_heads=3, n_layers=3, d_ff=96)
    block = M.build_layers(wrong, filter_layers=[0], device="meta")[1]
    with pytest.raises(ValueError, match=r"'gpt_neox\.layers\.0\.mlp\.dense_h_to_4h"
                                         r"\.weight'.*\(100, 72\).*\(96, 72\)"):
        ckpt.layer_state_dict(block)


def test_missing_shard_file_names_path(hf_checkpoint_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf_checkpoint_dir.iterdir():
        os.symlink(f, broken / f.name)
    weight_map = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = broken / weight_map["weight_map"]["embed_out.weight"]
    victim.unlink()
    ckpt = HFCheckpoint(broken)
    head = M.build_layers(ckpt.config, filter_layers=[], device="meta")[-1]
    with pytest.raises(FileNotFoundError, match=str(victim)):
        ckpt.layer_state_dict(head)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        HFCheckpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFCheckpoint(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    config = M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(M.to_hf_config(config)))
    save_file({"gpt_neox.embed_in.weight": torch.zeros(50, 16)},
              str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(tmp_path)
    layers = M.build_layers(config, device="meta")
    assert ckpt.layer_state_dict(layers[0])["embed_in.weight"].shape == (50, 16)
    with pytest.raises(ValueError, match=r"no tensor 'embed_out\.weight'"):
        ckpt.layer_state_dict(layers[-1])


def test_export_round_trip_through_hugging_face(hf_model, hf_checkpoint_dir,
                                                tmp_path, ids):
    """HF → our loader → our exporter (several shards) → HF `from_pretrained`
    gives the same logits, and our loader reads our export too."""
    from transformers import GPTNeoXForCausalLM

    ckpt = HFCheckpoint(hf_checkpoint_dir)
    layers = M.build_layers(ckpt.config)
    load_layers(ckpt, layers)
    out = save_hf_checkpoint(tmp_path / "export", ckpt.config,
                             hf_named_tensors(layers), max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    n_files = len(set(index["weight_map"].values()))
    assert n_files > 1
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        f"model-{k:05d}-of-{n_files:05d}.safetensors" for k in range(1, n_files + 1)]
    n_params = sum(p.numel() for p in hf_model.parameters())
    assert index["metadata"]["total_size"] == 4 * n_params

    reloaded = GPTNeoXForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf_model(ids).logits,
                                   **tolerance.parity(torch.float32, terms=(
                                       tolerance.neox_terms(ckpt.config,
                                                            seq=ids.shape[1]))))
    again = M.build_layers(HFCheckpoint(out).config)
    load_layers(HFCheckpoint(out), again)
    torch.testing.assert_close(logits(again, ids), logits(layers, ids),
                               atol=0, rtol=0)


def test_export_single_file_and_dtype(tmp_path):
    config = M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=1)
    layers = M.build_layers(config)
    out = save_hf_checkpoint(tmp_path / "one", config, hf_named_tensors(layers),
                             dtype=torch.float16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json",
                                                     "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    ckpt = HFCheckpoint(out)
    assert ckpt.config == config
    assert ckpt.layer_state_dict(layers[1])["attention.dense.weight"].dtype == \
        torch.float16


def test_export_is_atomic(tmp_path):
    """A failure while streaming leaves neither a target directory nor a temp
    directory; an existing checkpoint is kept unless overwrite is asked."""
    config = M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=1)
    layers = M.build_layers(config)

    def failing():
        for k, item in enumerate(hf_named_tensors(layers)):
            if k == 5:
                raise RuntimeError("disk full")
            yield item

    with pytest.raises(RuntimeError, match="disk full"):
        save_hf_checkpoint(tmp_path / "ckpt", config, failing(), max_shard_bytes=64)
    assert list(tmp_path.iterdir()) == []

    save_hf_checkpoint(tmp_path / "ckpt", config, hf_named_tensors(layers))
    with pytest.raises(FileExistsError, match="ckpt"):
        save_hf_checkpoint(tmp_path / "ckpt", config, hf_named_tensors(layers))
    with pytest.raises(RuntimeError, match="disk full"):
        save_hf_checkpoint(tmp_path / "ckpt", config, failing(), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    HFCheckpoint(tmp_path / "ckpt")  # the old one is intact

    with torch.no_grad():
        layers[0].embed_in.weight.add_(1.0)
    save_hf_checkpoint(tmp_path / "ckpt", config, hf_named_tensors(layers),
                       overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    sd = HFCheckpoint(tmp_path / "ckpt").layer_state_dict(layers[0])
    torch.testing.assert_close(sd["embed_in.weight"], layers[0].embed_in.weight)


def test_views_into_a_flat_buffer_export(tmp_path):
    """Parameters that are views into one flat chunk (as under ZeRO) export as
    separate tensors, not as the whole buffer."""
    config = M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=1)
    flat = torch.arange(2 * 50 * 16, dtype=torch.float32)  # [1600] one chunk
    named = [("gpt_neox.embed_in.weight", flat[:800].view(50, 16)),
             ("embed_out.weight", flat[800:].view(50, 16))]
    out = save_hf_checkpoint(tmp_path / "views", config, named)
    assert (out / "model.safetensors").stat().st_size < 2 * 800 * 4 + 1000


def split_like_neox20b(layers, config, out_dir):
    """Write `layers` as two tensor-parallel partitions in the original 20B file
    layout: the inverse of the merge rules of `NeoX20BCheckpoint`."""
    from labml_zero.neox.hf_checkpoint import NeoX20BCheckpoint as C

    for layer in layers:
        names = (C.LAYER_NAMES if isinstance(layer, M.TransformerLayer)
                 else C.OTHER_NAMES)
        parts = [{}, {}]
        for name, t in layer.state_dict().items():
            file_name, how = names[name]
            if how == "cat0":
                halves = t.chunk(2, dim=0)
            elif how == "cat1":
                halves = t.chunk(2, dim=1)
            elif how == "sum":
                halves = (0.25 * t, 0.75 * t)
            else:  # replicated layer norms, with a little drift that averages out
                halves = (t + 1e-3, t - 1e-3)
            for part, half in zip(parts, halves):
                part[file_name] = half.clone()
        n = config.n_layers
        position = {M.Embedding: 0, M.FinalNorm: n + 3, M.Readout: n + 4}.get(
            type(layer), getattr(layer, "layer_idx", 0) + 2)
        for p, part in enumerate(parts):
            torch.save(part, out_dir / f"layer_{position:02d}-model_{p:02d}"
                                       f"-model_states.pt")


def test_neox20b_partitions_merge(tmp_path):
    from labml_zero.neox.hf_checkpoint import NeoX20BCheckpoint

    # Even head count, so each partition holds whole heads.
    config = M.NeoXConfig(n_vocab=96, d_model=64, n_heads=4, n_layers=2)
    torch.manual_seed(3)
    layers = M.build_layers(config)
    split_like_neox20b(layers, config, tmp_path)

    ckpt = NeoX20BCheckpoint(tmp_path, config=config)
    merged = M.build_layers(config, device="meta")
    for layer in merged:
        layer.to_empty(device="cpu")
    load_layers(ckpt, merged)
    for ours, theirs in zip(layers, merged):
        for (name, a), b in zip(ours.state_dict().items(),
                                theirs.state_dict().values()):
            # a sum of two parts, or an average of two: two roundings of
            # values about 1 (tests/tolerance.py)
            torch.testing.assert_close(b, a, msg=name, **tolerance.parity(
                torch.float32, terms=2, scale=1.0))

    (tmp_path / "layer_03-model_01-model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match="layer_03-model_01"):
        ckpt.layer_state_dict(merged[2])
    wrong = M.NeoXConfig(n_vocab=96, d_model=64, n_heads=4, n_layers=2, d_ff=128)
    block = M.build_layers(wrong, filter_layers=[0], device="meta")[1]
    with pytest.raises(ValueError, match=r"'mlp\.dense_h_to_4h\.weight'.*"
                                         r"\(256, 64\).*\(128, 64\)"):
        NeoX20BCheckpoint(tmp_path, config=wrong).layer_state_dict(block)


# ## Checking a snapshot before any rank starts


def snapshot_copy(hf_checkpoint_dir, tmp_path):
    """A copy of the tiny snapshot that a test may damage."""
    import shutil

    return shutil.copytree(hf_checkpoint_dir, tmp_path / "snapshot")


def refused(path, match_exactly: str):
    from labml_zero.neox.hf_checkpoint import check_hf_snapshot
    from labml_zero.zero3.checkpoint import CheckpointError

    with pytest.raises(CheckpointError) as raised:
        check_hf_snapshot(path)
    assert "\n" not in str(raised.value)
    assert str(raised.value) == match_exactly


def test_check_hf_snapshot_returns_the_config(hf_checkpoint_dir):
    from labml_zero.neox.hf_checkpoint import check_hf_snapshot

    config = check_hf_snapshot(hf_checkpoint_dir)
    assert config == HFCheckpoint(hf_checkpoint_dir).config
    assert (config.d_model, config.n_layers, config.ff_dim) == (72, 3, 100)


def test_check_hf_snapshot_reads_no_tensor_data(hf_checkpoint_dir, monkeypatch):
    from labml_zero.hf import safetensors_reader as C
    from labml_zero.neox.hf_checkpoint import check_hf_snapshot

    real_safe_open = C.safe_open
    read = []

    class HeadersOnly:
        def __init__(self, path, **kwargs):
            self.f = real_safe_open(path, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(C, "safe_open", HeadersOnly)
    check_hf_snapshot(hf_checkpoint_dir)
    assert read == []


@pytest.mark.parametrize("content, reason", [
    ("[1, 2]", "expected a JSON object, got a list"),
    ('{"hidden_size": 64', "not valid JSON (Expecting ',' delimiter: line 1 "
                           "column 19 (char 18))"),
])
def test_config_json_that_is_not_an_object(hf_checkpoint_dir, tmp_path, content,
                                           reason):
    path = snapshot_copy(hf_checkpoint_dir, tmp_path)
    (path / "config.json").write_text(content)
    refused(path, f"{path / 'config.json'}: {reason}")


@pytest.mark.parametrize("change, reason", [
    ({"hidden_size": None}, "no 'hidden_size'"),
    ({"hidden_size": "72"}, "'hidden_size' must be an integer, got the string "
                            "'72'"),
    ({"num_hidden_layers": 2.0}, "'num_hidden_layers' must be an integer, got "
                                 "float 2.0"),
    ({"num_attention_heads": True}, "'num_attention_heads' must be an integer, "
                                    "got bool True"),
    ({"layer_norm_eps": "1e-5"}, "'layer_norm_eps' must be a number, got the "
                                 "string '1e-5'"),
    ({"rope_scaling": [1]}, "'rope_scaling' must be an object, got list [1]"),
    # transformers 4's spelling of a scaling: refused, not dropped
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 4.0}},
     "rope_type 'linear' is not supported"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not one of ['gelu', "
                             "'gelu_fast', 'gelu_new', 'gelu_pytorch_tanh']"),
    ({"num_attention_heads": 5}, "NeoXConfig.d_model=72 is not divisible by "
                                 "n_heads=5"),
])
def test_config_json_with_a_bad_value(hf_checkpoint_dir, tmp_path, change, reason):
    path = snapshot_copy(hf_checkpoint_dir, tmp_path)
    hf = json.loads((path / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    (path / "config.json").write_text(json.dumps(hf))
    refused(path, f"{path / 'config.json'}: {reason}")
    # HFCheckpoint, which the fine-tune builds, says the same
    with pytest.raises(ValueError, match="config.json: "):
        HFCheckpoint(path)


def test_index_without_weight_map(hf_checkpoint_dir, tmp_path):
    path = snapshot_copy(hf_checkpoint_dir, tmp_path)
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}}))
    refused(path, f"{index}: no 'weight_map' object")
    index.write_text(json.dumps({"weight_map": {"embed_out.weight": 3}}))
    refused(path, f"{index}: 'weight_map' maps 'embed_out.weight' to int 3, "
                  "not a file")


def test_index_pointing_at_a_missing_file(hf_checkpoint_dir, tmp_path):
    path = snapshot_copy(hf_checkpoint_dir, tmp_path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())
    victim = path / weight_map["weight_map"]["embed_out.weight"]
    victim.unlink()
    refused(path, f"checkpoint shard not found: {victim}")


def test_garbage_model_safetensors(tmp_path):
    config = M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(M.to_hf_config(config)))
    single = tmp_path / "model.safetensors"
    single.write_bytes(b"<html>404 Not Found</html>" * 10)
    from labml_zero.zero3.checkpoint import CheckpointError

    with pytest.raises(CheckpointError) as raised:
        from labml_zero.neox.hf_checkpoint import check_hf_snapshot

        check_hf_snapshot(tmp_path)
    assert str(raised.value).startswith(f"{single}: not a safetensors file (")
    assert "\n" not in str(raised.value)


def test_tensors_that_do_not_match_the_config(tmp_path):
    config = M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=1)
    layers = M.build_layers(config)
    (tmp_path / "config.json").write_text(json.dumps(M.to_hf_config(config)))
    single = tmp_path / "model.safetensors"
    tensors = dict(hf_named_tensors(layers))

    # a readout of the wrong width
    save_file({**tensors, "embed_out.weight": torch.zeros(50, 8)}, str(single))
    refused(tmp_path, f"tensor 'embed_out.weight' in {single} has shape (50, 8), "
                      "the model expects (50, 16)")
    # a tensor missing
    save_file({k: v for k, v in tensors.items() if k != "embed_out.weight"},
              str(single))
    refused(tmp_path, f"checkpoint {tmp_path} has no tensor 'embed_out.weight', "
                      "which its config.json implies")
    # integer weights
    save_file({**tensors, "embed_out.weight": torch.zeros(50, 16, dtype=torch.int64)},
              str(single))
    refused(tmp_path, f"tensor 'embed_out.weight' in {single} is I64, not "
                      "floating point")
    # a config for two layers, weights for one
    (tmp_path / "config.json").write_text(json.dumps(M.to_hf_config(
        M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=2))))
    save_file(tensors, str(single))
    refused(tmp_path, f"checkpoint {tmp_path} has no tensor "
                      "'gpt_neox.layers.1.input_layernorm.weight', which its "
                      "config.json implies")


def test_missing_snapshot_directory_and_config(tmp_path):
    refused(tmp_path / "nope", f"checkpoint directory not found: {tmp_path / 'nope'}")
    refused(tmp_path, f"checkpoint config not found: {tmp_path / 'config.json'}")


def test_side_files_keep_a_snapshots_own_and_write_the_rest(tmp_path):
    from labml_zero.neox.side_files import hf_side_files, snapshot_dtype
    from labml_zero.neox.tokenizer import BUNDLED_TOKENIZER, load_tokenizer

    written = hf_side_files(BUNDLED_TOKENIZER)
    assert sorted(written) == ["generation_config.json", "tokenizer.json",
                               "tokenizer_config.json"]
    eot = load_tokenizer().token_to_id("<|endoftext|>")
    assert json.loads(written["generation_config.json"])["eos_token_id"] == eot
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "generation_config.json").write_text('{"eos_token_id": 7}')
    (snapshot / "special_tokens_map.json").write_text("{}")
    (snapshot / "chat_template.jinja").write_text("{{ messages }}")
    kept = hf_side_files(BUNDLED_TOKENIZER, snapshot)
    assert kept["generation_config.json"] == '{"eos_token_id": 7}'
    assert kept["special_tokens_map.json"] == "{}"
    assert kept["chat_template.jinja"] == "{{ messages }}"
    # the snapshot's dtype, in either spelling; none without a float one
    for key, value, dtype in [("torch_dtype", "bfloat16", torch.bfloat16),
                              ("dtype", "float16", torch.float16),
                              ("torch_dtype", "int8", None)]:
        (snapshot / "config.json").write_text(json.dumps({key: value}))
        assert snapshot_dtype(snapshot) == dtype
    assert snapshot_dtype(tmp_path / "missing") is None
