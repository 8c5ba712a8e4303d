"""`labml_zero/families.py` and `labml_zero/family.py`: one registry line a
family, each `model_type` and preset name belonging to exactly one family."""

import dataclasses

import pytest

from labml_zero.families import (FAMILIES, UnknownFamily, family_for_model_type,
                                 family_for_preset, model_types)
from labml_zero.family import ModelFamily
from labml_zero.llama.family import LLAMA
from labml_zero.neox.family import NEOX


def test_the_registry_lists_both_families_neox_first():
    assert FAMILIES == (NEOX, LLAMA)
    assert all(isinstance(f, ModelFamily) for f in FAMILIES)
    # every field is filled: a new field without a value fails at construction
    for family in FAMILIES:
        for field in dataclasses.fields(ModelFamily):
            assert getattr(family, field.name) is not None, (family.name, field.name)


def test_no_two_families_share_a_name():
    for key in ("presets", "model_types"):
        names = [n for family in FAMILIES for n in getattr(family, key)]
        assert len(names) == len(set(names)), key
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)


def test_a_model_type_finds_its_family():
    assert family_for_model_type("gpt_neox") is NEOX
    for model_type in ("llama", "qwen2", "mistral"):
        assert family_for_model_type(model_type) is LLAMA
    assert model_types() == ("gpt_neox", "llama", "qwen2", "mistral")


def test_an_unknown_model_type_gets_one_line_naming_the_supported():
    with pytest.raises(UnknownFamily) as info:
        family_for_model_type("gpt2")
    message = str(info.value)
    assert "\n" not in message and "'gpt2'" in message
    assert all(t in message for t in model_types())


def test_a_preset_finds_its_family():
    assert family_for_preset("pythia-160m") is NEOX
    assert family_for_preset("tiny") is NEOX
    assert family_for_preset("smollm2-135m") is LLAMA
    for family in FAMILIES:
        for name in family.presets:
            assert family_for_preset(name) is family
    with pytest.raises(UnknownFamily, match="unknown model preset 'gpt2'"):
        family_for_preset("gpt2")



def test_the_job_asks_the_registrys_family():
    from labml_zero.finetune.config import (FAMILY, FINETUNERS, MODEL_PRESETS,
                                            FinetuneConfig)

    assert FAMILY is family_for_model_type("gpt_neox")
    # every family's presets, each picking its family
    assert MODEL_PRESETS == {**NEOX.presets, **LLAMA.presets}
    assert FINETUNERS == NEOX.finetuners
    assert set(LLAMA.finetuners) <= set(FINETUNERS)
    for family, model in ((NEOX, "tiny"), (LLAMA, "smollm2-135m")):
        config = FinetuneConfig(model=model, finetune="lora", lora_rank=4,
                                lora_alpha=8.0)
        assert config.family is family
        # no --lora-targets: every projection of the family
        assert config.lora_targets == family.lora_targets
        assert config.tuner() == family.finetuner("lora", rank=4, alpha=8.0,
                                                  targets=family.lora_targets)


def test_a_family_refuses_what_it_has_not_in_one_line():
    from labml_zero.finetune.config import FinetuneConfig

    with pytest.raises(ValueError, match="'biases' is not a fine-tuner of the "
                                         "llama family; expected one of all, lora"):
        FinetuneConfig(model="smollm2-135m", finetune="biases")
    with pytest.raises(ValueError, match="unknown projection 'query_key_value'"):
        FinetuneConfig(model="smollm2-135m", finetune="lora",
                       lora_targets=("query_key_value",))
    # a kernel of the other family's (GPT-NeoX's bias + GELU) is not Llama's
    with pytest.raises(ValueError, match="bias_gelu"):
        FinetuneConfig(model="smollm2-135m", kernels="bias_gelu")


def test_each_family_resolves_its_own_kernels():
    """`--kernels` names are the family's: Llama's four fusions by name,
    `auto` every one on CUDA and none on a CPU."""
    from labml_zero.llama.kernels import LlamaKernels

    resolve = LLAMA.resolve_kernels
    assert resolve("rms_norm,swiglu,rotary,loss", "cpu") == LlamaKernels.all_fused()
    assert resolve("auto", "cpu") == LlamaKernels()
    assert resolve("auto", "cuda") == LlamaKernels.all_fused()
    assert resolve("none", "cuda") == LlamaKernels()


def test_the_export_kinds_are_the_export_pages():
    from labml_zero.family import ADAPTER_EXPORT, HF_EXPORT
    from labml_zero.neox.lora_export import ADAPTER, MERGED

    assert (HF_EXPORT, ADAPTER_EXPORT) == (MERGED, ADAPTER)


def test_a_config_names_its_family():
    from labml_zero.families import FAMILIES, UnknownFamily, family_for_config

    for family in FAMILIES:
        for preset in family.presets.values():
            assert family_for_config(preset()) is family
    with pytest.raises(UnknownFamily, match="no model family has configs of type dict"):
        family_for_config({})
