"""`labml_zero/neox/finetuners.py`: which parameters train."""

import pytest

from labml_zero.neox import model as M
from labml_zero.neox.finetuners import (FineTuneAll, FineTuneBiases, FineTuneFFN,
                                        finetuner)
from labml_zero.neox.lora import FineTuneLoRA


@pytest.fixture
def layers():
    return M.build_layers(M.tiny(), device="meta")


def test_biases(layers):
    c = M.tiny()
    count = FineTuneBiases()(layers)
    # Per layer: the QKV bias (3d), the attention output bias (d), the MLP's
    # first bias (d_ff).
    assert count.trainable == c.n_layers * (3 * c.d_model + c.d_model + c.ff_dim)
    assert count.total == M.count_parameters(layers)
    names = {name for layer in layers for name, p in layer.named_parameters()
             if p.requires_grad}
    assert names == set(FineTuneBiases.BIASES)


def test_ffn(layers):
    c = M.tiny()
    count = FineTuneFFN()(layers)
    mlp = 2 * c.d_model * c.ff_dim + c.ff_dim + c.d_model
    assert count.trainable == c.n_layers * mlp
    assert not any(p.requires_grad for p in layers[0].parameters())


def test_all_after_another(layers):
    FineTuneBiases()(layers)
    count = FineTuneAll()(layers)
    assert count.trainable == count.total == M.count_parameters(layers)


def test_lookup_by_name():
    assert isinstance(finetuner("biases"), FineTuneBiases)
    assert isinstance(finetuner("ffn"), FineTuneFFN)
    assert isinstance(finetuner("all"), FineTuneAll)
    assert finetuner("lora", rank=4, alpha=8) == FineTuneLoRA(rank=4, alpha=8)
    with pytest.raises(ValueError, match="unknown fine-tuner 'adapters'"):
        finetuner("adapters")
