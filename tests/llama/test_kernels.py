"""Llama's fused kernels: each fused function against its plain twin, the
model with every kernel on against the plain model, and `resolve_llama_kernels`."""

import pytest
import torch

from labml_zero.llama.config import LlamaConfig, RopeScaling
from labml_zero.llama.kernels import (LlamaKernels, resolve_llama_kernels,
                                      rms_norm, swiglu)
from labml_zero.llama.model import LlamaChain, build_layers
from labml_zero.llama.rotary import LlamaRotary, rotate_qk
from labml_zero.neox.kernels import compiled

# Odd sizes: 6 query heads over 2 key-value heads, vocab 97; chunks of 5 rows
# over 2 × 11 tokens leave a short last chunk.
SHAPE = dict(n_vocab=97, d_model=48, n_heads=6, n_kv_heads=2, n_layers=2,
             d_ff=100, max_position=64,
             rope_scaling=RopeScaling(original_max_position=32))
EPS32 = torch.finfo(torch.float32).eps


def tolerance(reduced_over: int, scale: float = 1.0) -> float:
    """fp32 rounding of a sum of `reduced_over` terms of size `scale`, with a
    factor 8 for the passes around it."""
    return 8 * EPS32 * reduced_over * scale


def model_loss_and_grads(config: LlamaConfig, kernels: LlamaKernels | None,
                         ids, targets):
    torch.manual_seed(0)
    layers = build_layers(config, kernels=kernels, dtype=torch.float32)
    with torch.no_grad():  # norm weights away from one, so they matter
        for name, p in LlamaChain(*layers).named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    chain = LlamaChain(*layers)
    loss = chain(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in chain.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_model_with_every_kernel_is_the_plain_model(tied):
    config = LlamaConfig(**SHAPE, tie_embeddings=tied)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.n_vocab, (2, 11), generator=g)
    targets = torch.randint(0, config.n_vocab, (2, 11), generator=g)
    targets[0, :3] = -100  # ignored targets count neither in sum nor mean
    fused = LlamaKernels(**{n: True for n in LlamaKernels.fusions()},
                         loss_chunk_rows=5)
    plain_loss, plain_grads = model_loss_and_grads(config, None, ids, targets)
    fused_loss, fused_grads = model_loss_and_grads(config, fused, ids, targets)
    # the chunked loss sums the same terms in another order
    tol = tolerance(config.n_vocab, plain_loss.item())
    torch.testing.assert_close(fused_loss, plain_loss, rtol=0, atol=tol)
    assert plain_grads.keys() == fused_grads.keys()
    if tied:
        assert "0.embed_tokens.weight" in plain_grads
    for name, grad in plain_grads.items():
        atol = tolerance(config.n_vocab * 22, grad.abs().max().item())
        torch.testing.assert_close(fused_grads[name], grad, rtol=0, atol=atol,
                                   msg=name)


def test_a_wrong_fused_loss_would_fail():
    """The tolerance above is tight: a loss off by one ignored token's share
    is outside it."""
    config = LlamaConfig(**SHAPE)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.n_vocab, (2, 11), generator=g)
    targets = torch.randint(0, config.n_vocab, (2, 11), generator=g)
    loss, _ = model_loss_and_grads(config, None, ids, targets)
    shifted = targets.clone()
    shifted[0, 0] = -100
    other, _ = model_loss_and_grads(config, None, ids, shifted)
    assert (other - loss).abs() > tolerance(config.n_vocab, loss.item())


def test_fused_functions_compiled_equal_their_twins():
    """`rms_norm`, `swiglu` and `rotate_qk` compiled on the CPU (one graph,
    so the test compiles once) against the same functions eager: outputs and
    every input's gradient."""
    config = LlamaConfig(**SHAPE)
    g = torch.Generator().manual_seed(2)
    d, d_ff, d_h, T = config.d_model, config.d_ff, config.head_width, 7
    cos, sin = LlamaRotary(config)(T, torch.device("cpu"), torch.float32)
    leaves = (torch.randn(2, T, d, generator=g),
              1 + 0.2 * torch.randn(d, generator=g),
              torch.randn(2, T, d_ff, generator=g),
              torch.randn(2, T, d_ff, generator=g),
              torch.randn(2, config.n_heads, T, d_h, generator=g),
              torch.randn(2, config.n_kv_heads, T, d_h, generator=g))

    def every_kernel(x, w, gate, up, q, k):
        return (rms_norm(x, w, config.rms_norm_eps), swiglu(gate, up),
                *rotate_qk(q, k, cos, sin))

    inputs = [t.clone().requires_grad_() for t in leaves]
    twins = [t.clone().requires_grad_() for t in leaves]
    fused_out = compiled(every_kernel)(*inputs)
    plain_out = every_kernel(*twins)
    seeds = [torch.randn(o.shape, generator=g) for o in plain_out]
    torch.autograd.backward(fused_out, seeds)
    torch.autograd.backward(plain_out, seeds)
    for f, p in zip(fused_out, plain_out):
        torch.testing.assert_close(f, p, rtol=0,
                                   atol=tolerance(d, p.abs().max().item()))
    for f, p in zip(inputs, twins):
        # w's gradient sums over the 2 T rows
        torch.testing.assert_close(
            f.grad, p.grad, rtol=0,
            atol=tolerance(2 * T * d, p.grad.abs().max().item()))


def test_rotary_pair_is_each_rotation_and_a_rotation():
    """`rotate_qk` (the function the fused kernel compiles) rotates: norms of
    each pair are kept, and position 0 is unchanged."""
    config = LlamaConfig(**SHAPE)
    rotary = LlamaRotary(config)
    cos, sin = rotary(5, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(3)
    d_h = config.head_width
    q = torch.randn(2, config.n_heads, 5, d_h, generator=g)
    k = torch.randn(2, config.n_kv_heads, 5, d_h, generator=g)
    rq, rk = rotate_qk(q, k, cos, sin)
    half = d_h // 2
    for before, after in ((q, rq), (k, rk)):
        pair = lambda t: t[..., :half] ** 2 + t[..., half:] ** 2
        torch.testing.assert_close(pair(after), pair(before), rtol=0,
                                   atol=tolerance(2, pair(before).max().item()))
        torch.testing.assert_close(after[..., 0, :], before[..., 0, :],
                                   rtol=0, atol=0)


def test_resolve_llama_kernels():
    assert resolve_llama_kernels("auto", "cpu") == LlamaKernels()
    assert resolve_llama_kernels("auto", "cuda") == LlamaKernels.all_fused()
    assert resolve_llama_kernels("none", "cuda") == LlamaKernels()
    picked = resolve_llama_kernels("swiglu, loss", "cpu")
    assert picked == LlamaKernels(swiglu=True, loss=True)
    assert picked.names() == "swiglu,loss"
    assert LlamaKernels.from_names(picked.names()) == picked
    assert LlamaKernels.fusions() == ("rms_norm", "swiglu", "rotary", "loss")
    with pytest.raises(ValueError, match="unknown kernel.*bias_gelu"):
        resolve_llama_kernels("swiglu,bias_gelu", "cpu")
    with pytest.raises(ValueError, match="loss_chunk_rows"):
        LlamaKernels(loss_chunk_rows=0)
