"""`labml_zero/neox/tokenizer.py`: the bundled GPT-NeoX-20B tokenizer."""

import gzip

import pytest

from labml_zero.neox.tokenizer import (BUNDLED_TOKENIZER, decode, encode,
                                       load_tokenizer, vocab_size)


def test_check_vector(tokenizer):
    text = "First Citizen: Before we proceed any further"
    ids = encode(tokenizer, text)
    assert ids == [6407, 47422, 27, 9613, 359, 4262, 667, 2007]
    assert decode(tokenizer, ids) == text


def test_vocab_size_fits_every_preset_embedding(tokenizer):
    from labml_zero.neox.model import gpt_neox_20b, pythia_70m

    assert vocab_size(tokenizer) == 50281
    assert vocab_size(tokenizer) <= pythia_70m().n_vocab <= gpt_neox_20b().n_vocab


def test_plain_json_path(tmp_path, tokenizer):
    path = tmp_path / "tokenizer.json"
    with gzip.open(BUNDLED_TOKENIZER, "rb") as f:
        path.write_bytes(f.read())
    assert encode(load_tokenizer(path), "Hello") == encode(tokenizer, "Hello")


def test_missing_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "t.json")):
        load_tokenizer(tmp_path / "t.json")


def test_figures_in_the_notes(tokenizer):
    """50,254 learned tokens plus 27 added ones, 50,281 ids in all; the presets'
    embeddings have 50,304 to 50,688 rows."""
    from labml_zero.neox import config as C

    learned = tokenizer.get_vocab_size(with_added_tokens=False)
    assert (learned, vocab_size(tokenizer) - learned) == (50254, 27)
    rows = {getattr(C, name)().n_vocab for name in C.__all__
            if name.startswith(("pythia", "gpt_neox"))}
    assert (min(rows), max(rows)) == (50304, 50688)
