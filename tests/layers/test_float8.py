"""fp8 products (labml_zero/layers/float8.py) on the CPU through torchao's
emulation: which linears convert, training under the chunk engine at world 1
and 2 against the plain model, the activation count, and the refusals.

`LABML_ZERO_TEST_BACKEND=nccl` (on the device machine) trains the same models
with the real fp8 kernels (`torch._scaled_mm`) against the plain model on that
GPU: the emulation is written to round as they do, so the same tolerance holds."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torchao.float8")

from bench.workloads import shrink, workloads  # noqa: E402
from labml_zero.assembly import Recipe, assemble  # noqa: E402
from labml_zero.layers import float8  # noqa: E402
from labml_zero.llama import family as llama_family, model as llama_model  # noqa: E402
from labml_zero.llama.config import LlamaConfig  # noqa: E402
from labml_zero.llama.kernels import LlamaKernels, resolve_llama_kernels  # noqa: E402
from labml_zero.neox import model as neox_model  # noqa: E402
from labml_zero.neox.build import resolve_kernels  # noqa: E402
from labml_zero.neox.kernels import ModelKernels  # noqa: E402
from labml_zero.zero3 import ZeroConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

warnings.filterwarnings("ignore", message=".*KernelPreference.*")

STEPS = 3
U8 = 2.0 ** -4  # e4m3: 3 mantissa bits
CONFIGS = {"neox": shrink(workloads()["W1"]).model,
           "llama": shrink(workloads()["L1"]).model}


def family(name: str):
    return (neox_model, neox_model.init_parameter, ModelKernels) if name == "neox" \
        else (llama_model, llama_family.init_parameter, LlamaKernels)


def build(name: str, *, fp8: bool, device: torch.device,
          zero_fp8_weights: bool = False):
    """The tiny model of `name`, built on meta and assembled at fp32 on `device`
    with a fixed seed (the CPU emulates fp8, a GPU runs the real kernels);
    `zero_fp8_weights` zeroes the weights of the linears fp8 would take."""
    model, init_parameter, kernels = family(name)
    config = CONFIGS[name]
    layers = model.build_layers(config, device="meta",
                                kernels=kernels(fp8=fp8,
                                                fp8_emulate=fp8 and device.type == "cpu",
                                                fp8_every_linear=fp8))
    chosen = {f"{n}.weight" for layer in layers[1:-2]
              for n, m in layer.named_modules() if float8.fp8_linear(m, every_linear=True)}
    base = init_parameter(config)

    def init(param_name: str, p: torch.Tensor) -> None:
        base(param_name, p)
        if zero_fp8_weights and any(param_name.endswith(c) for c in chosen):
            p.zero_()

    recipe = Recipe(zero=ZeroConfig(dtype=torch.float32, chunk_numel=8192),
                    lr=1e-3, seed=3)
    return assemble(layers, recipe, device=device, init_param=init)


def fp8_depth(name: str) -> int:
    """fp8 products one after another on a value's longest path: GPT-NeoX's
    parallel residual passes through two per layer (QKV then dense, or MLP up
    then down), Llama's sequential one through attention's two and then the
    MLP's two where its linears convert."""
    config = CONFIGS[name]
    if name == "neox":
        return 2 * config.n_layers
    mlp = all(n % float8.FP8_MULTIPLE == 0 for n in (config.d_ff, config.d_model))
    return (2 + 2 * mlp) * config.n_layers


def losses(model, ctx, steps: int = STEPS) -> list[float]:
    out = []
    n_vocab = CONFIGS["neox"].n_vocab
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, n_vocab, (2 * ctx.world_size, 33), generator=g)
        mine = ids[2 * ctx.rank:2 * ctx.rank + 2].to(ctx.device)
        loss = model.model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
        out.append(loss.item())
    return out


def wrong_scale():
    """A deliberately wrong scale: 16 × 448 / amax, so the largest elements of
    every operand saturate at 448."""
    import torchao.float8.float8_scaling_utils as scaling

    right = scaling.tensor_to_scale
    scaling.tensor_to_scale = lambda *a, **kw: right(*a, **kw) * 16


def train_three(ctx, name: str, wrong: bool):
    """Per rank: the plain losses, the fp8 losses (same weights and rows) and
    C, how much the loss moves when the fp8 linears' weights are zero."""
    plain = losses(build(name, fp8=False, device=ctx.device), ctx)
    removed = losses(build(name, fp8=False, device=ctx.device, zero_fp8_weights=True),
                     ctx, steps=1)
    if wrong:
        wrong_scale()
    fp8 = losses(build(name, fp8=True, device=ctx.device), ctx)
    return plain, fp8, abs(plain[0] - removed[0])


def tolerance(name: str, step: int, size: float) -> float:
    r"""
    An fp8 product's terms $x_i W_{ji}$ are each off by at most
    $2u_8 + u_8^2$ of themselves ($u_8 = 2^{-4}$, both operands rounded to
    e4m3); relative errors on a path add to first order (tests/tolerance.py),
    so a value after `fp8_depth` products is off by $\rho$ = depth $\times
    (2u_8 + u_8^2)$ of the terms the products contribute; `size` is that
    contribution to the loss (the loss with those weights zeroed, subtracted),
    and each AdamW step adds one more $\rho$ (tolerance.loss_after's rule).
    """
    rho = fp8_depth(name) * (2 * U8 + U8 ** 2)
    return (step + 1) * rho * size


def within(name: str, plain, fp8, size) -> bool:
    return all(abs(a - b) <= tolerance(name, k, size)
               for k, (a, b) in enumerate(zip(plain, fp8)))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp8_trains_as_the_plain_model_within_fp8_rounding(name, world_size):
    for plain, fp8, size in run_distributed(train_three, world_size, name, False):
        assert size > 0
        assert fp8 != plain  # the fp8 products did run
        assert within(name, plain, fp8, size), (plain, fp8, size)


@pytest.mark.distributed
@pytest.mark.parametrize("name", CONFIGS)
def test_a_wrong_scale_fails_the_tolerance(name):
    (plain, fp8, size), = run_distributed(train_three, 1, name, True)
    assert not within(name, plain, fp8, size), (plain, fp8, size)


def test_the_formats_of_the_notes():
    e4m3, e5m2 = torch.finfo(torch.float8_e4m3fn), torch.finfo(torch.float8_e5m2)
    assert (e4m3.max, e5m2.max) == (448, 57344)
    assert (e4m3.eps / 2, e5m2.eps / 2) == (U8, 2 * U8)  # 3 and 2 mantissa bits
    config = float8.torchao_config()
    assert config.cast_config_input.target_dtype == torch.float8_e4m3fn
    assert config.cast_config_weight.target_dtype == torch.float8_e4m3fn
    assert config.cast_config_grad_output.target_dtype == torch.float8_e5m2


# ## Which linears


def test_filter_takes_the_layers_linears_of_multiples_of_16():
    from torchao.float8.float8_linear import Float8Linear

    neox = neox_model.build_layers(CONFIGS["neox"], device="meta",
                                   kernels=ModelKernels(fp8=True, fp8_emulate=True, fp8_every_linear=True))
    names = {n for layer in neox for n, m in layer.named_modules()
             if isinstance(m, Float8Linear)}
    assert names == {"attention.query_key_value", "attention.dense",
                     "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}
    assert not isinstance(neox[-1].embed_out, Float8Linear)  # the readout
    # Llama's tiny d_ff = 172 is no multiple of 16: its MLP stays bf16
    llama = llama_model.build_layers(CONFIGS["llama"], device="meta",
                                     kernels=LlamaKernels(fp8=True, fp8_emulate=True, fp8_every_linear=True))
    names = {n for layer in llama for n, m in layer.named_modules()
             if isinstance(m, Float8Linear)}
    assert names == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj"}
    assert not isinstance(llama[-1].lm_head, Float8Linear)
    # the parameters are the same ones, by the same names, for the engine
    plain = llama_model.build_layers(CONFIGS["llama"], device="meta")
    assert [n for n, _ in llama[1].named_parameters()] == \
        [n for n, _ in plain[1].named_parameters()]


# ## The activation count


def test_fp8_layer_saves_what_the_plain_layer_saves():
    from tests.neox.test_activation_memory import saved_bytes

    config = CONFIGS["neox"]
    torch.manual_seed(0)
    plain = neox_model.build_layers(config)[1].to(torch.bfloat16)
    fp8 = neox_model.build_layers(config, kernels=ModelKernels(
        fp8=True, fp8_emulate=True, fp8_every_linear=True))[1].to(torch.bfloat16)
    x = torch.randn(2, 16, config.d_model, dtype=torch.bfloat16, requires_grad=True)
    sizes = []
    for layer in (plain, fp8):
        _, nbytes, _ = saved_bytes(lambda: layer(x), exclude=list(layer.parameters()))
        sizes.append(nbytes)
    assert sizes[0] == sizes[1]


def test_activation_count_refuses_fp8_with_frozen_weights():
    from labml_zero.neox import activation_memory as neox_memory

    kernels = ModelKernels(fp8=True)
    with pytest.raises(ValueError, match="finetune 'biases'"):
        neox_memory.activation_bytes(CONFIGS["neox"], batch=1, seq=8,
                                     finetune="biases", kernels=kernels)
    assert neox_memory.activation_bytes(
        CONFIGS["neox"], batch=1, seq=8, finetune="all", kernels=kernels).total == \
        neox_memory.activation_bytes(CONFIGS["neox"], batch=1, seq=8,
                                     finetune="all").total


# ## Names and refusals


def test_fp8_is_a_name_never_in_auto_or_all():
    assert not resolve_kernels("auto", "cuda").fp8
    assert not ModelKernels.from_names("all").fp8
    assert "fp8" not in ModelKernels.fusions() and "fp8" in ModelKernels.choices()
    assert "fp8_emulate" not in ModelKernels.choices()
    both = resolve_kernels("auto,fp8", "cuda")
    assert both.fp8 and both.loss and not both.bias_gelu  # bias_gelu left out
    assert ModelKernels.from_names("loss,fp8").names() == "loss,fp8"
    assert resolve_llama_kernels("auto,fp8", "cuda") == LlamaKernels(
        rms_norm=True, swiglu=True, rotary=True, loss=True, fp8=True)
    with pytest.raises(ValueError, match="fp8 and bias_gelu"):
        ModelKernels.from_names("bias_gelu,fp8")
    with pytest.raises(ValueError, match="fp8_emulate"):
        ModelKernels.from_names("fp8_emulate")


def test_refusals(monkeypatch):
    assert float8.fp8_refusal("cpu") == ("needs a CUDA GPU (fp8 matrix products); "
                                         "this run is on cpu")
    assert float8.fp8_refusal("cpu", emulate=True) is None
    with pytest.raises(ValueError, match="kernels fp8 needs a CUDA GPU"):
        float8.check_fp8(ModelKernels(fp8=True), "cpu")
    float8.check_fp8(ModelKernels(), "cpu")  # off: nothing to refuse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    assert float8.fp8_refusal("cuda") == ("needs compute capability >= 8.9 (Ada, "
                                          "Hopper); NVIDIA A100 is 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert float8.fp8_refusal("cuda") is None
    monkeypatch.setattr(float8, "torchao_missing", lambda: True)
    assert float8.fp8_refusal("cuda") == "needs torchao (pip install torchao)"


def test_the_builders_refuse_fp8_on_cpu():
    from labml_zero.neox.build import NeoXBuild, build_neox

    build = NeoXBuild(CONFIGS["neox"], kernels=ModelKernels(fp8=True))
    with pytest.raises(ValueError, match="kernels fp8 needs a CUDA GPU"):
        build_neox(build, Recipe(zero=ZeroConfig()), device=torch.device("cpu"))
    assert isinstance(CONFIGS["llama"], LlamaConfig)
