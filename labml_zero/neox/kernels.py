r"""
---
title: The model's fused kernels
summary: A chunked readout and cross-entropy that never holds the logits, fused
  rotary embeddings, both layer norms of a layer in one pass, and bias + GELU,
  each beside its plain PyTorch twin and chosen once where the model is built.
---

# The model's fused kernels

On one GPU the matrix products of GPT-NeoX run near the hardware's rate; what
is left is everything between them, where the GPU streams bytes and the host
issues launches. For a pass that reads $r$ and writes $w$ bytes per element of
a tensor of $n$ elements, at bandwidth $\beta$, the floor is

$$t \ge \frac{(r + w)\, n}{\beta},$$

so a fused kernel wins by touching each element fewer times, and, where the
host sets the pace, by launching fewer kernels. Each fused function has its
plain PyTorch twin beside it, the reference the tests compare against
(tested: tests/neox/test_kernels.py::test_model_with_every_kernel_is_the_plain_model).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labml_zero.layers.kernel_traffic import VIEW_OPS, fused_stand_in

__all__ = ["ModelKernels", "resolve_auto", "chunked_readout_loss", "plain_readout_loss",
           "IGNORE_INDEX"]

# `F.cross_entropy`'s default: targets equal to it count neither in the loss
# nor in its mean.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class ModelKernels:
    """
    ## Which kernels the model runs

    Every field off is the plain PyTorch model; `all_fused()` turns every
    fusion on. `from_names("loss,rotary")` builds one from the field names,
    which is also how the benchmark's `--kernels` flag reads;
    `build_layers(config, kernels=...)` hands the choice to every layer once.
    The figures on this page are for Pythia-1.4B at {{py: 8 * 2048 | ,}} tokens
    a step ($d$ = {{py: neox_model.pythia_1_4b().d_model}}, $V$ = {{py:
    neox_model.pythia_1_4b().n_vocab | ,}}, $d_r$ = {{py:
    neox_model.pythia_1_4b().rotary_dim}}); launches are counted by running the
    twin on the meta device (`forward_launches`). The benchmark's README has
    each kernel's measured gain alone and in the step.

    Three fusions are on this page, each beside its twin. The fourth, `rotary`,
    lives on the [rotary page](rotary.html) beside the formula it compiles:
    the rotation of q and k in one pass over both (`rotary.apply_rotary_fused`),
    where the plain path is {{py: neox_model.plain_launches('rotary',
    neox_model.pythia_1_4b())}} launches per layer forward. Both read the angle
    tables that the model builds once for all layers ({{py:
    neox_model.plain_launches('rotary_tables', neox_model.pythia_1_4b())}}
    launches, the model's `RotaryTables`), so the pass moves bytes and computes
    no cosine.
    """

    loss: bool = False
    """The readout and the cross-entropy in chunks of `loss_chunk_rows`
    (`chunked_readout_loss`)."""
    rotary: bool = False
    """Rotary angles and the rotation of $q$ and $k$ in one compiled kernel."""
    norms: bool = False
    """A layer's two layer norms of the same input in one pass."""
    bias_gelu: bool = False
    """The MLP's bias and GELU fused after its first product, and their
    derivatives fused in the backward pass."""
    loss_chunk_rows: int = 2048
    """Rows (tokens) per chunk of the chunked loss: a chunk's fp32 logits are
    `loss_chunk_rows` × $V$ × 4 bytes, against the full $BT$ rows of the
    plain path."""
    attention: str | None = None
    """`None` lets `scaled_dot_product_attention` pick its backend;
    `'cudnn'`, `'flash'`, `'efficient'` or `'math'` pins one."""
    fp8: bool = field(default=False, metadata={"precision": True})
    """The transformer layers' large linears in fp8 ([fp8 matrix
    products](../layers/float8.html)). A precision, not a fusion with an exact
    twin: named on its own (`'fp8'`, `'loss,fp8'`), never in `all` or
    `auto`; GPUs with fp8 products (Ada, Hopper) only."""
    fp8_emulate: bool = field(default=False, metadata={"test": True})
    """torchao's emulation of the fp8 products, for the CPU tests only: no
    name turns it on."""
    fp8_every_linear: bool = field(default=False, metadata={"test": True})
    """fp8 on every linear of a shape the product takes, not only where it
    pays (`fp8_pays`): the tests' tiny models and the activation probe."""

    def __post_init__(self):
        if self.loss_chunk_rows < 1:
            raise ValueError(f"ModelKernels: loss_chunk_rows must be >= 1, "
                             f"got {self.loss_chunk_rows}")
        if self.attention not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"ModelKernels: attention must be None or one of "
                             f"{', '.join(ATTENTION_BACKENDS)}, got "
                             f"{self.attention!r}")
        fp8_needs_linear_call(self)

    @classmethod
    def fusions(cls) -> tuple[str, ...]:
        """The names of the fusions, the on/off fields with an exact twin, in
        order: `fp8` (a precision) and the test-only emulation are not."""
        return tuple(f.name for f in fields(cls) if f.type in ("bool", bool)
                     and not f.metadata)

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        """Every name `from_names` reads: the fusions, then the precisions."""
        return cls.fusions() + tuple(f.name for f in fields(cls)
                                     if f.metadata.get("precision"))

    @classmethod
    def all_fused(cls) -> "ModelKernels":
        return cls(**{name: True for name in cls.fusions()})

    @classmethod
    def from_names(cls, names: str) -> "ModelKernels":
        """`'loss,rotary'` → those fusions on; `''` or `'none'` → plain;
        `'all'` → `all_fused()`, `'all,fp8'` with fp8 too. An unknown name is
        an error naming it."""
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        if wanted in ([], ["none"]):
            return cls()
        if "all" in wanted:
            wanted = [*cls.fusions(), *(n for n in wanted if n != "all")]
        unknown = [n for n in wanted if n not in cls.choices()]
        if unknown:
            raise ValueError(f"unknown kernel(s) {', '.join(unknown)}: choose "
                             f"from {', '.join(cls.choices())}, all or none")
        return cls(**{n: True for n in wanted})

    def names(self) -> str:
        """The inverse of `from_names`: the names on, comma-separated."""
        on = [n for n in self.choices() if getattr(self, n)]
        return ",".join(on) or "none"


def fp8_needs_linear_call(kernels) -> None:
    """GPT-NeoX's fused bias + GELU computes the MLP's first product with
    `F.linear` on the weight, past `Float8Linear`'s forward: the two are
    refused together rather than the product silently left in bf16."""
    if kernels.fp8 and getattr(kernels, "bias_gelu", False):
        raise ValueError("fp8 and bias_gelu: the fused bias + GELU computes the "
                         "MLP's first product itself, in bf16; leave out one "
                         "of them")


FP8_EXCLUDES = ("bias_gelu",)
"""The fusions that `auto,fp8` leaves out (`fp8_needs_linear_call`)."""


def resolve_auto(cls, spec: str, device: torch.device | str):
    """
    ### `'auto'` among the names, for either family's kernels class

    `'auto'` is every fusion of `cls` on CUDA and none elsewhere; the other
    names are added to it (`'auto,fp8'`), and with `fp8` the fusions that
    call a product themselves (`FP8_EXCLUDES`) are left out of `auto`.
    """
    wanted = [n.strip() for n in spec.split(",") if n.strip()]
    if "auto" not in wanted:
        return cls.from_names(spec)
    rest = [n for n in wanted if n != "auto"]
    on_gpu = torch.device(device).type == "cuda"
    auto = [n for n in (cls.fusions() if on_gpu else ())
            if not ("fp8" in rest and n in FP8_EXCLUDES)]
    return cls.from_names(",".join([*auto, *rest]) or "none")


# ## Compiled on the GPU, the twin elsewhere
#
# The compiled kernels are `torch.compile` of small functions, compiled once per
# shape at their first GPU call. Each call of a compiled function with gradients
# goes through its autograd wrapper on the host, which costs more than the plain
# path's launches where the host already sets the pace (a small model).


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`torch.compile(fn)`, made once per function at its first GPU call."""
    return torch.compile(fn, dynamic=False)


def on_gpu_compiled(fn: Callable) -> Callable:
    """
    #### Run `fn` compiled on CUDA tensors, as written elsewhere

    Inside a compiled layer (`torch.compiler.is_compiling()`) `fn` is traced
    inline like any other code, so the layer's compilation sees through it
    (Inductor fuses by itself there); on a CPU it runs uncompiled.
    """

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args, **kwargs):
        stand_in = fused_stand_in()  # while [bytes are counted](../layers/kernel_traffic.html)
        if stand_in is not None:
            return stand_in(fn, x, *args, **kwargs)
        if x.is_cuda and not torch.compiler.is_compiling():
            return compiled(fn)(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    run.eager = fn
    return run


# ## The chunked readout and cross-entropy
#
# The plain path writes the logits in bf16, an fp32 copy, the fp32 log-softmax
# it saves and, in the backward pass, an fp32 and a bf16 gradient: {{py:
# (neox_model.K.plain_loss_bytes_per_row(neox_model.pythia_1_4b().n_vocab)
# * 8 * 2048 / 2**30) | .1f}} GiB for the step, most of it held at once. The
# chunked loss keeps one chunk's fp32 logits, {{py:
# (neox_model.ModelKernels().loss_chunk_rows * neox_model.pythia_1_4b().n_vocab
# * 4 / 2**20) | .0f}} MiB (`chunked_readout_loss`).


def plain_loss_bytes_per_row(n_vocab: int) -> int:
    """Bytes the plain readout + loss writes per token: bf16 logits, their fp32
    copy, the saved fp32 log-softmax, the fp32 and bf16 gradients."""
    return n_vocab * (2 + 4 + 4 + 4 + 2)


def plain_readout_loss(x: torch.Tensor, readout: nn.Linear,
                       targets: torch.Tensor) -> torch.Tensor:
    r"""
    ### The twin: logits, then `F.cross_entropy` in fp32

    `x` `[..., d]`, `readout` the `d → V` linear, `targets` `[...]` long; the
    mean over the targets that are not `IGNORE_INDEX`. It calls the module, so
    engines that gather a submodule's weights in its own hooks (DeepSpeed)
    see the call.
    """
    logits = readout(x)  # [..., V]
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def fused_readout_loss(x: torch.Tensor, readout: nn.Linear, targets: torch.Tensor,
                       *, chunk_rows: int) -> torch.Tensor:
    """`chunked_readout_loss` with the twin's signature."""
    return chunked_readout_loss(x, readout.weight, targets, chunk_rows=chunk_rows)


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor,
                        count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    #### One chunk's summed loss and $\partial L / \partial \text{logits}$

    With $z$ a row's logits in fp32, $y$ its target and $n$ the tokens counted
    by the mean,

    $$\ell = \log \sum_j e^{z_j} - z_y, \qquad
      \frac{\partial L}{\partial z_j} = \frac{\operatorname{softmax}(z)_j
      - [j = y]}{n},$$

    zero for an ignored row. Compiled, this is two passes over the chunk's bf16
    logits (the row's log-sum-exp, then the gradient) and one bf16 write,
    where the plain path's casts, log-softmax and its backward each read and
    write the whole fp32 logits.
    """
    z = logits.float()  # [n_c, V] fp32
    keep = targets != IGNORE_INDEX
    safe = torch.where(keep, targets, 0)
    lse = torch.logsumexp(z, dim=-1)  # [n_c]
    picked = z.gather(1, safe[:, None]).squeeze(1)
    loss_sum = torch.where(keep, lse - picked, 0.0).sum()
    probs = torch.exp(z - lse[:, None])
    # [n_c, V]: a comparison, not `F.one_hot`, which checks its input's range
    # with a host sync
    columns = torch.arange(z.shape[-1], device=z.device)
    onehot = (columns[None, :] == safe[:, None]).to(z.dtype)
    grad = (probs - onehot) * (keep[:, None].to(z.dtype) / count)
    return loss_sum, grad.to(logits.dtype)


chunk_loss_and_grad_fused = on_gpu_compiled(chunk_loss_and_grad)


def add_weight_grad(acc: torch.Tensor | None, grad_logits: torch.Tensor,
                    x: torch.Tensor) -> torch.Tensor:
    r"""
    #### $\partial L / \partial W \mathrel{+}= g^\top x$, accumulated in fp32

    On CUDA one product whose output is fp32 and which adds `acc` in place of
    its $\beta$ term (`addmm` with `out_dtype`, where this PyTorch has it);
    elsewhere the bf16 product is added to the fp32 sum.
    """
    if x.is_cuda and fp32_products_work(x.device):
        if acc is None:
            return torch.mm(grad_logits.t(), x, out_dtype=torch.float32)
        return torch.addmm(acc, grad_logits.t(), x, out_dtype=torch.float32)
    # [V, d], in fp32 (or the inputs' dtype if wider, for float64 tests)
    step = (grad_logits.t() @ x).to(torch.promote_types(x.dtype, torch.float32))
    return step if acc is None else acc.add_(step)


@functools.cache
def fp32_products_work(device: torch.device) -> bool:
    """Whether this PyTorch has `mm` with `out_dtype` on `device`."""
    a = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class ChunkedReadoutLoss(torch.autograd.Function):
    r"""
    ### The forward pass computes the gradients, chunk by chunk

    For rows $x_c$ of chunk $c$: logits $z_c = x_c W^\top$ `[n_c, V]` bf16,
    the chunk's loss and $g_c = \partial L / \partial z_c$, then
    $\partial L / \partial x_c = g_c W$ and $\partial L / \partial W \mathrel{+}=
    g_c^\top x_c$. The same matrix products as the plain path, in `n_c`-row
    pieces; the backward pass only scales the two stored gradients by the
    incoming $\partial \text{out} / \partial L$ (1 for a loss backpropagated
    alone).
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_rows: int):
        # x [N, d], weight [V, d], targets [N] long
        count = (targets != IGNORE_INDEX).sum().clamp_min(1).to(torch.float32)
        grad_x = torch.empty_like(x)  # [N, d]
        grad_w = None  # [V, d] fp32, accumulated over the chunks
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        for start in range(0, x.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = x[rows] @ weight.t()  # [n_c, V]
            part, grad_logits = chunk_loss_and_grad_fused(logits, targets[rows],
                                                          count)
            loss += part
            torch.mm(grad_logits, weight, out=grad_x[rows])  # [n_c, d]
            grad_w = add_weight_grad(grad_w, grad_logits, x[rows])
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_out.to(grad_x.dtype),
                (grad_w * grad_out).to(ctx.weight_dtype), None, None)


def chunked_readout_loss(x: torch.Tensor, weight: torch.Tensor,
                         targets: torch.Tensor, *, chunk_rows: int
                         ) -> torch.Tensor:
    r"""
    ### Mean cross-entropy of `x @ weight.T` without the logits

    `x` `[..., d]`, `weight` `[V, d]`, `targets` `[...]`; the function of
    `plain_readout_loss`. What it holds: $\partial L / \partial x$
    (`[BT, d]`, the size of the input), $\partial L / \partial W$ in fp32
    ($4Vd$ bytes) and one chunk's logits and gradient at a time, instead of
    `plain_loss_bytes_per_row` bytes for every token. It computes its gradient
    in the forward pass, so a forward with gradients enabled costs the
    backward's matrix products even if no backward follows; under
    `torch.no_grad` it computes the loss alone.
    """
    # (the meta device, where the planner counts bytes, has no autocast)
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
        # what autocast would give `F.linear`: both operands in its dtype (a
        # tracked cast, so the fp32 weight gets its gradient through it), and
        # the products below with autocast off
        dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            return chunked_readout_loss(x.to(dtype), weight.to(dtype), targets,
                                        chunk_rows=chunk_rows)
    x2 = x.reshape(-1, x.shape[-1])  # [N, d]
    t = targets.reshape(-1)
    if not (torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad)):
        # evaluation: the loss alone, chunk by chunk
        count = (t != IGNORE_INDEX).sum().clamp_min(1).to(torch.float32)
        total = sum(chunk_loss_and_grad(x2[s:s + chunk_rows] @ weight.t(),
                                        t[s:s + chunk_rows], count)[0]
                    for s in range(0, x2.shape[0], chunk_rows))
        return total / count
    return ChunkedReadoutLoss.apply(x2, weight, t, chunk_rows)


# ## Both layer norms of the parallel residual


def two_layer_norms(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                    w2: torch.Tensor, b2: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    ### $\operatorname{LN}_1(x)$ and $\operatorname{LN}_2(x)$ from one $\hat x$

    $\hat x = (x - \mu) / \sqrt{\sigma^2 + \epsilon}$ in fp32, then
    $\hat x \odot w_i + b_i$ in `x`'s dtype, as `F.layer_norm` computes each.
    The plain path is {{py: neox_model.plain_launches('norms',
    neox_model.pythia_1_4b())}} launches that each read $x$; fused, $x$ is read
    once ({{py: (8 * 2048 * neox_model.pythia_1_4b().d_model * 2 / 2**20) | .0f}}
    MiB less per layer forward for Pythia-1.4B's step), and in the backward
    pass both gradients are summed into one $\partial L / \partial x$ in the
    same kernel.
    """
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    x_hat = (x32 - mean) * torch.rsqrt(var + eps)  # [B, T, d] fp32
    return (x_hat * w1 + b1).to(x.dtype), (x_hat * w2 + b2).to(x.dtype)


two_layer_norms_fused = on_gpu_compiled(two_layer_norms)


# ## Bias and GELU


def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     approximate: str) -> torch.Tensor:
    r"""
    ### $\operatorname{GELU}(x W^\top + b)$, `x` `[B, T, d]` to `[B, T, d_{ff}]`

    The plain path already adds the bias in cuBLAS's epilogue ({{py:
    neox_model.plain_launches('bias_gelu', neox_model.pythia_1_4b())}}
    launches forward); fused, the product runs without it and one pass adds it
    and applies the GELU, and the backward pass reads the gradient
    $[BT, d_{ff}]$ once for the GELU's derivative and the bias gradient's sum
    over rows instead of twice.
    """
    h = F.linear(x, weight)  # [B, T, d_ff]
    # the bias in the product's dtype, as autocast gives `nn.Linear`
    return F.gelu(h + bias.to(h.dtype), approximate=approximate)


linear_bias_gelu_fused = on_gpu_compiled(linear_bias_gelu)


# ## Counting the plain path's launches
#
# A view (`VIEW_OPS`, from [the page that counts the kernels'
# bytes](../layers/kernel_traffic.html)) launches no kernel.


def forward_launches(fn: Callable, *args) -> int:
    """
    #### Kernels `fn(*args)` launches, counted on the meta device

    Every ATen op that reaches the dispatcher and is not a view launches (at
    least) one kernel on a GPU; meta tensors run none of them.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in VIEW_OPS:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn(*args)
    return count.ops


# ## What a layer calls
#
# Each layer picks one of a pair when it is built; both have the same
# signature, so its forward has no branch.


def norms_plain(x: torch.Tensor, ln1: nn.LayerNorm, ln2: nn.LayerNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
    return ln1(x), ln2(x)


def norms_fused(x: torch.Tensor, ln1: nn.LayerNorm, ln2: nn.LayerNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
    return two_layer_norms_fused(x, ln1.weight, ln1.bias, ln2.weight, ln2.bias,
                                 ln1.eps)


def up_plain(x: torch.Tensor, linear: nn.Linear, approximate: str) -> torch.Tensor:
    return F.gelu(linear(x), approximate=approximate)


def up_fused(x: torch.Tensor, linear: nn.Linear, approximate: str) -> torch.Tensor:
    return linear_bias_gelu_fused(x, linear.weight, linear.bias, approximate)


# ## Attention backends
#
# The attention is PyTorch's `scaled_dot_product_attention`, which picks its
# backend (cuDNN's on Hopper); `ModelKernels.attention` pins one.

ATTENTION_BACKENDS = ("cudnn", "flash", "efficient", "math")


def sdpa_backend(name: str):
    """The `torch.nn.attention.SDPBackend` of one of `ATTENTION_BACKENDS`."""
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}[name]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              backend: str | None) -> torch.Tensor:
    r"""Causal $\operatorname{softmax}(q k^\top / \sqrt{d_h}) v$ on `backend`."""
    if backend is None or not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(sdpa_backend(backend)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
