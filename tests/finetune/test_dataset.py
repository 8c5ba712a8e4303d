"""`labml_zero/finetune/dataset.py`: corpus, splits, samples, per-rank order."""

import gzip
import itertools

import pytest
import torch

from labml_zero.finetune.dataset import (BUNDLED_SHAKESPEARE, RankSampler,
                                         TextDataset, load_datasets, load_text,
                                         split_tokens, tokenize)


@pytest.fixture(scope="module")
def corpus_tokens(tokenizer):
    return tokenize(load_text(), tokenizer)


def test_bundled_text_and_local_paths(tmp_path):
    text = load_text()
    assert len(text.encode("utf-8")) == 1_115_394
    assert text.startswith("First Citizen:\nBefore we proceed any further")
    plain = tmp_path / "a.txt"
    plain.write_text("to be or not to be")
    assert load_text(plain) == "to be or not to be"
    packed = tmp_path / "a.txt.gz"
    packed.write_bytes(gzip.compress(b"that is the question"))
    assert load_text(packed) == "that is the question"
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none.txt")):
        load_text(tmp_path / "none.txt")
    assert BUNDLED_SHAKESPEARE.is_file()


def test_split_sizes(corpus_tokens):
    n = len(corpus_tokens)
    assert corpus_tokens.dtype == torch.int64
    splits = split_tokens(corpus_tokens, valid_fraction=0.1)
    assert len(splits.train) == int(n * 0.9)
    assert len(splits.train) + len(splits.valid) == n
    # Contiguous: train is the head of the corpus, valid the tail.
    assert torch.equal(torch.cat([splits.train, splits.valid]), corpus_tokens)
    with pytest.raises(ValueError, match="valid_fraction"):
        split_tokens(corpus_tokens, valid_fraction=1.0)


def test_samples_are_shifted_windows():
    tokens = torch.arange(100)
    ds = TextDataset(tokens, seq_len=8)
    assert len(ds) == (100 - 1) // 8
    batch = ds.batch([0, 3])
    assert batch.inputs.shape == batch.targets.shape == (2, 8)
    assert batch.inputs[1].tolist() == list(range(24, 32))
    assert batch.targets[1].tolist() == list(range(25, 33))
    # Every token but the first is a target exactly once.
    targets = torch.cat([ds.sample(i)[1:] for i in range(len(ds))])
    assert targets.tolist() == list(range(1, 1 + 8 * len(ds)))
    with pytest.raises(IndexError, match="sample 12"):
        ds.sample(12)


def test_load_datasets(tokenizer, corpus_tokens):
    splits = load_datasets(seq_len=128, tokenizer=tokenizer)
    n_train = int(len(corpus_tokens) * 0.9)
    assert len(splits.train) == (n_train - 1) // 128
    assert len(splits.valid) == (len(corpus_tokens) - n_train - 1) // 128


def epoch(sampler):
    return list(sampler)


def test_ranks_see_disjoint_samples_that_cover_the_global_batches():
    world, bs, n = 3, 4, 50
    samplers = [RankSampler(n, batch_size=bs, rank=r, world_size=world, seed=7)
                for r in range(world)]
    per_rank = [epoch(s) for s in samplers]
    assert all(len(batches) == n // (bs * world) for batches in per_rank)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen)) == (n // (bs * world)) * bs * world
    # Step by step, the union of ranks' batches is one global batch.
    for step in zip(*per_rank):
        assert len(set(itertools.chain(*step))) == bs * world


def test_order_is_deterministic_and_changes_per_epoch():
    a = RankSampler(40, batch_size=5, seed=3)
    b = RankSampler(40, batch_size=5, seed=3)
    first_a, first_b = epoch(a), epoch(b)
    assert first_a == first_b
    assert epoch(a) != first_a  # epoch 1 is a new permutation
    assert epoch(RankSampler(40, batch_size=5, seed=4)) != first_a
    assert epoch(RankSampler(40, batch_size=5, shuffle=False))[1] == [5, 6, 7, 8, 9]


def test_resume_continues_with_the_same_batches():
    def make():
        return RankSampler(30, batch_size=2, rank=1, world_size=2, seed=11)

    reference = make()
    ref = epoch(reference) + epoch(reference)

    run = make()
    it = iter(run)
    got = [next(it) for _ in range(3)]  # three steps trained, then checkpoint
    state = run.state_dict()
    assert (state["epoch"], state["position"]) == (0, 3)

    resumed = make()
    resumed.load_state_dict(state)
    got += epoch(resumed) + epoch(resumed)
    assert got == ref


def test_resume_with_other_settings_rejected():
    state = RankSampler(30, batch_size=2, world_size=2, seed=11).state_dict()
    with pytest.raises(ValueError, match="global_batch=4, this sampler has 2"):
        RankSampler(30, batch_size=2, world_size=1, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="n_samples=30, this sampler has 31"):
        RankSampler(31, batch_size=2, world_size=2, seed=11).load_state_dict(state)


def global_steps(layout, steps, n=100, seed=5, state=None):
    """Each step's set of samples over all ranks of `layout` = (B, A, N_d)."""
    batch, accum, world = layout
    samplers = [RankSampler(n, batch_size=batch, grad_accum=accum, rank=r,
                            world_size=world, seed=seed) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    out = [sorted(i for s in samplers for micro in s.next_step() for i in micro)
           for _ in range(steps)]
    return out, samplers[0].state_dict()


def test_elastic_resume_continues_the_global_sequence():
    # G = 6 laid out on 2, 3 and 1 ranks: the same samples step by step, across
    # an epoch boundary (100 // 6 = 16 steps an epoch), whatever the layout
    reference, _ = global_steps((3, 1, 2), 20)
    first, state = global_steps((1, 3, 2), 7)
    second, state = global_steps((1, 2, 3), 8, state=state)
    third, _ = global_steps((3, 2, 1), 5, state=state)
    assert first + second + third == reference
    # a micro-batch's ranks are disjoint, and each rank's batch has B samples
    sampler = RankSampler(100, batch_size=2, grad_accum=2, rank=1, world_size=3)
    assert [len(m) for m in sampler.next_step()] == [2, 2]


def test_sampler_bad_arguments():
    with pytest.raises(ValueError, match="rank 2 out of range"):
        RankSampler(10, batch_size=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        RankSampler(3, batch_size=2, world_size=2)


def test_figures_in_the_notes(corpus_tokens):
    """Tiny Shakespeare is 1.1 MB, about 340k GPT-NeoX tokens, 2.7 MB as int64;
    a split of N tokens holds floor((N - 1) / T) samples."""
    assert round(1_115_394 / 1e6, 1) == 1.1
    assert round(len(corpus_tokens) / 1e4) == 34
    nbytes = corpus_tokens.numel() * corpus_tokens.element_size()
    assert round(nbytes / 1e6, 1) == 2.7
    for seq_len in (7, 128):
        assert len(TextDataset(corpus_tokens, seq_len=seq_len)) == (
            (len(corpus_tokens) - 1) // seq_len)


def test_an_evaluation_larger_than_the_split_says_so():
    from labml_zero.finetune.config import FinetuneConfig
    from labml_zero.finetune.steps import validation_micro_batches

    config = FinetuneConfig(batch_size=2, grad_accum=3, valid_batches=4)
    # 12 micro-batches of 2 x 2 samples asked; 100 samples hold 25
    assert validation_micro_batches(config, 100, 2) == (12, None)
    # 21 samples hold 5 micro-batches: all of them, said in one line
    used, line = validation_micro_batches(config, 21, 2)
    assert used == 5
    assert line == ("validation: the split holds 5 micro-batches of 2 x 2, fewer "
                    "than --valid-batches 4 x --grad-accum 3; each evaluation "
                    "uses all of it")
