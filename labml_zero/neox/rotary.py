r"""
---
title: Rotary embeddings
summary: GPT-NeoX's partial rotary embeddings, their tables computed once per
  model, and q and k rotated in one pass.
---

# Rotary embeddings

GPT-NeoX's partial rotary embeddings ([Su et al.](https://arxiv.org/abs/2104.09864)):
only the first $d_r$ of the $d_h$ dimensions of each query and key head are
rotated, pair $i$ at position $m$ by the angle

$$m\,\theta_i, \qquad \theta_i = b^{-2i/d_r},$$

$b$ the base (`rotary_base`), so the angle grows with the position; the
other dimensions carry no position. The angles'
cosines and sines are a table (`rotary_cos_sin`) that depends on the
position and the config, not on the layer, so one `RotaryTables` serves every
layer of a model (Llama's [rotary page](../llama/rotary.html) subclasses it
for its own angles), and the rotation of q and k is one pass over both. The
[model](model.html) calls it from its attention; the [fused
kernels](kernels.html) choose between the plain rotation and its compiled
twin (`rotary_joint_fused`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from labml_zero.neox import kernels as K
from labml_zero.neox.config import NeoXConfig

__all__ = ["rotary_cos_sin", "rotary_table_bytes", "RotaryTables", "rotate_half",
           "apply_rotary", "apply_rotary_fused", "rotary_joint_plain",
           "rotary_joint_fused", "rotary_plain", "rotary_fused"]


def rotary_cos_sin(n_positions: int, config: NeoXConfig, *,
                   device: torch.device, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    ### Rotary angles $m\theta_i$

    Dimension pairs $(i, i + d_r/2)$ of each query and key head are rotated by
    the angle $m \theta_i$ at position $m$, with $\theta_i = b^{-2i/d_r}$ and the
    base (`rotary_base`) $b = 10000$
    (tested: tests/neox/test_config.py::test_figures_in_the_notes)
    in every released model:

    $$\begin{pmatrix} q_i \\ q_{i + d_r/2} \end{pmatrix} \mapsto
      \begin{pmatrix} \cos m\theta_i & -\sin m\theta_i \\
                      \sin m\theta_i & \cos m\theta_i \end{pmatrix}
      \begin{pmatrix} q_i \\ q_{i + d_r/2} \end{pmatrix}$$

    This is Hugging Face's `rotate_half` convention (halves, not interleaved
    pairs), which is what the released checkpoints were converted to. The
    tables $\cos m\theta_i$ and $\sin m\theta_i$, each `[T, d_r]`, are the same
    in every layer; the model computes them once (`RotaryTables`).

    Computed in fp32 and cast to the activation dtype only at the end: in bf16 the
    position $m$ itself is exact only up to 256
    (tested: tests/neox/test_model.py::test_bf16_positions_are_exact_up_to_256),
    so $m\theta_i$ computed in bf16 would put late tokens at the wrong angle.
    """
    d_r = config.rotary_dim
    # [d_r / 2] fp32: $\theta_i = b^{-2i / d_r}$
    inv_freq = 1.0 / config.rotary_base ** (
        torch.arange(0, d_r, 2, device=device, dtype=torch.float32) / d_r)
    # [T, d_r / 2] fp32
    angles = torch.outer(torch.arange(n_positions, device=device,
                                      dtype=torch.float32), inv_freq)
    # [T, d_r] fp32; both halves get θ_i, matching `rotate_half`.
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_table_bytes(config: NeoXConfig, n_positions: int,
                       dtype_bytes: int = 2) -> int:
    r"""Bytes of one entry of `RotaryTables`: $\cos$ and $\sin$, `[T, d_r]` each."""
    return 2 * n_positions * config.rotary_dim * dtype_bytes


class RotaryTables:
    r"""
    ### The rotary tables, computed once for every layer of a model

    The angles depend on the position, the config and the dtype, not on the
    layer, so `build_layers` makes one `RotaryTables` and hands it to every
    layer. The first layer to run at a given length $T$, device and dtype
    computes $\cos$ and $\sin$ (`rotary_cos_sin`, {{py:
    neox_model.plain_launches('rotary_tables', neox_model.pythia_160m())}}
    launches); every later layer and step reads them. On the benchmark's
    {{see: W4}}, Pythia-160M at {{py: workloads.workloads()["W4"].seq | d}}
    positions in bf16, one entry (`rotary_table_bytes`) of {{py:
    neox_model.rotary_table_bytes(neox_model.pythia_160m(),
    workloads.workloads()["W4"].seq) / 2**10 | .0f}} KiB
    (tested: tests/neox/test_rotary.py::test_table_bytes_are_the_tensors_bytes)
    serves all {{py: neox_model.pythia_160m().n_layers}} layers.

    It is a plain attribute, not a registered buffer: the ZeRO engine shards,
    gathers and checkpoints a layer's parameters and buffers, and these tables
    are neither state to save nor to shard; they are derived from the config
    and rebuilt on whichever device a layer runs on (a meta-built model gets
    meta tables on a meta forward, and real ones once it runs for real).

    * Keys are `(T, device, dtype)`; only the `max_entries` latest stay. A
      training run uses one key; `generate.py`, without a KV cache, runs a
      longer sequence for every token, so it builds one table per token, not
      one per layer and token.
    * The tables are built outside `torch.inference_mode` and without
      gradients, so a table first built while sampling is an ordinary tensor
      that a later training step may save for backward.
    * Under `torch.compile` Dynamo traces the lookup itself: the tables of an
      entry that exists are inputs of the compiled graph, so a compiled layer
      reads them, as an eager one does, instead of computing $\cos$ and
      $\sin$ again for every element of q and k (Inductor would fuse the
      angles into the rotation's pass, a transcendental per element)
      (tested: tests/neox/test_rotary.py::test_compiled_layers_read_the_tables).
      The entry must exist before the graph is traced: `TransformerLayer`
      makes it in a forward pre-hook, which runs outside a compiled forward.
      A miss while compiling computes the tables in the graph and stores
      nothing: a compiled graph must not change what the next trace sees, or
      a recomputed forward (activation checkpointing) would run another graph
      than the forward it replays, with other saved tensors.
    """

    def __init__(self, config: NeoXConfig, max_entries: int = 4):
        self.config = config
        self.max_entries = max_entries
        self._tables: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = \
            OrderedDict()

    def __call__(self, n_positions: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$\cos$, $\sin$, each `[n_positions, d_r]` of `dtype` on `device`."""
        key = (n_positions, torch.device(device), dtype)
        tables = self._tables.get(key)
        compiling = torch.compiler.is_compiling()
        if tables is None:
            # inference_mode(False) alone would turn gradients on: no_grad after
            with torch.inference_mode(False), torch.no_grad():
                tables = self.compute(n_positions, device, dtype)
            if compiling:
                return tables  # the graph's own: it changes nothing outside
            self._tables[key] = tables
            while len(self._tables) > self.max_entries:
                self._tables.popitem(last=False)  # the least recently used
        elif not compiling:
            self._tables.move_to_end(key)
        return tables

    def compute(self, n_positions: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of a missing entry (a family with other angles, as
        Llama's, overrides this and keeps the cache)."""
        return rotary_cos_sin(n_positions, self.config, device=device,
                              dtype=dtype)

    def prepare(self, x: torch.Tensor, weight_dtype: torch.dtype) -> None:
        """
        Make the entry that the attention of input `x` `[B, T, d]` reads,
        from a layer's forward pre-hook: it runs in `nn.Module.__call__`,
        outside the forward that `compile_layers` compiles, so the entry
        exists before Dynamo traces the lookup. The dtype is the one the
        query's product will have: autocast's where it is on, else the
        weight's. Under compilation of the whole call it does nothing (the
        lookup then computes in the graph).
        """
        if torch.compiler.is_compiling():
            return
        device_type = x.device.type
        autocast = (torch.amp.is_autocast_available(device_type)
                    and torch.is_autocast_enabled(device_type))
        dtype = torch.get_autocast_dtype(device_type) if autocast else weight_dtype
        self(x.shape[-2], x.device, dtype)

    def keys(self) -> list[tuple[int, torch.device, torch.dtype]]:
        """The `(T, device, dtype)` held, least recently used first."""
        return list(self._tables)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    r"""$(x_1, x_2) \mapsto (-x_2, x_1)$ over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> torch.Tensor:
    """Rotate the first $d_r$ dims of `x` `[..., T, d_h]`; pass the rest.

    `cos`, `sin` `[T, d_r]` broadcast over the leading dims, so `x` may hold q
    and k together, `[2, B, n_h, T, d_h]`: one launch per op for both.
    """
    d_r = cos.shape[-1]
    x_rot, x_pass = x[..., :d_r], x[..., d_r:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin  # [..., T, d_r]
    return torch.cat([x_rot, x_pass], dim=-1)


# The fused twin: `apply_rotary` compiled (on CUDA tensors; the function
# itself elsewhere). Inductor writes the products, the sum and both
# concatenations as one pass that reads each element of q and k once, with
# `cos` and `sin` read from the model's tables. Why the tables are an input,
# not computed in the kernel: there the angle $m b^{-2i/d_r}$, a cosine and a
# sine would be evaluated for every element of q and k, $B n_h$ times per
# table entry, and the pass would be bound by the GPU's transcendental units
# instead of by the bytes it moves.
apply_rotary_fused = K.on_gpu_compiled(apply_rotary)


# ### Rotating q and k in one pass
#
# In the fused QKV output `[B, T, n_h, 3, d_h]`, q and k of a head are
# adjacent, so `[B, T, n_h, 2, d_h]` is a view of both, and permuted,
# `[2, B, n_h, T, d_h]`. Every op of `apply_rotary` is elementwise (or a
# slice or a concatenation of the last dim), so applying it to that view
# computes each element of q and k exactly as rotating each alone would, with
# one launch per op instead of two, forward and backward
# (tested: tests/neox/test_rotary.py::test_joint_rotation_is_the_rotation_of_each).
# The last `cat` writes its output contiguous, so q and k come out as the two
# contiguous `[B, n_h, T, d_h]` halves of one tensor, and the attention output
# is laid out as q is (the activation memory page's Note: the attention output
# is copied).


def rotary_joint_plain(qk: torch.Tensor, config: NeoXConfig,
                       tables: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k from `qk` `[2, B, n_h, T, d_h]`, rotated together."""
    cos, sin = tables(qk.shape[-2], qk.device, qk.dtype)  # each [T, d_r]
    return apply_rotary(qk, cos, sin).unbind(0)


def rotary_joint_fused(qk: torch.Tensor, config: NeoXConfig,
                       tables: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
    """The same formula on the same view and tables, compiled into one pass."""
    cos, sin = tables(qk.shape[-2], qk.device, qk.dtype)  # each [T, d_r]
    return apply_rotary_fused(qk, cos, sin).unbind(0)


def rotary_plain(q: torch.Tensor, k: torch.Tensor, config: NeoXConfig,
                 tables: RotaryTables | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """
    The plain rotation for q and k `[B, n_h, T, d_h]` given apart: stacked (a
    copy that `Attention`, holding them as one view, does without), then
    rotated together. Without `tables` it computes the angles itself.
    """
    return rotary_joint_plain(torch.stack([q, k]), config,
                              tables or RotaryTables(config, max_entries=1))


def rotary_fused(q: torch.Tensor, k: torch.Tensor, config: NeoXConfig,
                 tables: RotaryTables | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_plain`'s fused twin: the same stack, then `rotary_joint_fused`."""
    return rotary_joint_fused(torch.stack([q, k]), config,
                              tables or RotaryTables(config, max_entries=1))
