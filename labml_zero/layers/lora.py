r"""
---
title: LoRA
summary: Low-rank adapters for any family's projections; the base weights stay
  frozen in two-byte chunks and only the adapters carry gradients and Adam
  state.
---

# LoRA

Low-rank adaptation ([Hu et al.](https://arxiv.org/abs/2106.09685)) freezes
a pretrained weight $W \in \mathbb{R}^{d_\text{out} \times d_\text{in}}$ and learns a
low-rank update beside it, with
$A \in \mathbb{R}^{r \times d_\text{in}}$,
$B \in \mathbb{R}^{d_\text{out} \times r}$ and
$r \ll \min(d_\text{in}, d_\text{out})$:

$$y = W x + b + \frac{\alpha}{r} B A x,$$

$r (d_\text{in} + d_\text{out})$ trained numbers instead of
$d_\text{in} d_\text{out}$. A family names its projections and its block class
([GPT-NeoX's four](../neox/lora.html), [Llama's seven](../llama/lora.html)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from labml_zero.zero3.trainable import TrainableCount, mark_trainable

__all__ = ["ADAPTER_NAMES", "is_adapter", "LoRALinear", "init_adapter",
           "reset_adapters", "load_base_weights", "LoRA"]

# The adapter matrices' names, as PEFT has them, beside `weight` and `bias`.
ADAPTER_NAMES = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether a parameter name (`...query_key_value.lora_A`) is an adapter's."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


# ## The adapted linear


class LoRALinear(nn.Linear):
    r"""
    ## A linear layer with a low-rank adapter

    $y = W x + b + \frac{\alpha}{r} B A x$. A subclass of `nn.Linear`, so
    `weight` and `bias` keep their names (checkpoints load into them by name)
    and code that looks for linears still finds it; `lora_A` `[r, d_in]` and
    `lora_B` `[d_out, r]` are added beside them. No dropout on the adapter's
    input (PEFT's `lora_dropout`), no rsLoRA or DoRA.
    """

    def __init__(self, in_features: int, out_features: int, *, rank: int,
                 alpha: float, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device,
                         dtype=dtype)
        self.rank = rank
        self.alpha = alpha
        factory = dict(device=device, dtype=dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, **factory))
        if self.lora_A.device.type != "meta":
            self.reset_adapter()

    @property
    def scale(self) -> float:
        r"""
        $\alpha / r$. The update $B A x$ is a sum of $r$ terms, so its size grows
        with $r$; dividing by $r$ keeps it about the same when $r$ changes, and
        $\alpha$ sets it once, so a learning rate tuned at one rank serves another.
        """
        return self.alpha / self.rank

    @classmethod
    def wrap(cls, linear: nn.Linear, *, rank: int, alpha: float) -> "LoRALinear":
        """
        ### Adapt an existing linear, keeping its `weight` and `bias` objects

        Built on the meta device (so nothing is allocated for a weight about to
        be replaced), then given the original parameters; the adapters are
        created where the weight is, in its dtype, and initialised unless that
        is the meta device (then `init_adapter` runs chunk by chunk later).
        """
        new = cls(linear.in_features, linear.out_features, rank=rank, alpha=alpha,
                  bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        factory = dict(device=linear.weight.device, dtype=linear.weight.dtype)
        new.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, **factory))
        new.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, **factory))
        if linear.weight.device.type != "meta":
            new.reset_adapter()
        return new

    def reset_adapter(self) -> None:
        """`init_adapter` on both adapter matrices."""
        init_adapter("lora_A", self.lora_A)
        init_adapter("lora_B", self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., d_out]: the frozen path; W gets no gradient, x still does.
        y = F.linear(x, self.weight, self.bias)
        # [..., r] then [..., d_out]: B (A x), never the d_out × d_in product B A,
        # which would cost a full weight's memory and flops per forward.
        return y + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def init_adapter(name: str, param: torch.Tensor) -> None:
    r"""
    ### PEFT's initialisation

    `lora_A`: Kaiming-uniform with $a = \sqrt{5}$ over its fan-in $d_\text{in}$,
    bound $\sqrt{6 / ((1 + a^2) d_\text{in})} = 1 / \sqrt{d_\text{in}}$ (the default
    initialisation of an `nn.Linear` weight); `lora_B`: zero, so that $BA = 0$.
    Layers built for real (not on the meta device) get their adapters
    initialised from the global random generator when the fine-tuner runs; a
    layer's own `reset_parameters()` resets only the base weights.

    So step 0 is the base model: the first forward equals the pretrained model's
    exactly. $B$ still moves, since
    $\partial \mathcal{L} / \partial B = \frac{\alpha}{r} g\, (A x)^\top$ with
    $g = \partial \mathcal{L} / \partial y$ is not zero; $A$ follows once $B$ is.
    (With both zero, neither would ever move.)

    In place, under `no_grad`, so it also runs on views into a chunk's buffer.
    """
    with torch.no_grad():
        if name.endswith("lora_A"):
            nn.init.kaiming_uniform_(param, a=math.sqrt(5))
        elif name.endswith("lora_B"):
            param.zero_()
        else:
            raise ValueError(f"{name!r} is not an adapter parameter")


def reset_adapters(layer: nn.Module) -> None:
    """Every adapter inside `layer` to PEFT's init. A layer built on meta and
    moved with `to_empty` holds uninitialised memory, which its own
    `reset_parameters` does not touch in the adapters."""
    for module in layer.modules():
        if isinstance(module, LoRALinear):
            module.reset_adapter()


def load_base_weights(layer, state: dict[str, torch.Tensor]) -> None:
    """
    ### A sharded layer's base weights, its adapters left as initialised

    `layer` is a `Zero3Layer`, `state` its base tensors by name, read from a
    checkpoint with shapes checked. Each rank copies only its slices, as
    `Zero3Layer.load_sharded` does; the adapters are in no base checkpoint
    and keep the values `init_param` gave them ($B = 0$), so the model loaded
    is the checkpoint's model at step 0. Without adapters this is
    `load_sharded` itself.
    """
    for chunk in layer.chunks:
        for position, slot in enumerate(chunk.spec.slots):
            name = layer.layout.params[slot.param_index].name
            if is_adapter(name):
                continue
            if name not in state:
                raise KeyError(f"no tensor for parameter {name!r} in the checkpoint")
            chunk.load_param(position, state[name])


# ## The fine-tuner


@dataclass(frozen=True)
class LoRA:
    r"""
    ## Adapt the chosen projections of every transformer block

    Every block alike; the embedding and readout cannot be adapted.

    Call it on the layers (on the meta device or real) **before** the engine
    shards them: it swaps each target `nn.Linear` of every `BLOCK` for a
    `LoRALinear` sharing its weight and bias, and leaves only the adapters
    with `requires_grad`, so they get trainable chunks of their own while
    every base weight goes to frozen chunks.

    A family subclasses it once, naming `TARGETS` (PEFT's name of each
    projection, the last part of the module's name in the Hugging Face
    model, which PEFT matches -> its path inside a block) and `BLOCK`, the
    block class, whose instances carry `layer_idx`.
    """

    TARGETS: ClassVar[dict[str, str]] = {}
    BLOCK: ClassVar[type[nn.Module]] = nn.Module
    name: ClassVar[str] = "lora"
    rank: int = 8
    r"""$r$. PEFT's default; in the LoRA paper's GPT-3 experiments very small
    ranks did about as well as much larger ones."""
    alpha: float = 16.0
    r"""$\alpha$: the update is scaled by $\alpha / r$ (2 at the defaults, the
    common $\alpha = 2r$)."""
    targets: tuple[str, ...] | None = None
    """PEFT's names of the adapted projections: a non-empty subset of
    `TARGETS`; `None` (the default) is all of them."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        targets = (tuple(self.TARGETS) if self.targets is None
                   else (self.targets,) if isinstance(self.targets, str)
                   else tuple(self.targets))
        if not targets:
            raise ValueError("LoRA targets must name at least one projection")
        unknown = [t for t in targets if t not in self.TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target {unknown[0]!r}; expected some of "
                             f"{', '.join(self.TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"LoRA targets name a projection twice: {targets}")
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        r"""$\alpha / r$"""
        return self.alpha / self.rank

    def paths(self) -> list[str]:
        """The targets' paths inside a block, e.g. `attention.dense`."""
        return [self.TARGETS[t] for t in self.targets]

    def __call__(self, layers: Sequence[nn.Module]) -> TrainableCount:
        r"""
        ### Add the adapters and freeze the rest

        Returns the count: `trainable` is $\Psi_\text{lora}$, `total` is
        $\Psi_\text{base} + \Psi_\text{lora}$. Raises if a layer already has an adapter
        (a second call would otherwise stack two).
        """
        for layer in layers:
            if not isinstance(layer, self.BLOCK):
                continue
            for path in self.paths():
                owner_name, _, leaf = path.rpartition(".")
                owner = layer.get_submodule(owner_name)
                linear = getattr(owner, leaf)
                if isinstance(linear, LoRALinear):
                    raise ValueError(f"layer {layer.layer_idx} {path} already has "
                                     f"a LoRA adapter")
                setattr(owner, leaf, LoRALinear.wrap(linear, rank=self.rank,
                                                     alpha=self.alpha))
        return mark_trainable(layers, lambda layer, name: is_adapter(name))

    def init_param(self, base: Callable[[str, torch.Tensor], None]
                   ) -> Callable[[str, torch.Tensor], None]:
        """
        ### The initialiser for `zero3_layers(..., init_param=...)`

        Adapters get `init_adapter`, every other parameter `base(name, param)`
        (the model's random initialiser, or a no-op when a checkpoint is loaded
        afterwards). Runs inside each chunk's buffer, one chunk at a time; every
        rank visits the chunks in the same order, so with the same seed all draw
        the same $A$.
        """

        def init(name: str, param: torch.Tensor) -> None:
            if is_adapter(name):
                init_adapter(name, param)
            else:
                base(name, param)

        return init
