"""`labml_zero/layers/kernel_traffic.py`: the bytes of a plain twin are each
op's reads and writes; a fused function counts as one region; a choice of
kernels adds bytes only for the fusions it leaves off, in both families."""

import pytest
import torch
from torch import nn

from labml_zero.layers.kernel_traffic import (ByteCount, fused_regions,
                                              fused_stand_in)
from labml_zero.llama.config import llama_3_2_1b
from labml_zero.llama.family import LLAMA
from labml_zero.neox import kernels as K
from labml_zero.neox.config import pythia_160m
from labml_zero.neox.family import NEOX

N, D, FF = 24, 40, 72  # odd sizes: no count can come out right by accident
BF16 = 2


def meta(*shape, grad=True):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16,
                       requires_grad=grad)


def test_each_op_reads_its_inputs_and_writes_its_output():
    x = meta(N, D)
    with ByteCount() as count:
        y = x * 2  # read x, write y
        z = y + x  # read both, write z
        z.view(N * D)  # a view: no kernel
    assert count.bytes == (2 + 3) * N * D * BF16
    with ByteCount() as wrong:
        y = x * 2
        z = (y + x) * 1  # one pass more
    assert wrong.bytes == count.bytes + 2 * N * D * BF16


def test_a_fused_function_reads_its_inputs_and_writes_its_outputs_once():
    """The two layer norms forward: x and the four vectors in, two outputs,
    where the twin reads x in several fp32 passes; backward: the two incoming
    gradients and the inputs read, the gradients of x and the vectors written."""
    x = meta(N, D)
    w1, b1, w2, b2 = (meta(D) for _ in range(4))
    assert fused_stand_in() is None
    forward, backward = ByteCount(), ByteCount()
    with forward, fused_regions(forward):
        assert fused_stand_in() is not None
        a, b = K.two_layer_norms_fused(x, w1, b1, w2, b2, 1e-5)
    vectors = 4 * D * BF16
    assert forward.bytes == 3 * N * D * BF16 + vectors
    incoming = (meta(N, D, grad=False), meta(N, D, grad=False))
    with backward, fused_regions(backward):
        # `grad`, not `backward`: no leaf's `.grad` to store
        torch.autograd.grad((a, b), (x, w1, b1, w2, b2), incoming)
    assert fused_stand_in() is None
    assert backward.bytes == (2 + 1 + 1) * N * D * BF16 + 2 * vectors
    with ByteCount() as plain:
        K.two_layer_norms(x, w1, b1, w2, b2, 1e-5)
    assert plain.bytes > 3 * forward.bytes


def test_a_product_inside_a_region_is_not_its_bytes():
    """Bias and GELU after their product: the product's output crosses memory
    once into the element-wise pass, the weight is the product's."""
    x, linear = meta(N, D), nn.Linear(D, FF, device="meta", dtype=torch.bfloat16)
    forward = ByteCount()
    with forward, fused_regions(forward):
        K.up_fused(x, linear, "tanh")
    assert forward.bytes == 2 * N * FF * BF16 + FF * BF16


@pytest.mark.parametrize("family, model", [(NEOX, pythia_160m()),
                                           (LLAMA, llama_3_2_1b())],
                         ids=["neox", "llama"])
def test_only_the_fusions_left_off_add_bytes(family, model):
    # a step's size: a weight's gradient, made once a step, is shared by many
    # tokens, as in training (the meta device allocates nothing)
    size = dict(batch=4, seq=2048)
    fusions = family.resolve_kernels("all", "cuda").fusions()

    def unfused(*off):
        names = ",".join(n for n in fusions if n not in off) or "none"
        return family.unfused_bytes(model, family.resolve_kernels(names, "cuda"),
                                    **size)

    assert unfused() == (0.0, 0.0, 0.0)
    plain = unfused(*fusions)
    for name in fusions:
        one = unfused(name)
        # each fusion left off costs bytes, in its layers or in the loss, and
        # no more than every one off
        assert sum(one) > 0, name
        assert one.layer_forward <= plain.layer_forward, name
        assert one.layer_backward <= plain.layer_backward, name
    # the loss's twin alone touches no layer; it moves the logits in fp32
    # several times, forward and backward
    loss = unfused("loss")
    assert loss.layer_forward == loss.layer_backward == 0
    assert 4 * 4 < loss.rest / model.n_vocab < 10 * 4
