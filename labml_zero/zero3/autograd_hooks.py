r"""
---
title: Autograd hooks on a layer's inputs and outputs
summary: How the runtime learns that the backward pass has reached a layer or
  finished it, for outputs of one tensor or several, and when the whole
  backward pass ends.
---

# Autograd hooks on a layer's inputs and outputs

The functions that find the tensors in a layer's inputs and outputs and attach
the callbacks that start [the schedule's](hooks.html) backward hooks: the
pre-backward at the output's autograd node, the post-backward at the inputs'
gradients, the end of backward on the autograd engine.

The parameters' gradient hooks need none of this: PyTorch's
`register_post_accumulate_grad_hook` on each parameter, registered once by the
schedule, hands each gradient to its chunk's gradients
([a chunk's gradients](chunk_grads.html)), and the end of backward above is
where an accumulation under `no_sync` ends its backward pass
(`ChunkGrads.end_backward`).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator

import torch


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (a layer's inputs, outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def needing_grad(value: Any) -> list[torch.Tensor]:
    return [t for t in tensors_in(value) if t.requires_grad]


def when_grads_computed(tensors: list[torch.Tensor], callback: Callable[[], None],
                        *, mode: str) -> None:
    """
    #### Call `callback` when the gradients of `tensors` are computed

    `mode="any"`: at the first of them; `"all"`: when all are. A layer's input
    and output are mostly one tensor, and then a plain tensor hook does the
    same for a fraction of the host time of `register_multi_grad_hook` (a
    Python function that builds its own bookkeeping per call, twice per layer
    and step).
    """
    if len(tensors) == 1:
        tensors[0].register_hook(lambda grad: callback())
    else:
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads: callback(), mode=mode)


class JoinOutputs(torch.autograd.Function):
    """
    #### Several outputs as one autograd node

    The identity on the tensors of a layer's output that need a gradient. Their
    gradients all meet at this one node, so autograd runs it only when every
    one of them is computed (see Note: release before the next gather). The
    outputs are `detach()`ed aliases, not views: no copy, and an in-place
    change of one is caught by the same version check as on the original.
    """

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # An output whose gradient never comes stays None: no zeros are made.
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


def replace_tensors(value: Any, new: dict[int, torch.Tensor]) -> Any:
    """`value` with each tensor `t` whose `id` is in `new` replaced by `new[id(t)]`,
    walking the containers `tensors_in` walks."""
    if isinstance(value, torch.Tensor):
        return new.get(id(value), value)
    if isinstance(value, tuple):
        items = [replace_tensors(item, new) for item in value]
        # a named tuple is rebuilt from fields, a plain tuple from an iterable
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [replace_tensors(item, new) for item in value]
    if isinstance(value, dict):
        # a dict subclass (a Hugging Face ModelOutput) keeps its type
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = replace_tensors(item, new)
        return copied
    return value


def before_backward_of(output: Any, outputs: list[torch.Tensor],
                       callback: Callable[[], None]) -> Any:
    r"""
    #### Call `callback` when the backward pass reaches a layer's output

    `outputs` are the tensors of `output` that need a gradient. The hook is a
    *pre-hook of the autograd node that made them*, which autograd runs after
    the tensor hooks of the same gradients. One output made by a node has
    that node; several are first joined into one node (`JoinOutputs`), and
    the output returned has the joined tensors in their places. (An output
    that is a leaf has no node: a hook at its gradient.)

    ##### Note: release before the next gather

    In a chain, the output of unit $k - 1$ is the input of unit $k$, and two
    hooks wait at its gradient: unit $k$'s post-backward (its inputs'
    gradients are ready: release it) and unit $k - 1$'s pre-backward (its
    output's gradient is ready: gather it and prefetch). Both are due at the
    same moment; if the gather ran first, unit $k$ would still be gathered
    beside the $1 + \text{prefetch\_depth}$ units of the next window, one unit
    more than the forward pass holds. So the post-backward is a tensor hook on
    the input, and the pre-backward a pre-hook of the autograd node that made
    the output: autograd runs a node's tensor hooks before its node pre-hooks,
    so unit $k$ is released first.

    With several tensors the two hooks would not even be due together: the
    post-backward waits for *all* the inputs' gradients, while unit $k - 1$
    must be gathered before the *first* of its nodes runs, which autograd may
    start as soon as one gradient is ready. Joined, every gradient reaches
    one node, its tensor hooks (the post-backward among them) run when the
    last arrives, and then its pre-hook: again release first, then gather.
    """
    if len(outputs) > 1:
        joined = JoinOutputs.apply(*outputs)
        output = replace_tensors(output, {id(t): j for t, j in zip(outputs, joined)})
        outputs = list(joined)
    if outputs[0].grad_fn is not None:
        outputs[0].grad_fn.register_prehook(lambda grad_outputs: callback())
    else:
        when_grads_computed(outputs, callback, mode="any")
    return output


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """
    #### Run `callback` when the current backward pass ends

    PyTorch has no public API for this; FSDP uses the same private call, so it
    is unlikely to change unannounced, and every backward pass in the tests runs
    through it. It must be called while the backward pass runs (from a hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)
