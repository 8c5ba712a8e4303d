"""The PEFT adapter: the merge and PEFT's names and config
(labml_zero/hf/peft_adapter.py), on GPT-NeoX's names."""

from __future__ import annotations

import pytest
import torch

from labml_zero.hf.peft_adapter import (blocks_adapter_config, merged,
                                        peft_adapter_config, peft_name)
from labml_zero.neox import model as M
from labml_zero.neox.lora import FineTuneLoRA


# ## Merging a stream of tensors


def test_merge_in_either_order():
    lora = FineTuneLoRA(rank=2, alpha=6.0, targets=("dense",))
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(*s, generator=g) for s in ((4, 5), (2, 5), (4, 2)))
    prefix = "gpt_neox.layers.1.attention.dense."
    expected = w + 3.0 * b @ a
    for order in (["weight", "lora_A", "lora_B"], ["lora_B", "lora_A", "weight"]):
        parts = {"weight": w, "lora_A": a, "lora_B": b}
        stream = [("gpt_neox.embed_in.weight", torch.ones(3))]
        stream += [(prefix + leaf, parts[leaf]) for leaf in order]
        stream += [(prefix + "bias", torch.zeros(4))]
        out = dict(merged(stream, lora))
        # the merged weight comes out as soon as its last part went in
        assert list(out) == ["gpt_neox.embed_in.weight", prefix + "weight",
                             prefix + "bias"]
        torch.testing.assert_close(out[prefix + "weight"], expected)


def test_merge_refuses_a_weight_without_its_adapter():
    lora = FineTuneLoRA(targets=("dense",))
    stream = [("gpt_neox.layers.0.attention.dense.weight", torch.ones(2, 2))]
    with pytest.raises(ValueError, match="attention.dense: no lora_A, lora_B"):
        list(merged(stream, lora))


def test_peft_names_and_config():
    assert (peft_name("gpt_neox.layers.3.mlp.dense_h_to_4h.lora_B")
            == "base_model.model.gpt_neox.layers.3.mlp.dense_h_to_4h.lora_B.weight")
    config = peft_adapter_config(FineTuneLoRA(rank=4, alpha=8), [0, 1, 2], 3)
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["layers_to_transform"] is None
    assert config["target_modules"] == ["query_key_value", "dense",
                                        "dense_h_to_4h", "dense_4h_to_h"]
    subset = peft_adapter_config(FineTuneLoRA(), [2, 0], 3)
    assert subset["layers_to_transform"] == [0, 2]


def test_the_config_of_the_blocks_built():
    config = M.NeoXConfig(n_vocab=50, d_model=16, n_heads=2, n_layers=4)
    blocks = M.build_layers(config, filter_layers=[3, 1], device="meta")[1:-2]
    built = blocks_adapter_config(FineTuneLoRA(), blocks)
    assert built == peft_adapter_config(FineTuneLoRA(), [1, 3], 4)
    assert built["layers_to_transform"] == [1, 3]
    with pytest.raises(ValueError, match="no transformer blocks"):
        blocks_adapter_config(FineTuneLoRA(), [])
