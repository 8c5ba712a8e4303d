r"""
---
title: Text dataset
summary: Tokenise a corpus once, split it into train and validation, cut
  fixed-length samples, and give each rank a deterministic, resumable order.
---

# Text dataset

The fine-tune reads Tiny Shakespeare (1.1
(tested: tests/neox/test_dataset.py::test_figures_in_the_notes) MB, about 340
(tested: tests/neox/test_dataset.py::test_figures_in_the_notes)
thousand GPT-NeoX tokens). That
is small enough to tokenise once and keep as one `int64` tensor (2.7
(tested: tests/neox/test_dataset.py::test_figures_in_the_notes) MB), so a
sample is a slice, not a file read.

The token array of $N$ tokens is split contiguously into training and
validation text (`split_tokens`), and each split is cut into samples of $T + 1$
tokens with stride $T$ (`TextDataset`), so a split holds

$$n_{\text{samples}} = \left\lfloor \frac{N - 1}{T} \right\rfloor$$

samples, and every token except the first is a target exactly once. In
data-parallel training each of the $N_d$ ranks takes different samples in each
step, in an order that a resumed run repeats exactly (`RankSampler`).

## Limitations

* No document boundaries: samples cross the corpus's lines and scenes freely.
* Resuming needs the same seed, batch size, world size and dataset size;
  `load_state_dict` refuses others instead of silently changing the order.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from labml_zero.neox.tokenizer import encode, load_tokenizer

__all__ = ["load_text", "tokenize", "split_tokens", "TextDataset", "RankSampler",
           "load_datasets", "BUNDLED_SHAKESPEARE"]

# Tiny Shakespeare ships gzipped in the package, so the default run downloads
# nothing; a corpus given by URL is kept in `DEFAULT_CACHE` after its first read.
BUNDLED_SHAKESPEARE = (Path(__file__).resolve().parent.parent / "data"
                       / "tiny_shakespeare.txt.gz")
DEFAULT_CACHE = Path.home() / ".cache" / "labml_zero"


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
    """The whole corpus as one `[N]` int64 tensor of token ids."""
    return torch.tensor(encode(tokenizer, text), dtype=torch.int64)  # [N] int64


class TokenSplits(NamedTuple):
    train: torch.Tensor
    """`[N_train]` int64, the first part of the corpus."""
    valid: torch.Tensor
    """`[N_valid]` int64, the rest."""


def split_tokens(tokens: torch.Tensor, *, valid_fraction: float = 0.1
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
    first is a target exactly once.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int):
        if tokens.dim() != 1:
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
        return self.tokens[start:start + self.seq_len + 1]

    def batch(self, indices: list[int]) -> Batch:
        """Stack samples `indices` into inputs and targets, each `[B, T]`."""
        rows = torch.stack([self.sample(i) for i in indices])  # [B, T + 1]
        return Batch(rows[:, :-1], rows[:, 1:])


class DatasetSplits(NamedTuple):
    train: TextDataset
    valid: TextDataset


def load_datasets(*, seq_len: int, source: str | os.PathLike | None = None,
                  tokenizer: Tokenizer | None = None,
                  valid_fraction: float = 0.1) -> DatasetSplits:
    """
    ### Corpus → tokens → train and validation datasets

    Tokenises once; both datasets hold slices of the one token tensor.
    """
    tokenizer = tokenizer or load_tokenizer()
    splits = split_tokens(tokenize(load_text(source), tokenizer),
                          valid_fraction=valid_fraction)
    return DatasetSplits(TextDataset(splits.train, seq_len=seq_len),
                         TextDataset(splits.valid, seq_len=seq_len))


# ## Order


class RankSampler:
    """
    ## Deterministic, resumable, per-rank batches of sample indices

    Iterating yields the rest of the current epoch as lists of `batch_size`
    indices, then moves to the next epoch; iterate again for that one.
    With `shuffle=False` the order is `0, 1, 2, …` (for validation).

    Each of the $N_d$ ranks must see *different* samples in each step, and a
    resumed run must see exactly the batches the interrupted run would have
    seen. This sampler does both without communication:

    1. The epoch's order is a permutation drawn from a generator seeded with
       `(seed, epoch)`: every rank computes the same permutation (`order`).
    2. Step $s$ takes the slice $[s B N_d, (s+1) B N_d)$ of it (the global
       batch), and rank $r$ takes its $r$-th block of $B$. Blocks are disjoint,
       so ranks are.
    3. Samples left over at the end of an epoch (fewer than $B N_d$) are
       dropped, so every rank runs the same number of steps; a rank that ran one
       more step would wait forever in a collective.
    4. The state is `(epoch, position)`, position being the next step. It
       advances when a batch is handed out, so a checkpoint taken after training
       on a batch resumes at the next one.
    """

    def __init__(self, n_samples: int, *, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n_samples < batch_size * world_size:
            raise ValueError(f"{n_samples} samples are fewer than one global batch "
                             f"(batch_size {batch_size} × world_size {world_size})")
        self.n_samples = n_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Steps per epoch: leftover samples are dropped (step 3 of the class)."""
        return self.n_samples // (self.batch_size * self.world_size)

    def order(self, epoch: int) -> np.ndarray:
        """`[n_samples]` int64, the same on every rank."""
        if not self.shuffle:
            return np.arange(self.n_samples)
        # SeedSequence mixes (seed, epoch) properly: seed + epoch would make
        # (seed 0, epoch 1) and (seed 1, epoch 0) identical.
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        global_batch = self.batch_size * self.world_size
        while self.position < len(self):
            start = self.position * global_batch + self.rank * self.batch_size
            batch = order[start:start + self.batch_size].tolist()
            # Advance before handing out: a checkpoint taken after this batch was
            # trained on resumes at the next one.
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_samples": self.n_samples, "batch_size": self.batch_size,
                "world_size": self.world_size, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]):
        for key in ("seed", "n_samples", "batch_size", "world_size", "shuffle"):
            if state[key] != int(getattr(self, key)):
                raise ValueError(f"RankSampler state has {key}={state[key]}, this "
                                 f"sampler has {int(getattr(self, key))}")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"RankSampler state position {state['position']} out "
                             f"of range [0, {len(self)}]")
        self.epoch = state["epoch"]
        self.position = state["position"]
