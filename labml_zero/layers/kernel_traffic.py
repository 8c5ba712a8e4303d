r"""
---
title: The bytes a choice of kernels moves
summary: The element-wise bytes that each fusion left off adds to a step,
  counted from the model's own code on the meta device, forward and backward,
  for the step time's roofline.
---

# The bytes a choice of kernels moves

The [step time](../planner/step_time.html)'s element-wise and readout terms
are fitted on steps that ran the [fused kernels](../neox/kernels.html). A step with some of
them off runs their plain twins, which move more bytes: each ATen op of a
twin reads its inputs and writes its output, where the compiled twin reads
what enters the fused function once and writes what leaves it once. With
$r + w$ an op's bytes read and written, the bytes a choice $K$ adds over every
fusion on are

$$\Delta(K) = \sum_{\text{op} \in \text{model}(K)} (r + w)
            - \sum_{\text{op} \in \text{model}(\text{all})} (r + w),$$

where, in each model, a fused function counts as one op (a region, below).
The matrix products and the attention count in
neither (their time is the FLOPs term's), nor does any view. Both sums run the
model's own layers on the meta device, so no count is written by hand: a
change to a twin changes its bytes here.

A layer's bytes and the rest's (the final norm, the readout's loss) are told
apart by counting a model of one layer and of two; per token, the step adds

$$t_\Delta = \frac{n\,\bigl(L\,(\Delta_f (1 + c) + \Delta_b) + \Delta_r\bigr)}{W}$$

for $n$ tokens, $L$ layers, $c = 1$ with recomputation, at the element-wise
rate $W$. A compiled layer is one graph that Inductor fuses by itself whatever
its twins, so compiled, $\Delta_f = \Delta_b = 0$; the readout is never
compiled, and its loss keeps $\Delta_r$.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields, replace
from typing import Any, Callable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["VIEW_OPS", "UnfusedBytes", "ByteCount", "fused_stand_in",
           "unfused_bytes", "all_fused"]

VIEW_OPS = frozenset({"view", "_unsafe_view", "slice", "split", "select",
                      "transpose", "t", "expand", "unsqueeze", "squeeze",
                      "permute", "as_strided", "alias", "detach",
                      "split_with_sizes", "chunk", "unbind"})
"""ATen ops that return a view: no kernel runs."""

# While bytes are counted, a fused function (`on_gpu_compiled` of the
# [kernels' page](../neox/kernels.html)) is one region whose inside the count
# does not see: it calls the count's stand-in with itself and its arguments.
STAND_IN: list[Callable] = []


def fused_stand_in() -> Callable | None:
    """The stand-in a fused function calls instead of itself; `None` while
    nothing is counted."""
    return STAND_IN[-1] if STAND_IN else None


# The products and the attention: compute-bound, timed by their FLOPs. On the
# meta device `scaled_dot_product_attention` runs its math form, whose
# softmax's passes are the same for every choice of kernels and cancel in
# $\Delta$.
PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"})
# Allocations write nothing.
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty",
                         "new_empty_strided"})


def tensor_bytes(tree: Any) -> int:
    """The bytes of every tensor in a nest of arguments or results."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree)
               if isinstance(t, torch.Tensor))


def tensors_of(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def key(t: torch.Tensor) -> int:
    """A tensor's storage, the same for all its views."""
    return t.untyped_storage()._cdata


class ByteCount(TorchDispatchMode):
    """
    ## Bytes read and written by each op that runs

    Counts $r + w$ of every op that is neither a view, a product nor an
    allocation; a fused function is one region (below) while
    `fused_regions()` is on.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (self.paused or name in VIEW_OPS or name in PRODUCTS
                or name in ALLOCATIONS):
            self.bytes += tensor_bytes((args, kwargs)) + tensor_bytes(out)
        return out

    @contextlib.contextmanager
    def pause(self):
        """Inside a region: its own ops are not the region's bytes."""
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was


# ### A fused function as one region
#
# A compiled function reads what enters it and writes what leaves it, once
# each; inside, what Inductor cannot keep in registers is what a product
# stands between: a product's output that an element-wise op reads, and an
# element-wise result that a product reads, cross memory once. Products inside
# (the bias and GELU's own) are the FLOPs term's. Backward, the region's
# inputs are the incoming gradients and the forward's inputs again (what a
# compiled backward recomputes from), its outputs the gradients it makes. The
# plain twin runs inside, so the model computes what it would.


class RegionCount(TorchDispatchMode):
    """The bytes of one fused region, by the rule above."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self.bytes = 0
        # a tensor is known by its storage, which its views share; each
        # storage's first tensor is kept (alive, so no address is reused)
        self.first: dict[int, torch.Tensor] = {}
        self.kind: dict[int, str] = {}
        self.crossed: set[int] = set()  # counted once
        for t in inputs:
            self.first.setdefault(key(t), t)
            self.kind[key(t)] = "input"

    def cross(self, t: torch.Tensor) -> None:
        k = key(t)
        if k not in self.crossed:
            self.crossed.add(k)
            self.bytes += tensor_bytes(self.first.get(k, t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        given, made = tensors_of((args, kwargs)), tensors_of(out)
        for t in given + made:
            self.first.setdefault(key(t), t)
        if name in VIEW_OPS or name in ALLOCATIONS:
            return out
        product = name in PRODUCTS
        for t in given:
            kind = self.kind.get(key(t))
            if (kind == "made") if product else (kind in ("input", "product")):
                self.cross(t)
        for t in made:
            self.kind.setdefault(key(t), "product" if product else "made")
        return out

    def leave(self, outputs) -> None:
        """The region's outputs, written once (a product's by the product)."""
        for t in tensors_of(outputs):
            if self.kind.get(key(t)) == "made":
                self.cross(t)


ACTIVE: list[ByteCount] = []
"""The counts of the `fused_regions` open now, the innermost last."""


class Region(torch.autograd.Function):
    @staticmethod
    def forward(ctx, count: ByteCount, fn: Callable, kwargs: dict, *args):
        inside = RegionCount(tensors_of(args))
        with count.pause(), inside:
            out = fn(*args, **kwargs)
        inside.leave(out)
        count.bytes += inside.bytes
        ctx.fn, ctx.kwargs, ctx.args = fn, kwargs, args
        return out

    @staticmethod
    def backward(ctx, *grads):
        # the backward pass's own count, not the forward's
        count, args = ACTIVE[-1], ctx.args
        wants = [isinstance(a, torch.Tensor) and ctx.needs_input_grad[3 + i]
                 for i, a in enumerate(args)]
        leaves = [a.detach().requires_grad_() if w else a
                  for a, w in zip(args, wants)]
        inside = RegionCount(tensors_of(leaves) + tensors_of(grads))
        with count.pause(), inside, torch.enable_grad():
            out = ctx.fn(*leaves, **ctx.kwargs)
            pairs = [(o, g) for o, g in zip(tree_leaves(out), grads)
                     if g is not None and o.requires_grad]
            made = torch.autograd.grad([o for o, _ in pairs],
                                       [x for x, w in zip(leaves, wants) if w],
                                       [g for _, g in pairs], allow_unused=True)
        inside.leave(made)
        count.bytes += inside.bytes
        made = iter(made)
        return (None, None, None,
                *(next(made) if w else None for w in wants))


@contextlib.contextmanager
def fused_regions(count: ByteCount):
    """Every fused function (`on_gpu_compiled`) runs as a `Region` of `count`."""
    def stand_in(fn, *args, **kwargs):
        return Region.apply(count, fn, kwargs, *args)

    STAND_IN.append(stand_in)
    ACTIVE.append(count)
    try:
        yield
    finally:
        STAND_IN.pop()
        ACTIVE.pop()


class UnfusedBytes(NamedTuple):
    r"""
    ## $\Delta(K)$ per token

    Bytes over those of every fusion on.
    """

    layer_forward: float
    r"""$\Delta_f$: one layer's forward pass."""
    layer_backward: float
    r"""$\Delta_b$: one layer's backward pass."""
    rest: float
    r"""$\Delta_r$: the final norm, the readout and its loss, both passes."""


def all_fused(kernels):
    """`kernels` with every fusion on, its other fields kept."""
    return replace(kernels, **{n: True for n in type(kernels).fusions()})


def model_bytes(build: Callable, model, kernels, n_layers: int, *, batch: int,
                seq: int) -> tuple[int, int]:
    """The forward's and the backward's bytes of `model` cut to `n_layers`
    layers, its weights trained, for `batch` sequences of `seq` tokens, on the
    meta device (which allocates nothing, whatever the sizes: the count runs
    at the step's own, where a weight's gradient, added once a step or once a
    chunk of the loss, is shared by its tokens)."""
    layers = build(replace(model, n_layers=n_layers), device="meta",
                   dtype=torch.bfloat16, kernels=kernels)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    forward, backward = ByteCount(), ByteCount()
    with forward, fused_regions(forward):
        x = ids
        for layer in layers[:-1]:
            x = layer(x)
        loss = layers[-1](x, ids)
    with backward, fused_regions(backward):
        loss.backward()
    return forward.bytes, backward.bytes


_CACHE: dict[tuple, UnfusedBytes] = {}


def unfused_bytes(build: Callable, model, kernels, *, batch: int, seq: int
                  ) -> UnfusedBytes:
    r"""
    ## $\Delta(K)$ of a family's model

    `build` is the family's `build_layers`; each family's `unfused_bytes` is
    this function with its own ([the family](../family.html)), which the
    planner calls. Zero with every fusion on, and without counting. The fp8
    products are a precision, timed on their own ([the step
    time](../planner/step_time.html)), so the count runs without them.

    For Pythia-1.4B's step of 8 sequences of {{py: 2048 | ,}} tokens with every
    fusion off, a layer's forward moves {{py:
    (families.NEOX.unfused_bytes(neox_model.pythia_1_4b(),
    families.NEOX.resolve_kernels('none', 'cuda'), batch=8, seq=2048).layer_forward
    / neox_model.pythia_1_4b().d_model) | .0f}} bytes more a token and unit of
    width, its backward {{py:
    (families.NEOX.unfused_bytes(neox_model.pythia_1_4b(),
    families.NEOX.resolve_kernels('none', 'cuda'), batch=8, seq=2048).layer_backward
    / neox_model.pythia_1_4b().d_model) | .0f}}, against the {{py:
    step_time.ELEMENTWISE_BYTES}} a pass of the fused layer that the step time
    fits; the plain loss moves {{py:
    (families.NEOX.unfused_bytes(neox_model.pythia_1_4b(),
    families.NEOX.resolve_kernels('none', 'cuda'), batch=8, seq=2048).rest
    / neox_model.pythia_1_4b().n_vocab) | .1f}} bytes more a token and
    vocabulary entry, its fp32 logits read and written pass after pass.
    """
    plain = replace(kernels, **{f.name: False for f in fields(kernels)
                                if f.metadata})
    if plain == all_fused(plain):
        return UnfusedBytes(0.0, 0.0, 0.0)
    entry = (build, model, plain, batch, seq)
    if entry not in _CACHE:
        size = dict(batch=batch, seq=seq)
        one, two = ((model_bytes(build, model, plain, n, **size),
                     model_bytes(build, model, all_fused(plain), n, **size))
                    for n in (1, 2))
        tokens = batch * seq
        # the second layer's bytes, and what the one-layer model has besides
        layer = [((two[0][i] - two[1][i]) - (one[0][i] - one[1][i])) / tokens
                 for i in (0, 1)]
        rest = sum((one[0][i] - one[1][i]) / tokens for i in (0, 1)) - sum(layer)
        _CACHE[entry] = UnfusedBytes(layer[0], layer[1], rest)
    return _CACHE[entry]
