r"""
---
title: Text dataset
summary: Documents packed into fixed-length samples of one token array, split into
  train and validation, and a data order defined over the global sequence of
  samples, so a run resumes at any world size that keeps the global batch.
---

# Text dataset

The fine-tune trains on one array of $N$ token ids: the bundled Tiny
Shakespeare, or with `--data` the [token file](token_file.html) of the user's
corpus. A step wants $B$ sequences of exactly $T$ tokens; *packing*
concatenates the documents, each followed by the tokenizer's end-of-text token,
and cuts the whole stream into windows of $T + 1$ tokens, so a split of $N$
tokens holds

$$n_{\text{samples}} = \left\lfloor \frac{N - 1}{T} \right\rfloor$$

samples, in an order that a resumed run repeats exactly (`RankSampler`), at any
world size that keeps the global batch.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import urllib.request
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from labml_zero.finetune.corpus import DataError
from labml_zero.finetune.token_file import (TokenCache, checked_token_file,
                                           is_token_file, open_cache,
                                           prepare_token_file, vocab_size)

__all__ = ["load_text", "tokenize", "split_tokens", "TextDataset", "RankSampler",
           "load_datasets", "BUNDLED_SHAKESPEARE"]

# Tiny Shakespeare ships gzipped in the package, so the default run downloads
# nothing: 1.1 (tested: tests/finetune/test_dataset.py::test_figures_in_the_notes)
# MB, about 340 (tested: tests/finetune/test_dataset.py::test_figures_in_the_notes)
# thousand GPT-NeoX tokens, tokenised in memory on each start into one `int64`
# array of 2.7 (tested: tests/finetune/test_dataset.py::test_figures_in_the_notes)
# MB. A corpus given by URL is kept in `DEFAULT_CACHE` after its first read.
BUNDLED_SHAKESPEARE = (Path(__file__).resolve().parent.parent / "data"
                       / "tiny_shakespeare.txt.gz")
DEFAULT_CACHE = Path.home() / ".cache" / "labml_zero"
# Where `tokenize` may cut a text for `encode_batch` (see [the corpus](corpus.html)).
SAFE_CUT = re.compile(r"(?<=[!-~])\n(?=[!-~])")
TOKENIZE_PIECE = 1 << 16


# ## Text


def load_text(source: str | os.PathLike | None = None, *,
              cache_dir: str | os.PathLike | None = None) -> str:
    """
    ### Read a corpus

    * `None`: the bundled Tiny Shakespeare.
    * A local path: a text file, or a gzip of one (`.gz`).
    * An `http(s)://` URL: downloaded once into `cache_dir`
      (default `~/.cache/labml_zero`) and read from there afterwards.
    """
    if source is None:
        path = BUNDLED_SHAKESPEARE
    elif str(source).startswith(("http://", "https://")):
        path = _download(str(source), Path(cache_dir or DEFAULT_CACHE))
    else:
        path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def _download(url: str, cache_dir: Path) -> Path:
    """
    #### Download `url` to a cache file

    The file name carries a hash of the URL, so two URLs with the same base name
    do not collide. Written to a temporary name and renamed, so an interrupted
    download is not mistaken for a cached file.
    """
    name = url.rstrip("/").rsplit("/", 1)[-1] or "download"
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    path = cache_dir / f"{digest}-{name}"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, \
                open(tmp, "wb") as f:
            while block := response.read(1 << 20):
                f.write(block)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def tokenize(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """
    ### A text in memory as one `[N]` int64 tensor of token ids

    Cut at safe line breaks into pieces of about `TOKENIZE_PIECE` characters and
    tokenised as a batch, in parallel: the same ids as the whole text at once
    (tested: tests/finetune/test_corpus.py::test_pieces_tokenize_like_the_whole_text).
    """
    pieces, start = [], 0
    for match in SAFE_CUT.finditer(text):
        if match.end() - start >= TOKENIZE_PIECE:
            pieces.append(text[start:match.end()])
            start = match.end()
    pieces.append(text[start:])
    encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
    ids = [i for encoding in encodings for i in encoding.ids]
    return torch.tensor(ids, dtype=torch.int64)  # [N] int64


class TokenSplits(NamedTuple):
    train: torch.Tensor | np.ndarray
    """`[N_train]`, the first part of the corpus."""
    valid: torch.Tensor | np.ndarray
    """`[N_valid]`, the rest."""


def split_tokens(tokens: torch.Tensor | np.ndarray, *, valid_fraction: float = 0.1
                 ) -> TokenSplits:
    r"""
    ### Contiguous train/validation split

    The first $\lfloor (1 - f) N \rfloor$ tokens train, the rest validate,
    with $f$ = `valid_fraction` (`0.1` by default). Contiguous, because a random
    split of overlapping windows would put the same lines in both.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    n_train = int(len(tokens) * (1.0 - valid_fraction))
    return TokenSplits(tokens[:n_train], tokens[n_train:])


# ## Samples


class Batch(NamedTuple):
    inputs: torch.Tensor
    """`[B, T]` int64 token ids."""
    targets: torch.Tensor
    """`[B, T]` int64, `inputs` shifted left by one."""


class TextDataset:
    """
    ## Fixed-length samples of one token array

    Sample $i$ is `tokens[i*T : i*T + T + 1]`, tokens $[iT, iT + T]$: its input
    the first $T$ and its target the last $T$ (the input shifted by one).
    Consecutive samples share one boundary token, so every token except the
    first is a target exactly once. `tokens` is a tensor or a NumPy array (a
    memory map of a token file: a sample reads only its own pages).

    Padding each document to $T$ would waste the tokens of the pad; cutting
    each one into its own windows would waste its tail. So a window may hold
    the end of one document and the start of the next; the end-of-text token
    between them tells the model that what follows does not continue what came
    before, the way GPT-NeoX and Pythia were pre-trained. Attention is not
    masked at that boundary: the token is the only separator, as in
    pre-training.
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, *, seq_len: int):
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.numpy()
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one sample of "
                             f"seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def sample(self, i: int) -> torch.Tensor:
        """Sample `i` as `[T + 1]` int64."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1]  # [T + 1] from disk
        return torch.from_numpy(np.asarray(window, dtype=np.int64))  # [T + 1] int64

    def batch(self, indices: list[int]) -> Batch:
        """Stack samples `indices` into inputs and targets, each `[B, T]`."""
        rows = torch.stack([self.sample(i) for i in indices])  # [B, T + 1]
        return Batch(rows[:, :-1], rows[:, 1:])


class DatasetSplits(NamedTuple):
    train: TextDataset
    valid: TextDataset
    caches: tuple[TokenCache, ...] = ()
    """The token files of `source` and `valid_source` that text was read from."""


def load_datasets(*, seq_len: int, tokenizer: Tokenizer, eot: int | None = None,
                  source: str | os.PathLike | None = None,
                  valid_fraction: float = 0.1,
                  valid_source: str | os.PathLike | None = None,
                  text_field: str = "text",
                  caches: tuple[TokenCache, ...] = ()) -> DatasetSplits:
    """
    ### Corpus → tokens → train and validation datasets

    `source=None` is Tiny Shakespeare, tokenised in memory; a path is `--data`,
    through its [token file](token_file.html). With `valid_source` the
    validation text is that, and all of `source` trains; otherwise the last
    `valid_fraction` of it validates. `caches` are the launcher's decided token
    files, given on a rank: text is opened through them, never tokenised there.
    `eot` is the tokenizer's end-of-text id (the model's family knows it), which
    separates the documents of a file; `None` refuses a file.
    """
    decided = {cache.data: cache for cache in caches}
    used = []

    def tokens_of(path, flag: str = "--data"):
        if path is None:
            return tokenize(load_text(), tokenizer)
        if eot is None:
            raise DataError(f"{flag} {path}: the tokenizer has no end-of-text "
                            f"token, so documents cannot be separated")
        try:
            if is_token_file(path):
                cache = decided.get(str(path)) or checked_token_file(
                    path, vocab=vocab_size(tokenizer))
            else:
                cache = decided.get(str(path)) or prepare_token_file(
                    path, tokenizer, eot=eot, text_field=text_field)
            used.append(cache)
            return open_cache(cache, vocab=vocab_size(tokenizer))
        except DataError as e:
            # the corpus's messages name `--data`; the validation text is
            # another flag's, and the user must be told which file is wrong
            if flag == "--data" or not str(e).startswith("--data "):
                raise
            raise DataError(flag + str(e)[len("--data"):]) from None

    if valid_source is not None:
        splits = TokenSplits(tokens_of(source),
                             tokens_of(valid_source, "--valid-data"))
    else:
        splits = split_tokens(tokens_of(source), valid_fraction=valid_fraction)
    datasets = []
    for name, tokens in zip(("training", "validation"), splits):
        if len(tokens) < seq_len + 1:
            raise DataError(f"the {name} split has {len(tokens):,} tokens, too few "
                            f"for one sample of --seq-len {seq_len} (needs "
                            f"{seq_len + 1:,})")
        datasets.append(TextDataset(tokens, seq_len=seq_len))
    return DatasetSplits(*datasets, caches=tuple(used))


# ## Order


class RankSampler:
    r"""
    ## The data order, over the global sequence of samples

    The order is defined for the whole job, not per rank: epoch $e$ is a
    permutation $\pi_e$ of the samples, and step $s$ of it trains on the
    global batch of $G = B A N_d$ samples $\pi_e[sG : (s+1)G]$. That batch is
    cut into $A$ micro-batches of $B N_d$, and rank $r$ takes block $r$ of each:

    $$\text{micro-batch } a \text{ of rank } r = \pi_e[sG + aBN_d + rB \;:\;
      sG + aBN_d + (r+1)B]$$

    1. Every rank computes the same permutation from `(seed, epoch)` (`order`),
       so no communication is needed and blocks are disjoint.
    2. An epoch is $\lfloor n / G \rfloor$ steps; the leftover samples (fewer
       than $G$) are dropped, so every rank runs the same steps (a rank that
       ran one more would wait forever in a collective).
    3. The state is `(epoch, position)`, the position being the next step. It
       advances when a step's batches are handed out, so a checkpoint taken
       after training on them resumes at the next step.
    4. Which samples a step trains on depends on $G$ alone, not on how it is
       laid out as $B$, $A$ and $N_d$: a run resumed at another world size with
       the same $G$ continues the same sequence (an *elastic* resume), and the
       mean loss over the step, hence the gradient, is the same up to the order
       of the sums.
    """

    def __init__(self, n_samples: int, *, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 grad_accum: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if batch_size < 1 or grad_accum < 1:
            raise ValueError(f"batch_size and grad_accum must be >= 1, got "
                             f"{batch_size} and {grad_accum}")
        self.global_batch = batch_size * grad_accum * world_size
        if n_samples < self.global_batch:
            raise ValueError(f"{n_samples} samples are fewer than one global batch "
                             f"(batch_size {batch_size} × grad_accum {grad_accum} "
                             f"× world_size {world_size})")
        self.n_samples = n_samples
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        """Steps per epoch: leftover samples are dropped (step 2 of the class)."""
        return self.n_samples // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        """`[n_samples]` int64, the same on every rank and at every world size."""
        if not self.shuffle:
            return np.arange(self.n_samples)
        if self._order is None or self._order[0] != epoch:
            # SeedSequence mixes (seed, epoch) properly: seed + epoch would make
            # (seed 0, epoch 1) and (seed 1, epoch 0) identical.
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(self.n_samples))
        return self._order[1]

    def step_batches(self, epoch: int, step: int) -> list[list[int]]:
        """This rank's `grad_accum` micro-batches of `step` of `epoch` (pure)."""
        order = self.order(epoch)
        micro = self.batch_size * self.world_size
        first = step * self.global_batch + self.rank * self.batch_size
        return [order[first + a * micro:first + a * micro + self.batch_size].tolist()
                for a in range(self.grad_accum)]

    def next_step(self) -> list[list[int]]:
        """The next step's micro-batches; moves the position past them."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        batches = self.step_batches(self.epoch, self.position)
        # Advance before handing out: a checkpoint taken after this step was
        # trained on resumes at the next one.
        self.position += 1
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch, micro-batch by micro-batch."""
        while self.position < len(self):
            yield from self.next_step()
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_samples": self.n_samples, "global_batch": self.global_batch,
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]):
        # Another seed, global batch or training split would silently change
        # the order: refused.
        for key in ("seed", "n_samples", "global_batch", "shuffle"):
            if state.get(key) != int(getattr(self, key)):
                raise ValueError(f"RankSampler state has {key}={state.get(key)}, "
                                 f"this sampler has {int(getattr(self, key))}")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"RankSampler state position {state['position']} out "
                             f"of range [0, {len(self)}]")
        self.epoch = state["epoch"]
        self.position = state["position"]
