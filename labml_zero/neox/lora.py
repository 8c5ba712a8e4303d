r"""
---
title: LoRA
summary: Low-rank adapters on GPT-NeoX's four projections; the base weights stay
  frozen in two-byte chunks and only the adapters carry gradients and Adam state.
---

# LoRA

Low-rank adaptation ([Hu et al.](https://arxiv.org/abs/2106.09685)) freezes
a pretrained weight $W \in \mathbb{R}^{d_\text{out} \times d_\text{in}}$ and learns a
low-rank update $\Delta W = \frac{\alpha}{r} B A$ beside it, with
$A \in \mathbb{R}^{r \times d_\text{in}}$, $B \in \mathbb{R}^{d_\text{out} \times r}$ and a
rank $r \ll \min(d_\text{in}, d_\text{out})$. A linear layer then computes

$$y = W x + b + \frac{\alpha}{r} B A x$$

and trains $r (d_\text{in} + d_\text{out})$ numbers instead of $d_\text{in} d_\text{out}$: for
GPT-NeoX's fused QKV projection of width $d$ ($d_\text{out} = 3d$), $4rd$ instead of
$3d^2$.

After training, $W' = W + \frac{\alpha}{r} B A$ is an ordinary weight of the
same shape: the merged model runs at the base model's cost and loads anywhere the
base model does (see [LoRA export](lora_export.html)). Frozen, the base costs only
its two-byte shard (the memory per rank is the last section).

## Limitations

* No dropout on the adapter's input (PEFT's `lora_dropout`), no rsLoRA or DoRA.
* Adapters sit on every transformer layer alike; the embedding and readout
  cannot be adapted.
* Layers built for real (not on the meta device) get their adapters initialised
  from the global random generator when `FineTuneLoRA` runs; a layer's own
  `reset_parameters()` resets only the base weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from labml_zero.neox.model import TransformerLayer
from labml_zero.zero3.memory_model import zero_model_states
from labml_zero.zero3.trainable import TrainableCount, mark_trainable

__all__ = ["LoRALinear", "FineTuneLoRA", "TARGETS", "ADAPTER_NAMES",
           "is_adapter", "init_adapter", "load_hf_layer", "base_layer",
           "sharded_count", "lora_model_states"]

# `FineTuneLoRA` puts adapters on any subset of the four projections of every
# transformer layer (`query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`,
# PEFT's names for them) and freezes everything else. PEFT's name of each target
# -> its path inside a `TransformerLayer`.
TARGETS = {
    "query_key_value": "attention.query_key_value",
    "dense": "attention.dense",
    "dense_h_to_4h": "mlp.dense_h_to_4h",
    "dense_4h_to_h": "mlp.dense_4h_to_h",
}
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
    `lora_B` `[d_out, r]` are added beside them.
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


# ## The fine-tuner


@dataclass(frozen=True)
class FineTuneLoRA:
    r"""
    ## Adapt the chosen projections of every transformer layer

    Call it on the layers (on the meta device or real) **before** the engine
    shards them: it swaps each target `nn.Linear` for a `LoRALinear` sharing its
    weight and bias, and leaves only the adapters with `requires_grad`, so they
    get trainable chunks of their own while every base weight goes to frozen
    chunks.
    """

    name: ClassVar[str] = "lora"
    rank: int = 8
    r"""$r$. PEFT's default; in the LoRA paper's GPT-3 experiments very small
    ranks did about as well as much larger ones."""
    alpha: float = 16.0
    r"""$\alpha$: the update is scaled by $\alpha / r$ (2 at the defaults, the
    common $\alpha = 2r$)."""
    targets: tuple[str, ...] = field(default_factory=lambda: tuple(TARGETS))
    """PEFT's names of the adapted projections: any non-empty subset of
    `query_key_value`, `dense` (attention output), `dense_h_to_4h`,
    `dense_4h_to_h`; default all four."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        targets = ((self.targets,) if isinstance(self.targets, str)
                   else tuple(self.targets))
        if not targets:
            raise ValueError("LoRA targets must name at least one projection")
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target {unknown[0]!r}; expected some of "
                             f"{', '.join(TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"LoRA targets name a projection twice: {targets}")
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        r"""$\alpha / r$"""
        return self.alpha / self.rank

    def paths(self) -> list[str]:
        """The targets' paths inside a `TransformerLayer`, e.g. `attention.dense`."""
        return [TARGETS[t] for t in self.targets]

    def __call__(self, layers: Sequence[nn.Module]) -> TrainableCount:
        r"""
        ### Add the adapters and freeze the rest

        Returns the count: `trainable` is $\Psi_\text{lora}$, `total` is
        $\Psi_\text{base} + \Psi_\text{lora}$. Raises if a layer already has an adapter
        (a second call would otherwise stack two).
        """
        for layer in layers:
            if isinstance(layer, TransformerLayer):
                for path in self.paths():
                    owner_name, _, leaf = path.rpartition(".")
                    owner = layer.get_submodule(owner_name)
                    linear = getattr(owner, leaf)
                    if isinstance(linear, LoRALinear):
                        raise ValueError(f"layer {layer.layer_idx} {path} already "
                                         f"has a LoRA adapter")
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


# ## Loading the base weights


def base_layer(module: nn.Module) -> nn.Module:
    """
    #### The layer as the checkpoint knows it

    A transformer layer with adapters has `lora_A`/`lora_B` entries that no
    Hugging Face checkpoint has; its twin without them, on the meta device
    (nothing allocated), has exactly the checkpoint's names and shapes. Other
    layers are returned as they are.
    """
    if isinstance(module, TransformerLayer):
        return TransformerLayer(module.config, module.layer_idx, device="meta")
    return module


def load_hf_layer(layer, checkpoint) -> None:
    """
    ### Load a sharded layer's base weights from a Hugging Face checkpoint

    `layer` is a `Zero3Layer`, with or without adapters; `checkpoint` an
    `HFCheckpoint` or a `NeoX20BCheckpoint` (anything with `layer_state_dict`).
    Every parameter but the adapters is loaded, each rank copying only its
    slices, as `Zero3Layer.load_sharded` does; the adapters keep the values
    `init_param` gave them, so a model loaded this way is the checkpoint's model
    at step 0. Without adapters it is `load_sharded` itself.
    """
    # [one layer] on the host, shapes checked before any tensor is read
    state = checkpoint.layer_state_dict(base_layer(layer.module))
    for chunk in layer.chunks:
        for position, slot in enumerate(chunk.spec.slots):
            name = layer.layout.params[slot.param_index].name
            if is_adapter(name):
                continue
            if name not in state:
                raise KeyError(f"no tensor for parameter {name!r} in the checkpoint")
            chunk.load_param(position, state[name])


# ## Memory
#
# The engine packs trainable and frozen parameters into different chunks (see
# [chunk layout](../zero3/chunk_layout.html)). A frozen chunk has only its
# two-byte (bf16 or fp16) shard: no gradient, no fp32 master, no Adam moments. So
# with $\Psi_\text{base}$ frozen elements (every base weight, the embedding and readout
# included) and $\Psi_\text{lora}$ adapter elements, the model states of a rank are
#
# $$M = \frac{2\,\Psi_\text{base} + (2 + 4 + 12)\,\Psi_\text{lora}}{N_d}$$
#
# bytes (tested: tests/neox/test_lora.py::test_memory_model_matches_the_bytes_held):
# the adapters' two-byte shard, their fp32 gradient shard (4 bytes, the reduce
# dtype's), and `AdamFP16`'s fp32 master and two moments ($K = 4 + 4 + 4$; with
# fp32 chunks the shard is its own master, so $p = 4$ and $K = 4 + 4$). Padding
# costs what the elements of its chunk cost; `lora_model_states` is this formula
# and `sharded_count` counts the padding in.
#
# The adapters are small beside the base: on all four projections a layer has
# $r (4d + 2d + 5d + 5d)$ adapter elements against the $(3 + 1 + 4 + 4) d^2$ of
# its frozen matrices, so their bytes are a share of order $r / d$ of the
# base's; at $r = 8$ it is under a tenth from width $d = 1024$ (tested:
# tests/neox/test_lora.py::test_adapters_cost_under_a_tenth_of_the_base_from_width_1024)
# on. A LoRA fine-tune costs about what holding the two-byte model costs.
#
# Its activations are another matter: each adapter's $A$ keeps its input for
# $\partial L / \partial A$, as a trained $W$ would, and its $B$ keeps
# $A x$ `[n, r]` ([activation memory](activation_memory.html) counts both).


def sharded_count(layers: Sequence) -> TrainableCount:
    """
    #### Elements in the chunks of sharded layers, padding included

    `layers` are `Zero3Layer`s. Frozen chunks hold the base, trainable chunks
    the adapters; every chunk's size is a multiple of $N_d$, so these totals
    over $N_d$ are exactly what each rank stores.
    """
    trainable = sum(layer.layout.total_numel(trainable=True) for layer in layers)
    total = sum(layer.layout.total_numel() for layer in layers)
    return TrainableCount(trainable, total)


def lora_model_states(count: TrainableCount, world_size: int, *,
                      param_bytes: int = 2, grad_bytes: int = 4,
                      optimizer_bytes: int = 12) -> int:
    r"""
    ## Model-state bytes per rank of a LoRA fine-tune

    $$\frac{p\,\Psi_\text{base} + (p + g + K)\,\Psi_\text{lora}}{N_d}$$

    with $p = 2$ (two-byte chunks), $g = 4$ (fp32 gradient shards) and
    $K = 4 + 4 + 4$ (`AdamFP16`'s master and moments) by default.

    * `count` is what `FineTuneLoRA` returns ($\Psi_\text{lora}$ trainable of
      $\Psi_\text{base} + \Psi_\text{lora}$: the formula), or `sharded_count` of the
      sharded layers (what they store, padding included).
    * With fp32 chunks ($p = 4$) the engine uses the parameter shard as the
      master, so pass `optimizer_bytes=8`.
    """
    return zero_model_states(count.trainable, count.total - count.trainable,
                             world_size,
                             param_bytes=param_bytes, grad_bytes=grad_bytes,
                             optimizer_bytes=optimizer_bytes)
