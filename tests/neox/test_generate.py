"""`labml_zero/neox/generate.py`: greedy and top-k sampling."""

import pytest
import torch
from torch import nn

from labml_zero.neox import model as M
from labml_zero.neox.generate import Sampling, generate, generate_ids
from labml_zero.neox.tokenizer import vocab_size


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return nn.Sequential(*M.build_layers(M.tiny())).eval()


def test_greedy_is_deterministic(model, tokenizer):
    a = generate(model, tokenizer, "First Citizen:", n_tokens=6)
    b = generate(model, tokenizer, "First Citizen:", n_tokens=6)
    assert a == b and len(a) > 0


def test_greedy_picks_argmax():
    # A fake model that always prefers id (last id + 1) mod 5.
    def model(ids):
        logits = torch.zeros(1, ids.shape[1], 8)
        logits[0, -1, (ids[0, -1] + 1) % 5] = 1.0
        logits[0, -1, 7] = 9.0  # past n_vocab: never chosen
        return logits

    assert generate_ids(model, [3], n_tokens=4, n_vocab=5) == [3, 4, 0, 1, 2]


def test_top_k_is_seeded_and_stays_in_top_k(model, tokenizer):
    sampling = Sampling(top_k=5, temperature=0.8)

    def run(seed):
        return generate_ids(model, [6407], n_tokens=8,
                            n_vocab=vocab_size(tokenizer), sampling=sampling,
                            generator=torch.Generator().manual_seed(seed))

    assert run(1) == run(1)
    out = run(2)
    for t in range(1, len(out)):
        with torch.no_grad():
            logits = model(torch.tensor([out[:t]]))[0, -1, :vocab_size(tokenizer)]
        assert out[t] in logits.topk(5).indices.tolist()


def test_sliding_context():
    lengths = []

    def model(ids):
        lengths.append(ids.shape[1])
        return torch.zeros(1, ids.shape[1], 3)

    generate_ids(model, [0, 1], n_tokens=4, n_vocab=3,
                 sampling=Sampling(max_context=3))
    assert lengths == [2, 3, 3, 3]


def test_bad_sampling():
    with pytest.raises(ValueError, match="top_k"):
        Sampling(top_k=0)
