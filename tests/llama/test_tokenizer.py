"""`labml_zero/llama/tokenizer.py`: the tokenizer comes from the snapshot's
tokenizer.json (here a small byte-level BPE trained by `tokenizers`)."""

import dataclasses

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from labml_zero.llama.config import tiny
from labml_zero.llama.tokenizer import TOKENIZER_FILE, checkpoint_tokenizer
from labml_zero.neox.tokenizer import decode, encode
from labml_zero.zero3.checkpoint import CheckpointError

TEXT = "First Citizen: Before we proceed any further, hear me speak."


def small_bpe(special: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT] * 20, trainer)
    return tokenizer


def test_the_snapshots_tokenizer_round_trips(tmp_path):
    small_bpe("<|end_of_text|>").save(str(tmp_path / TOKENIZER_FILE))
    config = dataclasses.replace(tiny(), n_vocab=320)  # 300 ids, padded
    tokenizer, eot = checkpoint_tokenizer(tmp_path, config)
    ids = encode(tokenizer, TEXT)
    assert decode(tokenizer, ids) == TEXT
    assert eot == tokenizer.token_to_id("<|end_of_text|>")
    assert max(ids) < config.n_vocab


def test_refusals_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: not found"):
        checkpoint_tokenizer(tmp_path, tiny())
    small_bpe("<unk>").save(str(tmp_path / TOKENIZER_FILE))
    with pytest.raises(CheckpointError, match="no end-of-text token"):
        checkpoint_tokenizer(tmp_path, tiny())
    small_bpe("</s>").save(str(tmp_path / TOKENIZER_FILE))
    with pytest.raises(CheckpointError, match="more than config.json's vocab_size"):
        checkpoint_tokenizer(tmp_path, dataclasses.replace(tiny(), n_vocab=100))
