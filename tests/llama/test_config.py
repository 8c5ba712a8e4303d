"""`labml_zero/llama/config.py`: presets have the released shapes (counted by
transformers' own model built from our config.json), the config survives the
round trip, and Llama 3's rotary scaling is HF's."""

import dataclasses

import pytest
import torch

from labml_zero.llama import config as C
from labml_zero.llama.model import build_layers, count_parameters
from labml_zero.llama.rotary import inverse_frequencies

# Parameter counts published on each model card (or its safetensors index).
PUBLISHED = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768,
             "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
             "qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_241_732_096,
             "llama-3.1-8b": 8_030_261_248}


def hf_meta_model(config: C.LlamaConfig):
    """transformers' model of our `to_hf_config`, on the meta device."""
    import transformers

    hf = C.to_hf_config(config)
    config_class = {"llama": transformers.LlamaConfig,
                    "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[config.model_type]
    model_class = getattr(transformers, C.FAMILIES[config.model_type])
    with torch.device("meta"):
        return model_class(config_class(**hf))


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_presets_have_the_released_parameter_counts(name):
    config = C.PRESETS[name]()
    ours = count_parameters(build_layers(config, device="meta"))
    # transformers counts a tied matrix once, as we do
    theirs = sum(p.numel() for p in hf_meta_model(config).parameters())
    assert ours == theirs == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_hf_config_round_trip(name):
    config = C.PRESETS[name]()
    assert C.from_hf_config(C.to_hf_config(config)) == config


def test_fields_a_config_may_leave_out_are_transformers_defaults():
    """A Mistral `config.json` without `sliding_window` has transformers' 4,096
    (an explicit `null` has none); the special tokens' ids travel into an
    export's `config.json`, where `model.config` reads them."""
    from transformers import MistralConfig

    hf = C.to_hf_config(C.mistral_7b())
    del hf["sliding_window"]
    assert C.from_hf_config(hf).sliding_window == MistralConfig().sliding_window
    assert C.from_hf_config({**hf, "sliding_window": None}).sliding_window is None
    ids = {"bos_token_id": 128000, "eos_token_id": [128001, 128009],
           "pad_token_id": None}
    config = C.from_hf_config({**C.to_hf_config(C.tiny()), **ids})
    written = C.to_hf_config(config)
    assert written["bos_token_id"] == 128000
    assert written["eos_token_id"] == [128001, 128009]
    assert "pad_token_id" not in written
    assert C.from_hf_config(written) == config


def test_transformers_5_spelling_of_the_rotary_settings():
    hf = C.to_hf_config(C.llama_3_1_8b())
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {**scaling, "rope_theta": hf.pop("rope_theta")}
    assert C.from_hf_config(hf) == C.llama_3_1_8b()


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b"])
def test_inverse_frequencies_are_transformers(name):
    """The frequencies `inverse_frequencies` gives are bit for bit those of
    transformers' rotary module, with Llama 3's scaling or without."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = C.PRESETS[name]()
    hf = hf_meta_model(dataclasses.replace(config, n_layers=1)).config
    if config.rope_scaling is None:
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    assert torch.equal(inverse_frequencies(config), theirs)
    if config.rope_scaling is not None:
        unscaled = dataclasses.replace(config, rope_scaling=None)
        assert not torch.equal(inverse_frequencies(unscaled), theirs)


def test_bad_fields_are_named():
    with pytest.raises(ValueError, match="n_heads=6 is not divisible by n_kv_heads=4"):
        C.LlamaConfig(n_heads=6, n_kv_heads=4, d_model=48)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        C.from_hf_config({**C.to_hf_config(C.tiny()),
                          "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
