"""fp8 products (labml_zero/layers/float8.py) on the CPU through torchao's
emulation: which linears convert, training under the chunk engine at world
sizes 1 to 3 (from 2 on, the weights gathered in fp8) against the plain
model, the activation count, and the refusals.

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


def build(name: str, *, fp8: bool, device: torch.device):
    """The tiny model of `name`, built on meta and assembled at fp32 on `device`
    with a fixed seed (the CPU emulates fp8, a GPU runs the real kernels)."""
    model, init_parameter, kernels = family(name)
    config = CONFIGS[name]
    layers = model.build_layers(config, device="meta",
                                kernels=kernels(fp8=fp8,
                                                fp8_emulate=fp8 and device.type == "cpu",
                                                fp8_every_linear=fp8))
    recipe = Recipe(zero=ZeroConfig(dtype=torch.float32, chunk_numel=8192),
                    lr=1e-3, seed=3)
    return assemble(layers, recipe, device=device, init_param=init_parameter(config))


def rows(ctx, step: int) -> torch.Tensor:
    """This rank's two rows of the step's batch."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CONFIGS["neox"].n_vocab, (2 * ctx.world_size, 33),
                        generator=g)
    return ids[2 * ctx.rank:2 * ctx.rank + 2].to(ctx.device)


def losses(model, ctx, steps: int = STEPS) -> list[float]:
    out = []
    for step in range(steps):
        mine = rows(ctx, step)
        loss = model.model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
        out.append(loss.item())
    return out


def rounding_spread(model, ctx) -> float:
    r"""
    The standard deviation of the first step's loss under fp8's roundings, to
    first order. Rounding each input element $x_{ni}$ and weight $W_{ji}$ of a
    product to e4m3 multiplies it by $1 + \epsilon$, $|\epsilon| \le u_8$;
    taken as independent and uniform (variance $u_8^2 / 3$), the loss moves by
    $\sum_{ni} \epsilon_{ni}\, x_{ni} \frac{\partial L}{\partial x_{ni}}
    + \sum_{ji} \epsilon_{ji}\, W_{ji} \frac{\partial L}{\partial W_{ji}}$,
    with a variance of $u_8^2 / 3$ times the sum of the squares of those
    products, over the linears fp8 takes ($\partial L / \partial x$ the part
    through this product). Hooks on the plain model read each product's input
    and weight in the forward pass (the weight is gathered then) and its output
    gradient in the backward pass.
    """
    squares = []

    def forward(module, inputs, output):
        x, w = inputs[0].detach(), module.weight.detach()

        def backward(g):
            # [n, d_in] and [d_out, d_in]: the gradients through this product
            squares.append(float((x * (g @ w)).square().sum()
                                 + (w * (g.flatten(0, -2).t() @ x.flatten(0, -2)))
                                 .square().sum()))

        output.register_hook(backward)

    hooks = [m.register_forward_hook(forward) for m in model.model.modules()
             if float8.fp8_linear(m, every_linear=True)]
    mine = rows(ctx, 0)
    model.model(mine[:, :-1], mine[:, 1:]).backward()
    model.optimizer.zero_grad()
    for hook in hooks:
        hook.remove()
    return U8 / 3 ** 0.5 * sum(squares) ** 0.5


def wrong_scale(where: str) -> None:
    """A deliberately wrong scale, 16 times the right one, so that the
    largest elements saturate at 448: every operand's (`'product'`), or the
    chunks' gathered in fp8 (`'gather'`)."""
    if where == "product":
        import torchao.float8.float8_scaling_utils as scaling

        right = scaling.tensor_to_scale
        scaling.tensor_to_scale = lambda *a, **kw: right(*a, **kw) * 16
    else:
        from labml_zero.zero3 import float8_gather

        right = float8_gather.power_of_two_scale
        float8_gather.power_of_two_scale = lambda amax: right(amax) * 16


def train_three(ctx, name: str, wrong: str | None):
    """Per rank: the plain losses, the fp8 losses (same weights and rows) and
    the spread fp8's roundings give the first loss (`rounding_spread`)."""
    plain = losses(build(name, fp8=False, device=ctx.device), ctx)
    size = rounding_spread(build(name, fp8=False, device=ctx.device), ctx)
    if wrong:
        wrong_scale(wrong)
    fp8 = losses(build(name, fp8=True, device=ctx.device), ctx)
    return plain, fp8, size


SIGMAS = 6


def tolerance(step: int, spread: float) -> float:
    r"""
    `SIGMAS` standard deviations of the first loss under fp8's roundings
    (`rounding_spread`; a weight gathered in fp8 is rounded once, at its
    chunk's scale, and the product's cast of it is exact, so the same spread
    holds at every world size), one more such spread for each AdamW step
    after it (tolerance.loss_after's rule: the fp8 products of the backward
    pass move each update by their own roundings).
    """
    return SIGMAS * (step + 1) * spread


def within(plain, fp8, size) -> bool:
    return all(abs(a - b) <= tolerance(k, size)
               for k, (a, b) in enumerate(zip(plain, fp8)))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", CONFIGS)
def test_fp8_trains_as_the_plain_model_within_fp8_rounding(name, world_size):
    for plain, fp8, size in run_distributed(train_three, world_size, name, None):
        assert size > 0
        assert fp8 != plain  # the fp8 products did run
        assert within(plain, fp8, size), (plain, fp8, size)


@pytest.mark.distributed
@pytest.mark.parametrize("where,world_size", [("product", 1), ("gather", 2)])
@pytest.mark.parametrize("name", CONFIGS)
def test_a_wrong_scale_fails_the_tolerance(name, where, world_size):
    for plain, fp8, size in run_distributed(train_three, world_size, name, where):
        assert not within(plain, fp8, size), (plain, fp8, size)


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
