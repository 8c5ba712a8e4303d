"""`labml_zero/llama/model.py`: fp32 logits equal transformers' for Llama
(scaled rotary), tied Llama, Qwen 2 (q/k/v biases) and Mistral."""

import pytest
import torch

from labml_zero.llama.hf_checkpoint import LlamaCheckpoint, load_layers
from labml_zero.llama.model import LlamaChain, build_layers
from tests import tolerance


def llama_terms(config, *, seq: int) -> int:
    """`terms` (tests/tolerance.py) of a logit's path: per layer the q, k and v
    projections and the first norm reduce over $d$, the scores over $d_h$, the
    values over $T$, the output projection over $n_h d_h$, the second norm, gate
    and up over $d$, the down projection over $d_{ff}$; then the final norm and
    the readout over $d$."""
    d, d_h = config.d_model, config.head_width
    layer = 6 * d + d_h + seq + config.n_heads * d_h + config.d_ff
    return config.n_layers * layer + 2 * d


def test_logits_match_transformers(hf_case):
    case, model, path = hf_case
    checkpoint = LlamaCheckpoint(path)
    assert len(set(checkpoint.weight_map.values())) > 1, "want a sharded checkpoint"
    config = checkpoint.config
    assert config.tie_embeddings == model.config.tie_word_embeddings
    layers = build_layers(config)
    load_layers(checkpoint, layers)
    ids = torch.randint(0, config.n_vocab, (2, 41),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = LlamaChain(*layers)(ids)
        theirs = model(ids).logits
    assert ours.shape == (2, 41, config.n_vocab)
    torch.testing.assert_close(ours, theirs, **tolerance.parity(
        torch.float32, terms=llama_terms(config, seq=ids.shape[1])))


def test_sequences_past_the_window_or_the_context_are_refused():
    """Mistral-7B-v0.1's window: a longer sequence would need the window's
    mask inside it, which the model does not apply, so it is refused."""
    import dataclasses

    from labml_zero.llama.config import mistral_7b

    config = dataclasses.replace(mistral_7b(), n_vocab=11, d_model=16, n_heads=2,
                                 n_kv_heads=1, n_layers=1, d_ff=8,
                                 sliding_window=5)
    embedding = build_layers(config)[0]
    assert embedding(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 16)
    try:
        embedding(torch.zeros(1, 6, dtype=torch.long))
    except ValueError as error:
        assert "sequence length 6 exceeds the model's 5" in str(error)
    else:
        raise AssertionError("a sequence past the window was accepted")


@pytest.mark.parametrize("autocast", [False, True])
def test_a_layer_makes_its_rotary_entry_before_its_forward(autocast):
    """The pre-hook makes the tables' entry outside the forward, in the dtype
    of the query's product, so a compiled forward reads it and a recomputed
    one traces the same graph; the forward alone under compilation stores
    nothing (GPT-NeoX's `RotaryTables`, which `LlamaRotary` is)."""
    import dataclasses

    from labml_zero.llama.config import llama_3_2_1b
    from labml_zero.llama.model import DecoderLayer

    config = dataclasses.replace(llama_3_2_1b(), n_vocab=11, d_model=16,
                                 n_heads=2, n_kv_heads=1, n_layers=2, d_ff=8)
    layer = next(m for m in build_layers(config) if isinstance(m, DecoderLayer))
    rotary = layer.self_attn.rotary
    x = torch.randn(1, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = layer(x)
        dtype = torch.bfloat16 if autocast else torch.float32
        assert rotary.keys() == [(5, torch.device("cpu"), dtype)]
        rotary._tables.clear()
        got = torch.compile(layer.forward, backend="eager")(x)  # no pre-hook
    assert rotary.keys() == []
    torch.testing.assert_close(got, want, rtol=0, atol=0)
