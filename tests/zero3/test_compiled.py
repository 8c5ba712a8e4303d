"""compile_layers: the chosen layers' forwards compiled, the hooks left around them."""

from __future__ import annotations

import torch
from torch import nn

from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.compiled import compile_layers, default_compile_backend
from tests import tolerance
from tests.zero3.models import TINY_TERMS, Block, batch, tiny_layers


def test_only_the_chosen_layers_are_compiled_and_train_alike():
    def build():
        return Zero3Sequential(zero3_layers(
            tiny_layers(0, freeze=False), device=torch.device("cpu"),
            config=ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)))

    eager, compiled = build(), build()
    assert compile_layers(compiled.layers, device=torch.device("cpu"),
                          types=(Block,)) == 3
    for layer in compiled.layers:
        # the call (and the engine's hooks on it) stays the module's own
        assert ("forward" in vars(layer.module)) == isinstance(layer.module, Block)
    x, y = batch(0, 4)
    grads = []
    for model in (eager, compiled):
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([c.local.grad.clone() for c in model.chunks if c.trainable])
    for a, b in zip(*grads):
        # one fp32 pass, maybe summed in another order (tests/tolerance.py)
        torch.testing.assert_close(a, b, **tolerance.parity(
            torch.float32, terms=TINY_TERMS, scale=1.5))


def test_backends():
    assert default_compile_backend(torch.device("cuda", 0)) == "inductor"
    assert default_compile_backend(torch.device("cpu")) == "aot_eager"
