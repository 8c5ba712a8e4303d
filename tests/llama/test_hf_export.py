"""`labml_zero/llama/hf_export.py`: every family's export loads in transformers
(model and tokenizer) with our logits; read → write → read is bit-equal; a
bf16 model stays bf16; a tied embedding is written once."""

import json

import pytest
import torch
from safetensors import safe_open

from labml_zero.llama.hf_checkpoint import LlamaCheckpoint, load_layers
from labml_zero.llama.hf_export import hf_named_tensors, save_llama_checkpoint
from labml_zero.llama.model import LlamaChain, build_layers
from labml_zero.llama.tokenizer import TOKENIZER_FILE
from labml_zero.zero3.checkpoint import CheckpointError
from tests import tolerance
from tests.llama.test_model import llama_terms
from tests.llama.test_tokenizer import TEXT, small_bpe


def stored_names(path) -> set[str]:
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


@pytest.fixture()
def exported(hf_case, tmp_path):
    """`(case, config, layers, out)`: the snapshot read into our layers and
    written back, in small shards, with a tokenizer."""
    case, model, path = hf_case
    checkpoint = LlamaCheckpoint(path)
    layers = build_layers(checkpoint.config)
    load_layers(checkpoint, layers)
    small_bpe("<|end_of_text|>").save(str(tmp_path / TOKENIZER_FILE))
    out = save_llama_checkpoint(tmp_path / "out", checkpoint.config,
                                hf_named_tensors(layers),
                                tokenizer=tmp_path / TOKENIZER_FILE, snapshot=path,
                                max_shard_bytes=20_000)
    return case, checkpoint.config, layers, path, out


def test_transformers_loads_the_export_with_our_logits(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    case, config, layers, _, out = exported
    assert (out / "model.safetensors.index.json").is_file(), "want shards"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.model_type == config.model_type
    ids = torch.randint(0, config.n_vocab, (2, 23),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = LlamaChain(*layers)(ids)
        theirs = model(ids).logits
    torch.testing.assert_close(theirs, ours, **tolerance.parity(
        torch.float32, terms=llama_terms(config, seq=ids.shape[1])))
    tokenizer = AutoTokenizer.from_pretrained(out)
    encoded = tokenizer(TEXT)["input_ids"]
    assert encoded and tokenizer.decode(encoded) == TEXT


def test_a_tied_embedding_is_written_once(exported):
    _, config, _, _, out = exported
    names = stored_names(out)
    assert ("lm_head.weight" in names) != config.tie_embeddings
    assert "model.embed_tokens.weight" in names


def test_read_write_read_is_bit_equal(exported):
    _, _, _, path, out = exported
    first, second = LlamaCheckpoint(path), LlamaCheckpoint(out)
    assert first.config == second.config
    a, b = build_layers(first.config), build_layers(second.config)
    load_layers(first, a)
    load_layers(second, b)
    for x, y in zip(a, b):
        for (n, s), t in zip(x.state_dict().items(), y.state_dict().values()):
            assert torch.equal(s, t), n


def test_bf16_stays_bf16_and_one_shard_has_no_index(tmp_path):
    from labml_zero.llama.config import tiny

    config = tiny()
    layers = build_layers(config, dtype=torch.bfloat16)
    out = save_llama_checkpoint(tmp_path / "out", config, hf_named_tensors(layers))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not (out / "model.safetensors.index.json").exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    back = build_layers(config, dtype=torch.bfloat16)
    load_layers(LlamaCheckpoint(out), back)
    for x, y in zip(layers, back):
        for s, t in zip(x.state_dict().values(), y.state_dict().values()):
            assert torch.equal(s, t)


def test_an_existing_directory_or_a_bad_tokenizer_writes_nothing(tmp_path):
    from labml_zero.llama.config import tiny

    config = tiny()
    layers = build_layers(config)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="taken"):
        save_llama_checkpoint(tmp_path / "taken", config, hf_named_tensors(layers))
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer .*bad.json does not load"):
        save_llama_checkpoint(tmp_path / "new", config, hf_named_tensors(layers),
                              tokenizer=tmp_path / "bad.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "taken"]
