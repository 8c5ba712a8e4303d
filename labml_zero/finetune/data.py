r"""
---
title: The fine-tune's data
summary: The tokenizer, the training and validation datasets and the run's
  length, decided once from the configuration, before any rank starts and again
  on each rank, with every data problem refused in one line.
---

# The fine-tune's data

`job_data` decides the tokenizer, the training and validation datasets and the
run's length, once on the launcher's host before any rank starts ([the
pre-flight checks](preflight.html)) and again on each rank. One step trains on

$$G = B A N_d$$

samples of $T + 1$ tokens, so the training split must hold at least $G$
samples; each failure is a `DataError` of one line that says what the data has
and what the settings need.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

from tokenizers import Tokenizer

from labml_zero.finetune.corpus import DataError, find_sources
from labml_zero.finetune.dataset import (BUNDLED_SHAKESPEARE, TextDataset,
                                         load_datasets)
from labml_zero.finetune.token_file import TokenCache, stamp, vocab_size
from labml_zero.launch import ranks_text
from labml_zero.zero3.checkpoint import CheckpointError

__all__ = ["JobData", "job_data", "step_samples", "training_key"]


class JobData(NamedTuple):
    """What the data decided."""

    tokenizer: Tokenizer
    train: TextDataset
    valid: TextDataset
    total_steps: int
    """$S$: `steps`, or `epochs` × the steps of an epoch."""
    caches: tuple[TokenCache, ...] = ()
    """The token files decided for `--data` and `--valid-data`: the launcher
    hands them to the ranks (see [deciding once](token_file.html))."""


def step_samples(config, world_size: int) -> int:
    """$G = B A N_d$, the samples of one optimizer step over all ranks."""
    return config.batch_size * config.grad_accum * world_size


def check_fits(dataset: TextDataset, samples: int, *, what: str, layout: str
               ) -> None:
    """Refuse a split with fewer than `samples` samples, in tokens and samples."""
    if len(dataset) >= samples:
        return
    need = samples * dataset.seq_len + 1
    raise DataError(f"the {what} split has {len(dataset.tokens):,} tokens "
                    f"({len(dataset):,} samples of --seq-len {dataset.seq_len}); "
                    f"{layout} needs {samples:,} samples, {need:,} tokens")


def job_data(config, *, world_size: int, n_vocab: int,
             caches: tuple[TokenCache, ...] = ()) -> JobData:
    """
    ## Tokenizer, datasets and steps of the job

    `config` is a `FinetuneConfig`, `n_vocab` the model's embedding rows;
    `caches` are the launcher's token files, given on a rank, which then
    tokenises nothing. The launcher's call does the slow part, tokenising
    `--data` into its [token file](token_file.html) (or scanning a
    pre-tokenised file's ids against the vocabulary), and returns that
    decision (`JobData.caches`); the ranks' calls check the data is unchanged
    and only map the file, so they start in seconds whatever the corpus size.
    """
    # 1. The tokenizer, the [family](../family.html)'s: `--checkpoint`'s own
    # `tokenizer.json` (GPT-NeoX's may lack one), else, for random weights, the
    # bundled GPT-NeoX-20B one, with its end-of-text id.
    family = config.family
    path = family.tokenizer_file(config.checkpoint)
    try:
        tokenizer, eot = family.tokenizer(config.checkpoint, config.model_config())
    except CheckpointError as e:  # its message names the file
        raise DataError(str(e)) from None
    except Exception as e:  # tokenizers raises a bare `Exception` on a bad file
        if isinstance(e, OSError):
            raise
        raise DataError(f"the tokenizer {path} does not load: "
                        f"{' '.join(str(e).split())}") from e
    # A vocabulary of $V$ ids that does not fit the model's embedding of $V_e$
    # rows ($V > V_e$) is refused: an id past the embedding would index outside.
    if vocab_size(tokenizer) > n_vocab:
        raise DataError(f"the tokenizer {path} has {vocab_size(tokenizer):,} ids, "
                        f"more than the model's embedding of {n_vocab:,} rows")
    # 2. The datasets (see [the dataset](dataset.html)): the corpus read,
    # checked and packed into one stream (no weighting or mixing of sources);
    # the validation text or fraction.
    data = load_datasets(seq_len=config.seq_len, source=config.data,
                         tokenizer=tokenizer, eot=eot,
                         valid_fraction=config.valid_fraction,
                         valid_source=config.valid_data,
                         text_field=config.text_field,
                         caches=caches)
    # 3. The steps: the training split must hold $G$ samples, about $GT$ tokens,
    # and validation one batch of $B N_d$, so `--batch-size 100000` is refused
    # before a rank starts, not found by a rank that would run for ever at step
    # 0; with `--epochs`, an epoch is $\lfloor n_\text{samples} / G \rfloor$
    # steps; the warm-up must be shorter than the run.
    b, a = config.batch_size, config.grad_accum
    check_fits(data.train, step_samples(config, world_size), what="training",
               layout=f"one step of --batch-size {b} × --grad-accum {a} × "
                      f"{ranks_text(world_size)}")
    check_fits(data.valid, b * world_size, what="validation",
               layout=f"one batch of --batch-size {b} × {ranks_text(world_size)}")
    steps_per_epoch = len(data.train) // step_samples(config, world_size)
    total = config.steps or config.epochs * steps_per_epoch
    if config.warmup_steps >= total:
        raise DataError(f"--warmup-steps {config.warmup_steps} must be fewer than "
                        f"the run's {total} steps")
    return JobData(tokenizer, data.train, data.valid, total, data.caches)


def training_key(config, caches: tuple[TokenCache, ...] = ()) -> str:
    r"""
    ## What the training split is, wherever its files lie

    A digest of each file `--data` reads (its size and content digest, in the
    order it is read; the bundled text's without `--data`), of the JSON field
    it is read by, and of the part that trains: all of it with
    `--valid-data`, else the first $1 - f$. The paths are left out, so a
    corpus moved or mounted elsewhere is the same split. A checkpoint records
    it (see [resuming](checkpoints.html)), and a resume whose data has
    another is refused before start, even where its samples number the same.

    `caches` are the launcher's token files: their stamps spare reading the
    files again; without them the files are digested here, once more.
    """
    if config.data is None:
        stamps, jsonl = [stamp(BUNDLED_SHAKESPEARE)], False
    else:
        sources = find_sources(config.data)
        jsonl = any(s.jsonl for s in sources)
        decided = {cache.data: cache for cache in caches}.get(str(config.data))
        stamps = (decided.stamps if decided is not None
                  else [stamp(s.path) for s in sources])
    facts = {"files": [(s.size, s.digest) for s in stamps],
             "text_field": config.text_field if jsonl else None,
             "valid_fraction": (None if config.valid_data is not None
                                else config.valid_fraction)}
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]
