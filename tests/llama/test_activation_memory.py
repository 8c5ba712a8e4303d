"""`labml_zero/llama/activation_memory.py`: the count against what autograd keeps.

Tiny odd-sized bf16 Llama models on the CPU (grouped and plain multi-head
attention; tied, with Qwen's q, k, v biases and a head width that is not
d / n_h), every kernel set and fine-tuner, with and without recomputation.
`saved_bytes` and `LiveStorages` are GPT-NeoX's test tools: the distinct
storages autograd saves, and the storages alive at a moment.

The fused RMSNorm, SwiGLU and rotation run compiled only on CUDA; on a CPU
they are their plain twins. So `compiled_twins` swaps each for the same
function compiled by `aot_eager_decomp_partition`: Inductor's decompositions
and its min-cut partitioner, which decide what a compiled function saves,
without Inductor's code generation.
"""

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import bench.activation_probe as probe
from labml_zero.llama import activation_memory as A
from labml_zero.llama import kernels as K
from labml_zero.llama import model as M
from labml_zero.llama import rotary as R
from labml_zero.llama.config import LlamaConfig, llama_3_2_1b
from labml_zero.llama.family import LLAMA, finetuner
from labml_zero.llama.kernels import LlamaKernels
from tests.neox.test_activation_memory import LiveStorages, saved_bytes

BF16 = torch.bfloat16
GQA = LlamaConfig(n_vocab=97, d_model=48, n_heads=6, n_kv_heads=2, n_layers=3,
                  d_ff=100)
CONFIGS = {"gqa": GQA, "mha": dataclasses.replace(GQA, n_kv_heads=6),
           "tied_bias": dataclasses.replace(GQA, tie_embeddings=True,
                                            qkv_bias=True, head_dim=10)}
B, T = 2, 13
KERNELS = {"none": LlamaKernels(), "rms_norm": LlamaKernels(rms_norm=True),
           "swiglu": LlamaKernels(swiglu=True), "rotary": LlamaKernels(rotary=True),
           "loss": LlamaKernels(loss=True, loss_chunk_rows=7),
           "all": LlamaKernels.all_fused()}
# The full fine-tune; LoRA on all seven, on PEFT's default pair, and on each
# projection alone whose input or output is not another's (rank 3: its A x,
# [B, T, 3], has no shape of any other saved tensor)
FINETUNES = {"all": ("all", {}), "lora": ("lora", {"lora_rank": 3}),
             **{f"lora-{'+'.join(t)}": ("lora", {"lora_rank": 3, "lora_targets": t})
                for t in [("q_proj", "v_proj"), ("o_proj",), ("gate_proj",),
                          ("up_proj",), ("down_proj",)]}}


@pytest.fixture
def compiled_twins(monkeypatch):
    """Every fused function compiled on the CPU as it is on CUDA; a
    recompilation past the limit fails rather than running the twin."""
    for module, name, fn in [(K, "rms_norm_fused", K.rms_norm),
                             (K, "swiglu_fused", K.swiglu),
                             (M, "rotate_qk_fused", R.rotate_qk)]:
        monkeypatch.setattr(module, name, cpu_compiled(fn))
    with torch._dynamo.config.patch(recompile_limit=64,
                                    fail_on_recompile_limit_hit=True):
        yield


_COMPILED = {}


def cpu_compiled(fn):
    # one compiled function per twin for the session, so a shape compiles once
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, backend="aot_eager_decomp_partition",
                                      dynamic=False)
    return _COMPILED[fn]


def build(config, finetune, options, kernels, dtype=BF16):
    torch.manual_seed(0)
    layers = M.build_layers(config, dtype=dtype, kernels=kernels)
    lora = {k.removeprefix("lora_"): v for k, v in options.items()}
    finetuner(finetune, **lora)(layers)
    return layers


def tables(layers, dtype=BF16):
    """The rotary cos and sin, one pair for every layer: built before a test
    watches, and left out as the parameters are."""
    return list(layers[1].self_attn.rotary(T, torch.device("cpu"), dtype))


def parameters(layers):
    return [p for layer in layers for p in layer.parameters()]


# ## One layer


@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("ft", FINETUNES)
@pytest.mark.parametrize("kernels", ["none", "rms_norm", "swiglu", "all"])
@pytest.mark.parametrize("name", CONFIGS)
def test_layer_saves_what_the_count_says(compiled_twins, name, kernels, ft,
                                         input_requires_grad):
    config = CONFIGS[name]
    finetune, options = FINETUNES[ft]
    layers = build(config, finetune, options, KERNELS[kernels])
    x = torch.randn(B, T, config.d_model, dtype=BF16,
                    requires_grad=input_requires_grad)
    _, nbytes, _ = saved_bytes(lambda: layers[1](x),
                               exclude=parameters(layers) + tables(layers))
    assert nbytes == A.layer_activation_bytes(
        config, batch=B, seq=T, finetune=finetune, kernels=KERNELS[kernels],
        input_requires_grad=input_requires_grad, **options)


@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_layer(name):
    """In fp32 the plain RMSNorm's fp32 input is the input itself, not a copy."""
    config = CONFIGS[name]
    layers = build(config, "all", {}, None, dtype=torch.float32)
    x = torch.randn(B, T, config.d_model, requires_grad=True)
    _, nbytes, _ = saved_bytes(lambda: layers[1](x), exclude=parameters(layers)
                               + tables(layers, torch.float32))
    assert nbytes == A.layer_activation_bytes(config, batch=B, seq=T,
                                              dtype_bytes=4)


def test_fused_rms_norm_keeps_its_input(compiled_twins):
    """Compiled, the RMSNorm keeps its bf16 input and 1/rms whichever of the
    input and the weight needs the gradient; plain, the fp32 input and 1/rms
    for the input's gradient and x̂ for the weight's."""
    d = 48
    count = {}
    for x_grad, w_grad in [(True, True), (True, False), (False, True)]:
        x = torch.randn(B, T, d, dtype=BF16, requires_grad=x_grad)
        w = torch.randn(d, dtype=BF16, requires_grad=w_grad)
        for fused in (True, False):
            norm = K.rms_norm_fused if fused else K.rms_norm
            _, nbytes, storages = saved_bytes(lambda: norm(x, w, 1e-5), exclude=[w])
            count[fused] = T * B * A._rms_norm_bytes(
                d, 2, input_grad=x_grad, weight_trains=w_grad, fused=fused)
            assert nbytes == count[fused]
            if fused:
                assert {(t.dtype, t.shape[-1]) for t in storages.values()} == {
                    (BF16, d), (torch.float32, 1)}
                assert any(t is x for t in storages.values())


def test_fused_swiglu_recomputes_silu(compiled_twins):
    d_ff = 100
    for g_grad, u_grad in [(True, True), (True, False), (False, True)]:
        g = torch.randn(B, T, d_ff, dtype=BF16, requires_grad=g_grad)
        u = torch.randn(B, T, d_ff, dtype=BF16, requires_grad=u_grad)
        for fused in (True, False):
            gate = K.swiglu_fused if fused else K.swiglu
            _, nbytes, _ = saved_bytes(lambda: gate(g, u))
            assert nbytes == B * T * A._swiglu_bytes(
                d_ff, 2, gate_grad=g_grad, up_grad=u_grad, fused=fused)


# ## The whole model


def forward(layers, batch, *, recompute=False):
    """The engine's order: every unit but the loss head under `checkpoint`
    when recomputing; the readout given the targets returns the loss."""
    x = batch[:, :-1]
    for layer in layers[:-1]:
        x = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
    return layers[-1](x, batch[:, 1:])


@pytest.mark.parametrize("ft", ["all", "lora", "lora-q_proj+v_proj",
                                "lora-up_proj"])
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", CONFIGS)
def test_whole_model_saves_layers_and_loss(compiled_twins, name, kernels, ft):
    """Every tensor the embedding, the layers, the final norm, the readout and
    the loss save: the first layer's smaller set behind LoRA's frozen
    embedding, the chunked loss's two gradients."""
    config = CONFIGS[name]
    finetune, options = FINETUNES[ft]
    layers = build(config, finetune, options, KERNELS[kernels])
    batch = torch.randint(0, config.n_vocab, (B, T + 1))
    _, nbytes, _ = saved_bytes(lambda: forward(layers, batch),
                               exclude=parameters(layers) + tables(layers))
    count = A.activation_bytes(config, batch=B, seq=T, finetune=finetune,
                               kernels=KERNELS[kernels], **options)
    assert nbytes == count.layers + count.readout_loss.saved
    assert count.total == count.layers + count.readout_loss.peak


@pytest.mark.parametrize("ft", ["all", "lora", "lora-up_proj"])
@pytest.mark.parametrize("kernels", ["none", "loss"])
@pytest.mark.parametrize("name", CONFIGS)
def test_whole_model_checkpointed_keeps_inputs(name, kernels, ft):
    """After the forward pass, each layer's input, the final norm's input and
    what the loss head saves are alive, nothing else. (A layer under
    `checkpoint` saves nothing of its own, so the layers' fused kernels do not
    matter here; the compiled twins stay out of `LiveStorages`' dispatch mode,
    under which Dynamo falls back to the plain function.)"""
    config = CONFIGS[name]
    finetune, options = FINETUNES[ft]
    layers = build(config, finetune, options, KERNELS[kernels])
    tables(layers)
    batch = torch.randint(0, config.n_vocab, (B, T + 1))
    live = LiveStorages()
    with live:
        loss = forward(layers, batch, recompute=True)
    count = A.activation_bytes(config, batch=B, seq=T, finetune=finetune,
                               checkpointing=True, kernels=KERNELS[kernels],
                               **options)
    assert live.live() == count.layers + count.readout_loss.saved
    assert count.layers == config.n_layers * B * T * config.d_model * 2
    loss.backward()


@pytest.mark.parametrize("ft", ["all", "lora"])
@pytest.mark.parametrize("kernels", ["none", "rms_norm", "all"])
def test_recomputed_layer_adds_its_set_less_its_input(compiled_twins, kernels, ft):
    """A recomputed layer saves its full set again beside its kept input: all
    of it with the plain RMSNorm (its fp32 copy is a new storage), all but the
    input with the fused one, which saves the input itself."""
    config = CONFIGS["gqa"]
    finetune, options = FINETUNES[ft]
    layers = build(config, finetune, options, KERNELS[kernels])
    x = torch.randn(B, T, config.d_model, dtype=BF16, requires_grad=True)
    _, nbytes, _ = saved_bytes(lambda: layers[2](x),
                               exclude=parameters(layers) + tables(layers) + [x])
    count = A.activation_bytes(config, batch=B, seq=T, finetune=finetune,
                               checkpointing=True, kernels=KERNELS[kernels],
                               **options)
    assert nbytes == count.recomputed


def test_plain_loss_peaks():
    """The plain loss: 10 nV bytes alive in its forward pass, 4 nV left, 12 nV
    in its backward pass, beside the final norm's and the readout's (a vocabulary
    far wider than d, so that the loss's moments are the peaks, as in a real
    model)."""
    config = dataclasses.replace(GQA, n_vocab=2000)
    layers = build(config, "all", {}, None)
    norm, readout = layers[-2], layers[-1]
    x_last = torch.randn(B, T, config.d_model, dtype=BF16, requires_grad=True)
    targets = torch.randint(0, config.n_vocab, (B, T))
    live = LiveStorages()
    with live:
        loss = readout(norm(x_last), targets)
    count = A.readout_loss_bytes(config, batch=B, seq=T)
    # x_L, made before the mode, is not counted: the plain norm keeps its fp32
    # copy, and the model lets x_L go once the norm has run.
    assert live.peak == count.forward_peak
    left = live.live()
    assert left == count.saved
    n, V = B * T, config.n_vocab
    # the bf16 logits and their fp32 copy died; the log-probabilities stay
    assert count.forward_peak - count.saved == (2 + 4) * n * V
    backward = LiveStorages()
    with backward:
        loss.backward()
    assert backward.peak + left == count.backward_peak
    assert count.backward_peak - count.saved == 8 * n * V


@pytest.mark.parametrize("ft", ["all", "lora"])
@pytest.mark.parametrize("recompute", [False, True])
def test_chunked_loss_keeps_its_two_gradients(ft, recompute):
    """The loss kernel keeps ∂L/∂x in bf16 and ∂L/∂W in fp32 whether W
    trains or not, and no logits (its chunk's work is CUDA's, compiled, and
    not checked here)."""
    config = CONFIGS["tied_bias"]
    kernels = KERNELS["loss"]
    finetune, options = FINETUNES[ft]
    layers = build(config, finetune, options, kernels)
    norm, readout = layers[-2], layers[-1]
    x_last = torch.randn(B, T, config.d_model, dtype=BF16, requires_grad=True)
    targets = torch.randint(0, config.n_vocab, (B, T))
    run = ((lambda: readout(checkpoint(norm, x_last, use_reentrant=False), targets))
           if recompute else (lambda: readout(norm(x_last), targets)))
    _, nbytes, storages = saved_bytes(run, exclude=parameters(layers))
    count = A.readout_loss_bytes(config, batch=B, seq=T, finetune=finetune,
                                 checkpointing=recompute, kernels=kernels)
    n, d, V = B * T, config.d_model, config.n_vocab
    grads = {(t.dtype, tuple(t.shape)) for t in storages.values()}
    assert {(BF16, (n, d)), (torch.float32, (V, d))} <= grads
    # under recomputation the hooks see the checkpoint keep x_L
    assert nbytes == count.saved


def test_family_asks_this_page():
    config = CONFIGS["gqa"]
    for checkpointing in (False, True):
        for kernels in (None, LlamaKernels.all_fused()):
            assert LLAMA.activation_memory(
                config, batch=B, seq=T, finetune="all",
                checkpointing=checkpointing, kernels=kernels
            ) == A.activation_bytes(config, batch=B, seq=T,
                                    checkpointing=checkpointing,
                                    kernels=kernels).total


def test_beside_the_gradients_the_loss_has_passed():
    """What is alive while the layers' gradients are made: the layers' own
    (with recomputation their inputs and one layer recomputed), without the
    loss's peak; never more than the total."""
    config = CONFIGS["gqa"]
    for checkpointing in (False, True):
        count = A.activation_bytes(config, batch=B, seq=T, checkpointing=checkpointing)
        assert count.beside_gradients == count.layers + count.recomputed
        assert count.beside_gradients <= count.total
        assert LLAMA.activation_memory(
            config, batch=B, seq=T, checkpointing=checkpointing,
            beside_gradients=True) == count.beside_gradients


def test_the_fused_layer_formula():
    """The page's two formulas for a fully trained bf16 layer."""
    config = llama_3_2_1b()
    n, d, d_ff, d_h = 8 * 2048, config.d_model, config.d_ff, config.head_width
    n_h, n_kv = config.n_heads, config.n_kv_heads
    attention = 2 * (2 * n_h + 2 * n_kv) * d_h + 4 * n_h
    plain = n * (2 * (4 * d + 4 + 2 * d) + 2 * d * 2 + attention + 4 * 2 * d_ff)
    fused = n * (8 * d + 8 + attention + 3 * 2 * d_ff)
    assert A.layer_activation_bytes(config, batch=8, seq=2048) == plain
    assert A.layer_activation_bytes(config, batch=8, seq=2048,
                                    kernels=LlamaKernels.all_fused()) == fused


def test_bad_arguments():
    config = CONFIGS["gqa"]
    with pytest.raises(ValueError, match="batch and seq"):
        A.activation_bytes(config, batch=0, seq=8)
    with pytest.raises(ValueError, match="exceeds"):
        A.activation_memory(config, batch=1, seq=config.max_sequence + 1)
    with pytest.raises(ValueError, match="unknown fine-tuner"):
        A.activation_bytes(config, batch=1, seq=8, finetune="ffn")
    with pytest.raises(ValueError, match="dtype_bytes"):
        A.layer_activation_bytes(config, batch=1, seq=8, dtype_bytes=0)


# ## The device probe, on the CPU


@pytest.mark.parametrize("kernels,finetune", [("none", "all"), ("loss", "lora")])
def test_probe_on_the_cpu(capsys, kernels, finetune):
    assert probe.main(["--model", "tiny", "--batch", "2", "--seq", "13",
                       "--kernels", kernels, "--finetune", finetune,
                       "--device", "cpu"]) == 0
    line = __import__("json").loads(capsys.readouterr().out)
    assert line["layer_saved"] == line["layer_count"] > 0
    assert line["loss_saved"] == line["loss_count"] > 0


def test_probe_refuses_bad_input(capsys):
    assert probe.main(["--model", "tiny", "--kernels", "bogus"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and "unknown kernel" in err.err
    assert probe.main(["--model", "tiny", "--batch", "0"]) == 2
