"""`finetune/corpus.py`, `finetune/token_file.py`, `finetune/data.py`: every format of
`--data`, the cached token file, and every bad input refused in one line, exit 2,
before any rank starts."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from labml_zero.finetune.cli import main
from labml_zero.finetune.corpus import (PIECE_BYTES, DataError, find_sources,
                                         read_documents)
from labml_zero.finetune.dataset import load_text, tokenize
from labml_zero.finetune.token_file import corpus_tokens, open_token_file
from labml_zero.neox.tokenizer import encode, end_of_text_id


def test_pieces_tokenize_like_the_whole_text(tokenizer, tmp_path):
    # cut at safe line breaks (in memory, and in 1 MiB blocks from a file), the
    # ids are those of the whole text encoded at once
    text = load_text()
    whole = encode(tokenizer, text)
    assert tokenize(text, tokenizer).tolist() == whole
    path = tmp_path / "s.txt"
    path.write_text(text * 2)
    pieces = list(next(read_documents(find_sources(path))))
    assert len(pieces) >= 2
    ids = [i for p in pieces for i in encode(tokenizer, p)]
    assert ids == encode(tokenizer, text * 2)


def test_every_format_packs_documents_with_end_of_text(tokenizer, tmp_path):
    eot = end_of_text_id(tokenizer)
    docs = ["First document.\nTwo lines.", "Second one", "Third, the last"]
    ids = [encode(tokenizer, d) for d in docs]
    packed = [i for d in ids for i in (*d, eot)]

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "n": 1}) + "\n" for d in docs))
    assert corpus_tokens(jsonl, tokenizer, eot=eot).tolist() == packed
    other = tmp_path / "o.jsonl.gz"
    other.write_bytes(gzip.compress("".join(
        json.dumps({"body": d}) + "\n\n" for d in docs).encode()))
    assert corpus_tokens(other, tokenizer, eot=eot, text_field="body"
                         ).tolist() == packed

    folder = tmp_path / "dir"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(docs[0])
    (folder / "b.txt.gz").write_bytes(gzip.compress(docs[1].encode()))
    (folder / "sub" / "c.txt").write_text(docs[2])
    (folder / ".hidden").write_text("never read")
    tokens = corpus_tokens(folder, tokenizer, eot=eot)
    assert tokens.tolist() == packed and isinstance(tokens, np.memmap)
    assert tokens.dtype == np.uint16

    # the cache is a hidden file beside the data, keyed by size and time: the
    # second open maps it without tokenising, a changed file gets a new one
    caches = sorted(tmp_path.glob(".dir.*.tokens.u16"))
    assert len(caches) == 1
    os.utime(caches[0], (1, 1))
    corpus_tokens(folder, tokenizer, eot=eot)
    assert os.stat(caches[0]).st_mtime == 1
    (folder / "a.txt").write_text(docs[0] + "!")
    corpus_tokens(folder, tokenizer, eot=eot)
    assert len(list(tmp_path.glob(".dir.*.tokens.u16"))) == 1

    raw = tmp_path / "pre.u32"
    np.asarray(packed, dtype=np.uint32).tofile(raw)
    assert corpus_tokens(raw, tokenizer, eot=eot).tolist() == packed


SMALL = ["--world-size", "2", "--batch-size", "2", "--seq-len", "32"]


def refused(tmp_path, capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, "--out", str(tmp_path / "out"), "--log-dir",
              str(tmp_path / "logs"), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


BAD_DATA = [
    ("missing", lambda d: str(d / "none.txt"), "no such file or directory"),
    ("empty", lambda d: write(d / "e.txt", b""), "the file is empty"),
    ("no text in dir", lambda d: (d / "x").mkdir() or write(d / "x" / ".h", b"a")
     and str(d / "x"), "the directory has no text"),
    ("binary", lambda d: write(d / "b.txt", b"ab\ncd\x00\x01"),
     "a NUL byte at byte 5 (line 2): a binary file"),
    ("utf-8", lambda d: write(d / "u.txt", b"good\nline two \xff here"),
     "invalid UTF-8 at byte 14, line 2"),
    ("not json", lambda d: write(d / "n.jsonl", b'{"text": "a"}\n{oops\n'),
     "n.jsonl:2: not JSON"),
    ("no field", lambda d: write(d / "f.jsonl", b'{"text": "a"}\n\n{"txt": "b"}\n'),
     "f.jsonl:3: no 'text' field"),
    ("lone surrogate", lambda d: write(d / "s.jsonl", b'{"text": "a\\ud800b"}\n'),
     "s.jsonl:1: 'text' holds a lone surrogate"),
    # what `datasets`' `to_json` writes: read as text, it trains on the markup
    ("json lines as .json", lambda d: write(d / "r.json", b'{"text": "a"}\n'
                                            b'{"text": "b"}\n'),
     "r.json: JSON Lines under a .json name; name it .jsonl"),
    ("json lines in a dir", lambda d: (d / "j").mkdir() or write(
        d / "j" / "r.json", b'{"text": "a"}\n') and str(d / "j"),
     "r.json: JSON Lines under a .json name"),
    ("odd size", lambda d: write(d / "t.u16", b"\x01\x00\x02"),
     "3 bytes is not a whole number of uint16 tokens"),
    ("uint32 as uint16", lambda d: write(d / "w.u16", np.arange(
        1, 3000, dtype=np.uint32).tobytes()), "every second uint16 token is 0, "
     "as in a uint32 token file"),
    ("id too big", lambda d: write(d / "t.u32", np.array(
        [1, 2, 60000, 3], dtype=np.uint32).tobytes()),
     "token 2 is id 60000, not below the vocabulary size"),
    ("too short", lambda d: write(d / "s.txt", b"just a few words"),
     "too few for one sample of --seq-len 32"),
]


@pytest.mark.parametrize("name, make, message", BAD_DATA,
                         ids=[b[0] for b in BAD_DATA])
def test_bad_data_is_one_line_before_any_rank(tmp_path, capsys, name, make,
                                              message):
    err = refused(tmp_path, capsys, "--data", make(tmp_path))
    assert message in err, err


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "100000"], "one step of --batch-size 100000 × --grad-accum "
     "1 × 2 ranks needs 200,000 samples, 6,400,001 tokens"),
    # the default layout (batch 8 of 64 tokens): an epoch shorter than one step
    (["--epochs", "1", "--grad-accum", "1000", "--batch-size", "8", "--seq-len",
      "64"], "has 306,218 tokens (4,784 samples of --seq-len 64); one step of "
     "--batch-size 8 × --grad-accum 1000 × 2 ranks needs 16,000 samples"),
    (["--steps", "120", "--grad-accum", "100000"], "needs 400,000 samples"),
    (["--steps", "5", "--warmup-steps", "5"], "warmup_steps 5 must be fewer than "
     "--steps 5"),
    (["--epochs", "1", "--warmup-steps", "100000"], "--warmup-steps 100000 must "
     "be fewer than the run's"),
    (["--valid-fraction", "1.5"], "valid_fraction must be in (0, 1)"),
    (["--lr-schedule", "step"], "--lr-schedule"),
    (["--min-lr", "1"], "min_lr must be in [0, lr 0.003]"),
])
def test_settings_the_corpus_cannot_hold_are_refused(tmp_path, capsys, args,
                                                     message):
    # the bundled corpus: about 340k tokens, 9,568 training samples of 32
    err = refused(tmp_path, capsys, *args)
    assert message in err, err


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, capsys):
    from labml_zero.neox import model as neox_model
    from labml_zero.neox.hf_checkpoint import hf_named_tensors, save_hf_checkpoint
    from labml_zero.neox.tokenizer import BUNDLED_TOKENIZER

    config = neox_model.tiny()
    small = config.__class__(**{**config.__dict__, "n_vocab": 1000})
    save_hf_checkpoint(tmp_path / "hf", small,
                       hf_named_tensors(neox_model.build_layers(small)))
    (tmp_path / "hf" / "tokenizer.json").write_bytes(
        gzip.decompress(BUNDLED_TOKENIZER.read_bytes()))
    err = refused(tmp_path, capsys, "--checkpoint", str(tmp_path / "hf"))
    assert "tokenizer.json has 50,281 ids, more than the model's embedding of " \
           "1,000 rows" in err, err


def test_a_token_file_is_read_memory_mapped(tmp_path):
    path = tmp_path / "t.u16"
    np.arange(10, dtype=np.uint16).tofile(path)
    tokens = open_token_file(path, vocab=10)
    assert isinstance(tokens, np.memmap) and tokens.tolist() == list(range(10))


def test_valid_data_is_read_apart_and_all_of_data_trains(tokenizer, tmp_path):
    from labml_zero.finetune.dataset import load_datasets

    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt.gz"
    train.write_text("Train on these words, all of them. " * 20)
    valid.write_bytes(gzip.compress(b"Validate on these. " * 10))
    data = load_datasets(seq_len=8, source=train, valid_source=valid,
                         tokenizer=tokenizer, eot=end_of_text_id(tokenizer))
    eot = end_of_text_id(tokenizer)
    assert len(data.train.tokens) == len(encode(tokenizer, train.read_text())) + 1
    assert data.valid.tokens[-1] == eot


def pieces_of(path):
    return list(next(read_documents(find_sources(path))))


def test_a_long_line_is_cut_at_spaces(tokenizer, tmp_path):
    # a text without a line break, and one JSON Lines record of it: pieces of
    # at most PIECE_BYTES, cut before spaces, with the whole text's ids
    text = load_text().replace("\n", " ")
    one_line = tmp_path / "one.txt"
    one_line.write_text(text)
    record = tmp_path / "one.jsonl"
    record.write_text(json.dumps({"text": text}) + "\n")
    whole = encode(tokenizer, text)
    for path in (one_line, record):
        pieces = pieces_of(path)
        assert len(pieces) >= len(text.encode()) // PIECE_BYTES
        assert max(len(p.encode()) for p in pieces) <= PIECE_BYTES
        assert all(p.startswith(" ") for p in pieces[1:])
        assert [i for p in pieces for i in encode(tokenizer, p)] == whole


def test_a_byte_cut_changes_one_pre_token(tokenizer, tmp_path):
    # no whitespace at all: words of ASCII and two-byte letters joined by "-";
    # each cut is at a character's start, and the pieces' ids are the whole
    # text's with the one pre-token the cut falls in tokenised as two halves
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyzéü")
    words = ["".join(rng.choice(letters, size=int(rng.integers(3, 40))))
             for _ in range(20_000)]
    text = "-".join(words)
    path = tmp_path / "words.txt"
    path.write_text(text)
    pieces = pieces_of(path)
    assert "".join(pieces) == text and len(pieces) >= 3
    assert max(len(p.encode()) for p in pieces) <= PIECE_BYTES
    cut_ats = np.cumsum([len(p) for p in pieces])[:-1].tolist()  # in characters
    spans = [span for _, span in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    bounds = {0, len(text)}
    for cut in cut_ats:
        start, end = next(s for s in spans if s[0] < cut < s[1] or s[0] == cut)
        bounds |= {start, cut, end}
    bounds = sorted(bounds)
    expected = [i for a, b in zip(bounds, bounds[1:])
                for i in encode(tokenizer, text[a:b])]
    got = [i for p in pieces for i in encode(tokenizer, p)]
    assert got == expected
    assert got != encode(tokenizer, text)  # the cuts did split words


def test_a_record_longer_than_the_limit_is_refused(tmp_path, monkeypatch):
    from labml_zero.finetune import corpus

    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", 1000)
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n"
                    + json.dumps({"text": "x" * 2000}) + "\n")
    documents = read_documents(find_sources(path))
    assert list(next(documents)) == ["short"]
    with pytest.raises(DataError, match=r"big.jsonl:2: a line longer than"):
        next(documents)


def test_a_json_document_that_is_not_json_lines_reads_as_text(tmp_path):
    from labml_zero.finetune.corpus import find_sources

    # an array, and an object spread over lines: one text document each
    for name, data in (("a.json", b'[{"text": "a"},\n {"text": "b"}]\n'),
                       ("o.json", b'{\n  "text": "a"\n}\n')):
        write(tmp_path / name, data)
        (source,) = find_sources(tmp_path / name)
        assert not source.jsonl
