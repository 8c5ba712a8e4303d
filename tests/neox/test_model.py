"""`labml_zero/neox/model.py`: HF parity, preset sizes, meta-device build."""

import dataclasses

import pytest
import torch
from torch import nn

from labml_zero.neox import model as M
from labml_zero.neox.hf_checkpoint import HFCheckpoint, load_layers
from labml_zero.neox.model import NeoXConfig, build_layers, count_parameters
from tests import tolerance


def test_logits_match_hugging_face(hf_model, hf_checkpoint_dir):
    """Our layers, loaded through our streaming loader from HF's sharded
    `save_pretrained`, give HF's logits in fp32."""
    ckpt = HFCheckpoint(hf_checkpoint_dir)
    assert len(set(ckpt.weight_map.values())) > 1, "want a sharded checkpoint"
    layers = build_layers(ckpt.config)
    load_layers(ckpt, layers)
    ids = torch.randint(0, ckpt.config.n_vocab, (2, 29),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = nn.Sequential(*layers)(ids)
        theirs = hf_model(ids).logits
    assert ours.shape == (2, 29, ckpt.config.n_vocab)
    # fp32 logits of two implementations (tests/tolerance.py)
    torch.testing.assert_close(ours, theirs, **tolerance.parity(
        torch.float32, terms=tolerance.neox_terms(ckpt.config, seq=ids.shape[1])))




# Total parameter counts published with the Pythia suite and the GPT-NeoX-20B
# paper; our presets, built on the meta device, must have exactly these.
PUBLISHED = [
    (M.pythia_70m, 70_426_624),
    (M.pythia_160m, 162_322_944),
    (M.pythia_410m, 405_334_016),
    (M.pythia_1b, 1_011_781_632),
    (M.pythia_1_4b, 1_414_647_808),
    (M.pythia_2_8b, 2_775_208_960),
    (M.pythia_6_9b, 6_857_302_016),
    (M.pythia_12b, 11_846_072_320),
    (M.gpt_neox_20b, 20_554_567_680),
]


@pytest.mark.parametrize("preset,n_params", PUBLISHED,
                         ids=[p.__name__ for p, _ in PUBLISHED])
def test_preset_parameter_counts(preset, n_params):
    assert count_parameters(build_layers(preset(), device="meta")) == n_params


@pytest.mark.parametrize("preset", [p for p, _ in PUBLISHED],
                         ids=[p.__name__ for p, _ in PUBLISHED])
def test_parameter_count_formula(preset):
    """The GPT-NeoX page's $12 L d^2 + 2 V d$: the four matrices of a layer
    ($4d^2 + 8d^2$ with $d_{ff} = 4d$) and the two embeddings; biases and layer
    norms, $O(Ld)$, are what it leaves out (under 1% for every preset)."""
    config = preset()
    L, d, V = config.n_layers, config.d_model, config.n_vocab
    assert config.ff_dim == 4 * d
    formula = 12 * L * d**2 + 2 * V * d
    counted = count_parameters(build_layers(config, device="meta"))
    assert formula < counted < 1.01 * formula


def test_meta_build_allocates_nothing_then_materializes():
    config = M.tiny()
    layers = build_layers(config, device="meta")
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    assert len(layers) == config.n_layers + 3

    torch.manual_seed(0)
    for layer in layers:
        layer.to_empty(device="cpu")
        layer.reset_parameters()
    emb, block, norm, head = layers[0], layers[1], layers[-2], layers[-1]
    assert 0.015 < emb.embed_in.weight.std().item() < 0.025
    assert 0.015 < head.embed_out.weight.std().item() < 0.025
    assert torch.all(block.attention.query_key_value.bias == 0)
    assert torch.all(norm.final_layer_norm.weight == 1)
    assert torch.all(norm.final_layer_norm.bias == 0)
    ids = torch.randint(0, config.n_vocab, (1, 8))
    assert torch.isfinite(nn.Sequential(*layers)(ids)).all()


def test_filter_layers_keeps_original_indices():
    config = dataclasses.replace(M.tiny(), n_layers=4)
    layers = build_layers(config, filter_layers={3, 1}, device="meta")
    blocks = [layer for layer in layers if isinstance(layer, M.TransformerLayer)]
    assert [b.layer_idx for b in blocks] == [1, 3]
    assert [M.hf_prefix(b) for b in blocks] == ["gpt_neox.layers.1.",
                                                "gpt_neox.layers.3."]
    assert M.hf_prefix(layers[0]) == "gpt_neox."
    assert M.hf_prefix(layers[-1]) == ""


def test_filter_layers_out_of_range_rejected():
    with pytest.raises(ValueError, match=r"filter_layers \[2\] out of range.*2 "
                                         r"layers"):
        build_layers(M.tiny(), filter_layers=[0, 2], device="meta")


def test_bf16_close_to_fp32():
    """Low precision runs and stays close: rotary angles are fp32 (see
    `rotary_cos_sin`), layer norms in the parameter dtype."""
    config = NeoXConfig(n_vocab=101, d_model=64, n_heads=4, n_layers=2,
                        max_position=512)
    torch.manual_seed(0)
    layers = build_layers(config)
    ids = torch.randint(0, 101, (1, 300))
    with torch.no_grad():
        ref = nn.Sequential(*layers)(ids)
        low = nn.Sequential(*[layer.to(torch.bfloat16) for layer in layers])(ids)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


def test_rotary_angles_are_fp32_even_for_bf16():
    config = NeoXConfig(d_model=64, n_heads=1, rotary_pct=1.0, max_position=4096)
    cos, _ = M.rotary_cos_sin(4000, config, device=torch.device("cpu"),
                              dtype=torch.bfloat16)
    pos = torch.arange(4000, dtype=torch.float64)
    # θ_0 = 1: the angle is the position itself; bf16 positions past 256 would
    # be rounded before the cosine.
    torch.testing.assert_close(cos[:, 0].double(), pos.cos(), atol=1e-2, rtol=0)


def test_attention_keeps_no_view_of_the_fused_qkv_for_backward():
    # The model's note: v is copied so that the saved tensors do not pin the whole
    # [B, T, 3d] output of query_key_value until the backward pass.
    config = NeoXConfig(n_vocab=64, d_model=64, n_heads=4, n_layers=1)
    attention = M.Attention(config).requires_grad_(False)
    x = torch.randn(2, 16, 64, requires_grad=True)
    sizes, qkv_storage = [], []
    attention.query_key_value.register_forward_hook(
        lambda module, args, out: qkv_storage.append(out.untyped_storage()))

    weights = {p.untyped_storage().data_ptr() for p in attention.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            sizes.append((t.untyped_storage().data_ptr(),
                          t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x).sum().backward()
    head_split = 2 * 16 * 64 * 4  # one of q, k, v: [B, n_h, T, d_h] fp32
    (qkv,) = qkv_storage
    assert qkv.nbytes() == 3 * head_split
    assert sizes and qkv.data_ptr() not in {ptr for ptr, _ in sizes}
    # q and k, rotated together, are the two halves of one new tensor
    assert max(n for _, n in sizes) == 2 * head_split


def test_figure_in_the_attention_notes():
    """Copying v frees two thirds of the fused qkv activation: 2 * 2BTd bytes in
    bf16, 134 MB per layer for Pythia-1.4B at 8 x 2048 tokens."""
    d, B, T = M.pythia_1_4b().d_model, 8, 2048
    # "8 sequences of its full context, T = d": 8 · 2048 · 2048 elements of qkv/3
    assert T == M.pythia_1_4b().max_position == d == 2048
    qkv = torch.empty(B, T, 3 * d, dtype=torch.bfloat16, device="meta")
    freed = qkv.numel() * qkv.element_size() * 2 // 3
    assert freed == 2 * 2 * B * T * d
    assert round(freed / 1e6) == 134


def test_bf16_positions_are_exact_up_to_256():
    """The rotary note: in bf16 (8 significant bits) every position up to 256 is
    exact, and 257 is the first that rounds."""
    positions = torch.arange(1024, dtype=torch.float32)
    rounded = positions.to(torch.bfloat16).float()
    wrong = (rounded != positions).nonzero().flatten()
    assert wrong[0].item() == 257
    assert torch.equal(rounded[:257], positions[:257])


def test_tanh_gelu_is_the_formula_of_the_notes():
    """The MLP with `gelu_approximate='tanh'` (GPT-NeoX-20B's `gelu_fast`)
    computes the tanh formula of the MLP's note, with its constant 0.044715."""
    torch.manual_seed(0)
    config = dataclasses.replace(M.tiny(), gelu_approximate="tanh")
    mlp = M.MLP(config).double()
    x = 3 * torch.randn(4, 8, config.d_model, dtype=torch.float64)

    def gelu(h):
        return h / 2 * (1 + torch.tanh((2 / torch.pi) ** 0.5
                                       * (h + 0.044715 * h**3)))

    with torch.no_grad():
        expected = mlp.dense_4h_to_h(gelu(mlp.dense_h_to_4h(x)))
        # fp64 through the MLP's two matmuls (tests/tolerance.py), terms of
        # the outputs' size
        torch.testing.assert_close(mlp(x), expected, **tolerance.parity(
            torch.float64, terms=config.d_model + config.ff_dim,
            scale=expected.abs().max().item()))


def test_sequential_residual_matches_hugging_face(tmp_path):
    """`use_parallel_residual=False`: a random checkpoint written by transformers
    loads through our reader and gives its fp32 logits; the same weights run
    with the parallel residual do not (the test tells the two orders apart)."""
    from transformers import GPTNeoXForCausalLM

    from tests.neox.conftest import tiny_hf_config

    hf_config = tiny_hf_config()
    hf_config.use_parallel_residual = False
    torch.manual_seed(99)
    hf = GPTNeoXForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.config.use_parallel_residual is False
    ids = torch.randint(0, ckpt.config.n_vocab, (2, 17),
                        generator=torch.Generator().manual_seed(0))
    layers = build_layers(ckpt.config)
    load_layers(ckpt, layers)
    parallel = build_layers(dataclasses.replace(ckpt.config,
                                                use_parallel_residual=True))
    load_layers(ckpt, parallel)
    with torch.no_grad():
        ours = nn.Sequential(*layers)(ids)
        theirs = hf(ids).logits
        other = nn.Sequential(*parallel)(ids)
    tol = tolerance.parity(torch.float32, terms=tolerance.neox_terms(
        ckpt.config, seq=ids.shape[1]))
    torch.testing.assert_close(ours, theirs, **tol)
    assert not torch.allclose(other, theirs, **tol)
