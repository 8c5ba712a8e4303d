"""The shared LoRA: the adapted linear, PEFT's initialisation, and the
fine-tuner a family subclasses (labml_zero/layers/lora.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from labml_zero.layers.lora import LoRA, LoRALinear


# ## The adapted linear


def test_linear_computes_the_low_rank_update():
    torch.manual_seed(0)
    base = nn.Linear(11, 7)
    lora = LoRALinear.wrap(base, rank=3, alpha=6.0)
    assert lora.weight is base.weight and lora.bias is base.bias
    assert [n for n, _ in lora.named_parameters()] == [
        "weight", "bias", "lora_A", "lora_B"]
    assert lora.lora_A.shape == (3, 11) and lora.lora_B.shape == (7, 3)
    x = torch.randn(5, 11)
    # B = 0 at the start: exactly the base layer
    assert torch.equal(lora(x), base(x))
    with torch.no_grad():
        lora.lora_B.normal_()
    expected = x @ base.weight.T + base.bias + 2.0 * x @ lora.lora_A.T @ lora.lora_B.T
    torch.testing.assert_close(lora(x), expected)


def test_a_is_kaiming_uniform_like_peft():
    torch.manual_seed(0)
    lora = LoRALinear(400, 9, rank=64, alpha=1.0)
    bound = 1 / math.sqrt(400)
    a = lora.lora_A.detach()
    assert a.abs().max() <= bound
    # uniform on ±bound: the largest draw of 25,600 comes within 1% of it
    assert a.abs().max() > 0.99 * bound
    assert torch.count_nonzero(lora.lora_B) == 0


def test_built_on_meta_allocates_nothing():
    lora = LoRALinear.wrap(nn.Linear(5, 4, device="meta"), rank=2, alpha=2.0)
    assert all(p.device.type == "meta" for p in lora.parameters())


class Block(nn.Module):
    """A block with two projections, as a family's transformer block."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.inner = nn.Module()
        self.inner.up = nn.Linear(4, 6)
        self.inner.down = nn.Linear(6, 4)


@dataclass(frozen=True)
class BlockLoRA(LoRA):
    TARGETS: ClassVar[dict[str, str]] = {"up": "inner.up", "down": "inner.down"}
    BLOCK: ClassVar[type[nn.Module]] = Block


def test_a_family_names_its_targets_and_its_block():
    # default: every target; only blocks are adapted, the rest frozen
    assert BlockLoRA().targets == ("up", "down")
    assert BlockLoRA(targets="down").paths() == ["inner.down"]
    other = nn.Linear(4, 4)
    layers = [Block(0), other, Block(3)]
    count = BlockLoRA(rank=2)(layers)
    assert isinstance(layers[2].inner.up, LoRALinear)
    assert not isinstance(other, LoRALinear) and not other.weight.requires_grad
    # per block: up 2 (4 + 6), down 2 (6 + 4)
    assert count.trainable == 2 * (2 * (4 + 6) + 2 * (6 + 4))
    with pytest.raises(ValueError, match="layer 0 inner.up already has"):
        BlockLoRA(rank=2)(layers)
    with pytest.raises(ValueError, match="unknown LoRA target 'q'; expected "
                                         "some of up, down"):
        BlockLoRA(targets=("q",))
