r"""
---
title: Compiling sharded layers
summary: torch.compile on the layers inside Zero3Layers: their forward, not their
  call, so the engine's hooks stay eager around the compiled code.
---

# Compiling sharded layers

`torch.compile` fuses a layer's elementwise work (rotary embeddings, residual
adds, GELU, casts) into fewer kernels; the benchmark measures what that gains.
With ZeRO-3 there is one question: *what* to compile. The runtime registers its
[hooks](hooks.html) on each layer module: before the forward they gather the
layer's chunks (and prefetch the next layers') and register the hook that starts
the backward's gathers; after it they release the chunks. Those hooks call
collectives, switch streams and read the runtime's Python state, none of which a
compiled graph should contain.

So this page compiles a layer's `forward`, not its call:

$$\texttt{module.forward} \leftarrow \texttt{torch.compile}(\texttt{module.forward})$$

and the call around it, with every hook, collective, side stream and event, stays
eager.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["default_compile_backend", "compile_layers"]


def default_compile_backend(device: torch.device) -> str:
    """
    ## The backend

    Inductor on GPUs. On CPU `aot_eager`: dynamo, guards and AOT autograd without
    code generation, because the C++ that CPU Inductor emits for a bf16 GPT-NeoX
    layer can fail to compile with the system's gcc (with or without
    labml_zero), and generating code takes tens of seconds on a small CPU anyway.
    `aot_eager` runs the same kernels as eager, so on CPU the compiled path is
    checked for correctness, not speed.
    """
    return "inductor" if device.type == "cuda" else "aot_eager"


def compile_layers(
    layers: Sequence[nn.Module],
    *,
    device: torch.device,
    types: tuple[type[nn.Module], ...],
    backend: str | None = None,
) -> int:
    """
    ## Compile the forward of each layer of `types`

    * `layers`: `Zero3Layer`s (their `module` is compiled) or plain modules.
    * `types`: which layers to compile, e.g. the transformer layers (the
      embedding and the readout gain nothing).
    * `backend`: default `default_compile_backend(device)`.

    Returns how many layers were compiled. The first step pays for the
    compilation (tens of seconds on a GPU).

    *Why one compilation serves every layer and step.* Inside the compiled code
    the parameters are views into the gathered chunk buffer. Dynamo guards on
    their shape, stride, dtype and device, not on their storage, and treats the
    parameters of every module as inputs of the graph, so

    * resizing the storage to 0 after the forward and back before the backward
      (see [Note: why storage resize](chunk.html)) changes nothing it checks: the
      views always have memory when the code runs;
    * layers of one shape share one graph: 3 layers trained for 3 steps compile
      once (one graph, one AOT forward/backward pair, no graph break; tested), so
      the number of compilations does not grow with the depth of the model, and
      dynamo's per-frame `cache_size_limit` is never reached.

    AOT autograd makes the layer's backward one autograd node; the gradients
    still reach each parameter's `AccumulateGrad` and its post-accumulate-grad
    hook, which moves them into the chunk, eagerly. Under activation
    checkpointing the compiled forward runs again in the recomputation. The
    losses match eager training (tested on two gloo ranks).
    """
    backend = backend or default_compile_backend(device)
    compiled = 0
    for layer in layers:
        module = getattr(layer, "module", layer)
        if isinstance(module, types):
            # The forward, not the call: `module.compile()` would compile the
            # whole call, hooks included. Dynamo would then trace ours, break the
            # graph at `register_multi_grad_hook` and guard on the runtime's
            # Python state (`len(forward_order)`), so it would compile again for
            # every layer until it reached its cache limit. (FSDP2 marks its
            # hooks `torch._dynamo.disable` for this.) An instance attribute
            # works because `nn.Module.__call__` looks `forward` up on self.
            module.forward = torch.compile(module.forward, backend=backend)
            compiled += 1
    return compiled
