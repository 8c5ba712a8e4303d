"""`labml_zero/neox/config.py`: validation, presets and Hugging Face configs."""

import dataclasses

import pytest

from labml_zero.neox import config as C
from labml_zero.neox import model as M


def test_from_hf_config_reads_shapes(hf_model):
    config = C.from_hf_config(hf_model.config.to_dict())
    assert (config.n_vocab, config.d_model, config.n_heads, config.n_layers,
            config.ff_dim, config.rotary_dim) == (97, 72, 3, 3, 100, 6)
    assert config.gelu_approximate == "none"
    # The hub's transformers-4 spelling, as in EleutherAI/gpt-neox-20b.
    neox20b = {"model_type": "gpt_neox", "hidden_size": 6144,
               "num_attention_heads": 64, "num_hidden_layers": 44,
               "intermediate_size": 24576, "vocab_size": 50432,
               "rotary_pct": 0.25, "rotary_emb_base": 10000,
               "hidden_act": "gelu_fast", "use_parallel_residual": True}
    assert C.from_hf_config(neox20b) == C.gpt_neox_20b()
    assert C.from_hf_config(C.to_hf_config(C.pythia_70m())) == C.pythia_70m()


@pytest.mark.parametrize("changes,match", [
    (dict(d_model=66), "not divisible by n_heads"),
    (dict(rotary_pct=0.2), "must be even"),
    (dict(gelu_approximate="erf"), "gelu_approximate"),
    (dict(n_layers=0), "n_layers"),
])
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(C.tiny(), **changes)


def test_d_ff_follows_d_model_under_replace():
    assert dataclasses.replace(C.tiny(), d_model=128).ff_dim == 512


def test_config_lives_on_its_own_page_and_is_re_exported():
    from labml_zero.neox import config as C

    for name in C.__all__:
        assert getattr(M, name) is getattr(C, name), name
    assert M.NeoXConfig is C.NeoXConfig


def test_figures_in_the_notes():
    """The released vocabularies are padded to a multiple of 128: 50,432 for 20B
    and 6.9B, 50,304 for the small Pythias, 50,688 for 12B; every Pythia rotates
    0.25 of each head with base 10000 over 2048 positions; the tiny default is 2
    layers of width 64."""
    pythias = [C.pythia_70m, C.pythia_160m, C.pythia_410m, C.pythia_1b,
               C.pythia_1_4b, C.pythia_2_8b]
    assert {p().n_vocab for p in pythias} == {50304}
    assert C.gpt_neox_20b().n_vocab == C.pythia_6_9b().n_vocab == 50432
    assert C.pythia_12b().n_vocab == 50688
    for preset in pythias + [C.pythia_6_9b, C.pythia_12b, C.gpt_neox_20b]:
        config = preset()
        assert config.n_vocab % 128 == 0
        assert (config.rotary_pct, config.rotary_base, config.max_position) == (
            0.25, 10000, 2048)
    assert (C.tiny().n_layers, C.tiny().d_model) == (2, 64)
