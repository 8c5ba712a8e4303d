"""
Each fused kernel of `labml_zero.neox.kernels` against its plain twin, forward
and backward. Both are compared with the twin computed in float64: the fused
kernel's relative error may be at most twice the twin's own in the same dtype,
or one unit in the last place of that dtype, whichever is larger. On a CPU the
fused functions run as written; where CUDA is present the same tests also run
on the GPU, where they are compiled.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labml_zero.neox import kernels as K
from labml_zero.neox import model as M
from labml_zero.neox.kernels import ModelKernels

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16]


def relative_error(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def outputs_and_grads(fn, inputs, seed=1):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point())
              for t in inputs]
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    # the same output gradients whatever the dtype: drawn in float64 on the
    # CPU, then cast
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, dtype=torch.float64, generator=generator)
             .to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [i.grad for i in inputs
                                         if i.grad is not None]


def assert_twins(plain, fused, inputs, dtype):
    """Every output and gradient of `fused` within the tolerance above."""
    cast = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    ref = outputs_and_grads(plain, [t.double() if t.is_floating_point() else t
                                    for t in inputs])
    twin = outputs_and_grads(plain, cast)
    got = outputs_and_grads(fused, cast)
    assert len(got) == len(ref) == len(twin)
    ulp = torch.finfo(dtype).eps
    for i, (g, t, r) in enumerate(zip(got, twin, ref)):
        assert torch.isfinite(g).all(), i
        assert g.dtype == t.dtype and g.shape == t.shape, i
        # the twin itself is a few units in the last place off the float64
        # reference: a guard against comparing unrelated tensors
        assert relative_error(t, r) <= 4 * ulp, (i, relative_error(t, r))
        bound = max(2 * relative_error(t, r), ulp)
        assert relative_error(g, r) <= bound, (i, relative_error(g, r), bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [64, 50])
def test_chunked_loss_is_the_plain_loss(device, dtype, rows):
    # 50 rows in chunks of 16: a last chunk of 2; two targets ignored
    torch.manual_seed(0)
    x = torch.randn(2, rows // 2, 32, device=device)
    weight = torch.randn(97, 32, device=device) * 0.3
    targets = torch.randint(0, 97, (2, rows // 2), device=device)
    targets[0, 3] = targets[1, 0] = K.IGNORE_INDEX

    def plain(x, w, t):
        return K.plain_readout_loss(x, lambda h: F.linear(h, w), t)

    def fused(x, w, t):
        return K.chunked_readout_loss(x, w, t, chunk_rows=16)

    assert_twins(plain, fused, [x, weight, targets], dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_loss_without_gradients_and_under_autocast(device):
    torch.manual_seed(0)
    x = torch.randn(3, 8, 16, device=device)
    readout = nn.Linear(16, 40, bias=False).to(device)
    targets = torch.randint(0, 40, (3, 8), device=device)
    with torch.no_grad():
        plain = K.plain_readout_loss(x, readout, targets)
        fused = K.fused_readout_loss(x, readout, targets, chunk_rows=5)
    assert torch.allclose(fused, plain, rtol=1e-5)
    # DDP's setting: fp32 weights, bf16 products under autocast
    with torch.autocast(device, dtype=torch.bfloat16):
        plain = K.plain_readout_loss(x, readout, targets)
        fused = K.fused_readout_loss(x, readout, targets, chunk_rows=5)
    assert fused.dtype == plain.dtype == torch.float32
    assert relative_error(fused, plain) <= torch.finfo(torch.bfloat16).eps
    fused.backward()
    assert readout.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rotary_is_the_plain_rotary(device, dtype):
    torch.manual_seed(0)
    config = M.NeoXConfig(n_vocab=64, d_model=64, n_heads=2, n_layers=1)
    qkv = torch.randn(2, 12, 2, 3 * config.head_dim, device=device).transpose(1, 2)
    q, k, _ = qkv.split(config.head_dim, dim=-1)

    def plain(q, k):
        return M.rotary_plain(q, k, config)

    def fused(q, k):
        return M.rotary_fused(q, k, config)

    assert_twins(plain, fused, [q, k], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norms_are_the_two_layer_norms(device, dtype):
    torch.manual_seed(0)
    d, eps = 48, 1e-5
    x = torch.randn(2, 5, d, device=device) * 3 + 1
    w1, b1, w2, b2 = (torch.randn(d, device=device) for _ in range(4))

    def plain(x, w1, b1, w2, b2):
        return F.layer_norm(x, (d,), w1, b1, eps), F.layer_norm(x, (d,), w2, b2, eps)

    def fused(x, w1, b1, w2, b2):
        return K.two_layer_norms_fused(x, w1, b1, w2, b2, eps)

    assert_twins(plain, fused, [x, w1, b1, w2, b2], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fused_bias_gelu_is_linear_then_gelu(device, dtype, approximate):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, device=device)
    weight, bias = torch.randn(96, 32, device=device) * 0.2, torch.randn(96, device=device)

    def plain(x, w, b):
        return F.gelu(F.linear(x, w, b), approximate=approximate)

    def fused(x, w, b):
        return K.linear_bias_gelu_fused(x, w, b, approximate)

    assert_twins(plain, fused, [x, weight, bias], dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_model_with_every_kernel_is_the_plain_model(device):
    """The whole chain, loss and every parameter's gradient, in float32."""
    config = M.tiny()
    results = []
    for kernels in (ModelKernels(), ModelKernels.all_fused()):
        torch.manual_seed(0)
        model = M.NeoXChain(*M.build_layers(config, kernels=kernels)).to(device)
        ids = torch.randint(0, config.n_vocab, (2, 17), device=device,
                            generator=torch.Generator().manual_seed(1)
                            if device == "cpu" else None)
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in
                                        model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    eps = torch.finfo(torch.float32).eps
    assert relative_error(loss1, loss0) <= 16 * eps
    for name, grad in grads0.items():
        # fp32 sums in another order: a few ulps of the gradient's scale
        assert relative_error(grads1[name], grad) <= 1e-4, name


def test_logits_without_targets():
    config = M.tiny()
    model = M.NeoXChain(*M.build_layers(config, kernels=ModelKernels(loss=True)))
    ids = torch.randint(0, config.n_vocab, (2, 9))
    assert model(ids).shape == (2, 9, config.n_vocab)


def test_kernel_names():
    assert ModelKernels.fusions() == ("loss", "rotary", "norms", "bias_gelu")
    assert ModelKernels.from_names("loss,norms") == ModelKernels(loss=True,
                                                                 norms=True)
    assert ModelKernels.from_names("all") == ModelKernels.all_fused()
    assert ModelKernels.from_names("none") == ModelKernels()
    assert ModelKernels.from_names("rotary").names() == "rotary"
    with pytest.raises(ValueError, match="unknown kernel.*bogus"):
        ModelKernels.from_names("loss,bogus")
    with pytest.raises(ValueError, match="attention"):
        ModelKernels(attention="fastest")
    with pytest.raises(ValueError, match="loss_chunk_rows"):
        ModelKernels(loss_chunk_rows=0)
