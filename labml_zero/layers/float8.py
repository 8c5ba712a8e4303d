r"""
---
title: fp8 matrix products
summary: The transformer layers' large linears in fp8 with tensorwise dynamic
  scaling (torchao's Float8Linear), which linears and why only large products
  gain (measured), and when the choice is refused; the plain bf16 model is its
  CPU twin.
---

# fp8 matrix products

An H100 or H200 multiplies fp8 matrices at twice its bf16 rate. The
`fp8` kernel choice runs the products of the transformer layers' linears
that are large enough to gain (`fp8_pays`) in fp8 through torchao's
`Float8Linear`, a subclass of `nn.Linear` whose
forward casts both operands to fp8 before the product and whose backward
casts the incoming gradient too. Each operand $A$ gets one scale $s_A$ per
tensor, from the tensor itself (`torchao_config`), and the product is taken
on the fp8 codes and the scales divided out:

$$y = x W^\top \approx \frac{\operatorname{fp8}(s_x x)\,
  \operatorname{fp8}(s_W W)^\top}{s_x s_W}.$$

The weights, their gradients, the optimizer and the chunks the engine
gathers stay as they are: fp8 lives only inside the three products of a
linear (forward, gradient of the input, gradient of the weight).

## What is and is not done

* Done: the products of the chosen linears in fp8, forward and backward,
  tensorwise dynamic scales, on GPUs with fp8 matrix products
  (Ada, Hopper and later: `FP8_MIN_CAPABILITY`) with torchao installed; every other place refuses the choice
  before the start, in one line (`fp8_refusal`).
* Done: the chosen weights gathered in fp8 on several ranks, one
  power-of-two scale a chunk ([gathering in fp8](../zero3/float8_gather.html)):
  half the gathered bytes of bf16, the product reading the same codes. At
  world size 1 nothing is gathered and each product casts its own weight.
* Only when every weight trains (`finetune='all'`, `check_fp8_count`): a
  frozen linear's saved bytes would be miscounted, and LoRA's wrapper
  replaces the linear and calls the product itself, in bf16. Nor with
  GPT-NeoX's fused bias + GELU, which calls the MLP's first product itself.
  Every such combination is refused before the start.
* Done: compiled fp8 products in [the step-time
  model](../planner/step_time.html) (`fp8_products`). Not done: eager fp8
  there (counted at the bf16 rate, and said), and fp8 in `auto`: the planner
  never chooses a precision.

"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
from torch import nn

from labml_zero.layers.lora import LoRALinear
from labml_zero.zero3.float8_gather import mark_fp8_gathered

__all__ = ["FP8_MULTIPLE", "FP8_MIN_CAPABILITY", "FP8_MIN_WEIGHT_NUMEL",
           "fp8_fits", "fp8_pays", "fp8_shape", "fp8_shapes", "fp8_linear",
           "no_fp8",
           "to_float8", "fp8_refusal", "check_fp8", "check_fp8_count",
           "fp8_inputs_recomputed"]

FP8_MULTIPLE = 16
"""Both dimensions of a linear must be multiples of this to run in fp8."""

FP8_MIN_CAPABILITY = (8, 9)
"""The first compute capability with fp8 matrix products (Ada; Hopper comes after)."""


def fp8_fits(in_features: int, out_features: int) -> bool:
    """Whether the GPU's fp8 product takes this shape: both dimensions
    multiples of `FP8_MULTIPLE`."""
    return in_features % FP8_MULTIPLE == 0 and out_features % FP8_MULTIPLE == 0


FP8_MIN_WEIGHT_NUMEL = 2048 * 2048
r"""The smallest weight, $d_\text{in} d_\text{out}$ elements, whose products
run in fp8 by default (`fp8_pays`): Pythia-1.4B's square attention output."""


def fp8_pays(in_features: int, out_features: int) -> bool:
    r"""
    ### Which linears gain: the per-linear choice

    A linear's three products take $6 n d_\text{in} d_\text{out}$ FLOPs for
    $n$ tokens; fp8 halves their time and adds passes over memory that grow
    only as $n (d_\text{in} + d_\text{out}) + d_\text{in} d_\text{out}$
    (`to_float8`'s *When it pays*). So a linear gains from some size of its
    weight up, and the choice is by that size:
    $d_\text{in} d_\text{out} \ge$ `FP8_MIN_WEIGHT_NUMEL`.

    The threshold is measured two ways, on one GPU. Alone
    (`bench/fp8_linears.py`: one linear, compiled, forward and backward, in
    bf16 and in fp8, for each linear shape of the benchmark's models), every
    shape that fp8 made faster at a micro-batch's 16384 tokens is at least
    this size
    (tested: tests/layers/test_fp8_choice.py::test_every_linear_fp8_made_faster_alone_is_chosen).
    Alone is the pessimistic case: in a compiled layer the cast of a linear's
    input fuses with the norm or activation that makes it, and the host's
    launches hide behind the GPU's queue. So the threshold is set by whole
    steps: Pythia-1.4B trained faster with all four of its linears in fp8
    than with its MLP's two alone, though its attention's were slower alone;
    Pythia-160M, whose largest weight is below the threshold, trained slower
    with its linears in fp8 than in bf16
    (tested: tests/layers/test_fp8_choice.py::test_the_steps_measured_agree_with_the_rule).
    On Pythia-1.4B every linear runs in fp8, on Llama-3.2-1B all but its
    narrow keys and values, on Pythia-160M none: asked for fp8, that model
    runs as in bf16.
    """
    return in_features * out_features >= FP8_MIN_WEIGHT_NUMEL


def fp8_shape(in_features: int, out_features: int, *,
              every_linear: bool = False) -> bool:
    """Whether a linear of this shape runs in fp8: the shapes the product
    takes, and where it pays (`fp8_pays`) unless `every_linear` (the tests'
    tiny models and the activation probe); the activation counts ask by
    shape, without a module."""
    return fp8_fits(in_features, out_features) and (
        every_linear or fp8_pays(in_features, out_features))


def fp8_shapes(shapes, kernels) -> tuple[tuple[int, int], ...]:
    r"""Of a layer's products' $(d_\text{in}, d_\text{out})$, those `kernels`
    run in fp8 (`fp8_shape`); none without `fp8`."""
    if not getattr(kernels, "fp8", False):
        return ()
    every = getattr(kernels, "fp8_every_linear", False)
    return tuple(s for s in shapes if fp8_shape(*s, every_linear=every))


def fp8_linear(module: nn.Module, name: str = "", *,
               every_linear: bool = False) -> bool:
    r"""
    ### Which modules: whether a submodule of a transformer layer runs in fp8

    An `nn.Linear` (LoRA's wrapper excluded, see the introduction) of a shape
    `fp8_shape` takes. The signature is torchao's `module_filter_fn`'s.

    Never the embedding (a lookup, no product) nor the readout: its logits
    feed the softmax of the loss, where an error of $2u_8$ of a logit's terms
    moves every probability, and it is already the chunked loss's own
    product. A layer of another width (Llama's tiny test model, whose $d_{ff}$
    is not a multiple of `FP8_MULTIPLE`) keeps those linears in bf16.
    """
    return (isinstance(module, nn.Linear) and not isinstance(module, LoRALinear)
            and fp8_shape(module.in_features, module.out_features,
                          every_linear=every_linear))


def torchao_config(*, emulate: bool = False):
    r"""
    ### The format and the scale: torchao's default recipe

    torchao's default recipe uses two formats:

    * **e4m3** (4 exponent bits, 3 mantissa bits, largest finite value $m_4$) for
      the forward operands $x$ and $W$: a rounding is off by at most
      $u_8 = 2^{-4}$ of the value;
    * **e5m2** (5 exponent bits, 2 mantissa bits, largest $m_5$) for the
      gradient $\partial L / \partial y$, which spans more octaves and needs
      fewer digits: $u = 2^{-3}$.

    With so few exponent bits the values must be moved into the format's range
    first. *Tensorwise dynamic scaling* takes one scale per tensor, from the
    tensor itself, at every call:

    $$s = \frac{m}{\max |A|}, \qquad A_8 = \operatorname{fp8}(s A), \qquad
      A \approx A_8 / s,$$

    with $m$ = $m_4$ = 448 for e4m3
    (tested: tests/layers/test_float8.py::test_the_formats_of_the_notes) and
    $m_5$ = 57344 for e5m2
    (tested: tests/layers/test_float8.py::test_the_formats_of_the_notes), so the largest element lands on
    the largest finite value and nothing overflows. The product runs on the fp8
    codes, $x W^\top \approx (x_8 W_8^\top) / (s_x s_W)$, accumulated in fp32 and
    written in bf16. Each product term $x_i W_{ji}$ is off by at most
    $2 u_8 + u_8^2$ of itself, so an output is off by at most that fraction of
    $\sum_i |x_i W_{ji}|$.

    Each scale is rounded down to a power of two (torchao's
    `round_scales_to_power_of_2`): the largest element then lands between
    $m/2$ and $m$, which costs nothing of an e4m3 number's relative precision
    (its three mantissa bits are the same in every octave), and it is what lets
    the engine [gather the weights in fp8](../zero3/float8_gather.html): a
    weight decoded at one power-of-two scale and cast again at another is the
    same code.

    `emulate` is torchao's emulation, for tests on a CPU, where the `fp8`
    choice is otherwise refused: the same fp8 roundings, the product done by
    `torch.mm` on the decoded values.
    """
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(emulate=emulate, round_scales_to_power_of_2=True)


def to_float8(layer: nn.Module, *, emulate: bool = False, config=None,
              every_linear: bool = False) -> list[str]:
    r"""
    ### Swap a layer's chosen linears for `Float8Linear`, in place

    `layer` is one transformer layer (never the embedding or readout layer:
    the family's builder calls this on its repeated layers only). Works on the
    meta device: the swap moves the `weight` and `bias` parameters, it copies
    nothing, before the engine lays the parameters out in chunks; the
    forward reads `self.weight` at every call, so it reads the engine's
    gathered view like any linear. Returns the names of the converted
    linears. `config` is a
    torchao `Float8LinearConfig` (default `torchao_config(emulate=emulate)`;
    the benchmark's FSDP2 peer passes one that gathers in fp8).
    `every_linear` converts every linear `fp8_fits`, not only where it pays
    (the tests' tiny models, the per-linear benchmark).
    `Float8Linear` wraps the weight in a new `nn.Parameter`, which would make
    a frozen weight trainable: each parameter's `requires_grad` is restored by
    name, which the swap keeps.

    #### When it pays

    The casts are extra passes over memory. Each is an amax pass (2 bytes read
    an element of bf16) and the cast itself (2 read, 1 written): 5 bytes an
    element. The forward casts $x$ and $W$; the backward casts $W$, $x$ and the
    gradient $\partial L / \partial y$ twice, once for each product (torchao
    saves the bf16 $x$ and $W$ for the backward pass, as a plain linear does,
    and casts them again). For $n$ tokens through a $d_\text{in} \to
    d_\text{out}$ linear that is about
    $5 \cdot (3 n d_\text{in} + 2 d_\text{in} d_\text{out} + 2 n d_\text{out})$
    bytes moved, against the $3 \cdot 2 n d_\text{in} d_\text{out}$ FLOPs of the
    three products; the FLOPs grow with one more factor of the sizes than the
    bytes, so halving the products' time pays for the passes only when the
    matrices are large: $d$ in the thousands and many tokens a step. On a small
    model the step is set by the host and the passes between products, and fp8
    adds passes. Where the line falls is measured, not derived: `fp8_pays`
    above is the choice the measurements set.
    """
    from torchao.float8 import convert_to_float8_training

    def chosen(module: nn.Module, name: str = "") -> bool:
        return fp8_linear(module, name, every_linear=every_linear)

    names = [name for name, module in layer.named_modules() if chosen(module)]
    trains = {name: p.requires_grad for name, p in layer.named_parameters()}
    convert_to_float8_training(layer, module_filter_fn=chosen,
                               config=config or torchao_config(emulate=emulate))
    for name, p in layer.named_parameters():
        p.requires_grad_(trains[name])
    if config is None:
        # only the fp8 products read these weights, at power-of-two scales:
        # the engine may gather them in fp8
        for name in names:
            mark_fp8_gathered(layer.get_submodule(name).weight)
    return names


def torchao_missing() -> bool:
    """Whether `torchao.float8` cannot be imported here."""
    if importlib.util.find_spec("torchao") is None:
        return True
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return True
    return False


def fp8_refusal(device: torch.device | str, *, emulate: bool = False) -> str | None:
    """
    ### Why fp8 products cannot run on `device`, or `None`

    Known before the start: torchao missing, not a CUDA device (unless
    `emulate`, a test's choice), or a GPU older than `FP8_MIN_CAPABILITY`.
    """
    # the device first: importing torchao prints its own warnings
    if not emulate:
        device = torch.device(device)
        if device.type != "cuda":
            return (f"needs a CUDA GPU (fp8 matrix products); this run is on "
                    f"{device.type}")
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (fp8 matrix products); none is visible"
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (f"needs compute capability >= 8.9 (Ada, Hopper); {name} is "
                    f"{capability[0]}.{capability[1]}")
    if torchao_missing():
        return "needs torchao (pip install torchao)"
    return None


def check_fp8_count(kernels, finetune: str) -> None:
    """
    ### The activation counts with fp8: exact when every weight trains

    `Float8Linear`'s backward saves the bf16 input and weight, as a plain
    linear with a trained weight and an input that needs its gradient does:
    the same bytes
    (tested: tests/layers/test_float8.py::test_fp8_layer_saves_what_the_plain_layer_saves).
    A plain linear with a
    frozen weight does not save its input; `Float8Linear` does, so with any
    fine-tuner but `'all'` the count would be short: refused.
    """
    if getattr(kernels, "fp8", False) and finetune != "all":
        raise ValueError(f"kernels fp8 with finetune {finetune!r}: the activation "
                         "count has fp8 only for finetune 'all' (Float8Linear "
                         "saves the input of a frozen linear too)")


def fp8_inputs_recomputed(kernels, compiled: bool) -> Callable[[int, int], bool]:
    r"""
    ### Compiled, an fp8 layer keeps no input of its products

    Eager, `Float8Linear` keeps its bf16 input, as counted above. Compiled
    (`--compile`), the layer's forward and backward are one traced graph, and
    AOT autograd's partitioner chooses what crosses from one to the other: it
    keeps neither the bf16 input of an fp8 product nor its fp8 cast, and
    recomputes the input in the backward from tensors kept anyway: the
    normalised input from the layer's input and the norm's statistics, the
    heads concatenated from the attention's output, the MLP's activation from
    its pre-activation. The cast is cheap element-wise work; the saving is the
    products' inputs, on GPT-NeoX $3nd + n d_{ff}$ elements a layer ($\operatorname{LN}_1$,
    $\operatorname{LN}_2$, the heads, $\operatorname{GELU}(h)$), on Llama
    $2nd + n d_{ff}$ (the two norms' outputs and $\operatorname{SiLU}(g)
    \odot u$). Measured on one GPU, a layer of each family at the benchmark's
    width, every linear in fp8, keeps exactly the count with these rows dropped
    (tested: tests/layers/test_fp8_activation_count.py::test_the_count_is_what_a_layer_kept_on_the_gpu).
    A compiled bf16 layer with the fused kernels keeps the eager count.

    Returns the predicate of a product's shape, $(d_\text{in},
    d_\text{out})$ → whether its input is recomputed: the shapes that run in
    fp8 (`fp8_shape`), when fp8 is on and the layer compiled; `no_fp8` else.
    """
    if not (getattr(kernels, "fp8", False) and compiled):
        return no_fp8
    every = getattr(kernels, "fp8_every_linear", False)
    return lambda in_features, out_features: fp8_shape(
        in_features, out_features, every_linear=every)


def no_fp8(in_features: int, out_features: int) -> bool:
    """No product in fp8: the counts' default."""
    return False


def check_fp8(kernels, device: torch.device | str) -> None:
    """`ValueError` with `fp8_refusal`'s line when `kernels.fp8` cannot run on
    `device`; nothing when fp8 is off."""
    if not getattr(kernels, "fp8", False):
        return
    why = fp8_refusal(device, emulate=kernels.fp8_emulate)
    if why is not None:
        raise ValueError(f"kernels fp8 {why}")
