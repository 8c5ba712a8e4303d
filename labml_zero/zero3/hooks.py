r"""
---
title: Hooks and schedule
summary: One training step hook by hook (when each chunk is gathered,
  prefetched, released and reduced), how many units are gathered at most, frozen
  layers and gradient accumulation.
---

# Hooks and schedule

A chunk knows *how* to gather, release and reduce (explained in
[the chunk's page](chunk.html)); this page decides *when*, from hooks that
PyTorch calls around each wrapped layer, a unit.

At most $1 + D$ units ($D$ the {{see: prefetch depth}}) are gathered at a time
in either pass, besides the root unit and the held units, gathered for the
whole step (see Note:
release before the next gather). The runtime below lists the step hook by hook;
each hook is explained beside its code.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .autograd_hooks import (before_backward_of, needing_grad, queue_end_of_backward,
                             when_grads_computed)
from .chunk import Chunk
from .communication import Communicator


class Phase(Enum):
    """
    ## Where the step is

    * `IDLE`: between steps; every chunk is sharded but the resident ones
      (frozen chunks kept gathered, `keep_resident`).
    * `FORWARD`: from the runtime's `begin_forward` (which gathers the root
      unit) to the first backward hook.
    * `BACKWARD`: until the end-of-backward callback.
    """

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(eq=False)
class Unit:
    """
    ## A unit of gather and release

    * `index`: its position in registration order.
    * `module`: the layer, or `None` for the root unit, which holds the parameters of
      no wrapped layer and stays gathered for the whole step.
    * `chunks`: its chunks in execution order.
    * `held`: the unit owns a parameter a later unit reads too, so it stays
      gathered from its pre-forward hook to the end of the backward pass, as
      the root unit does (see Note: a parameter of two layers, in
      [sharding a model](sharded_model.html)); its chunks count as gathered
      for the whole step.
    * `expects_backward`: whether a pre-backward hook is registered in this step.
    """

    index: int
    module: nn.Module | None
    chunks: list[Chunk]
    held: bool = False
    expects_backward: bool = False
    handles: list = field(default_factory=list)

    def gather(self) -> None:
        for chunk in self.chunks:
            chunk.gather()

    def wait(self) -> None:
        for chunk in self.chunks:
            chunk.wait()

    def release(self) -> None:
        for chunk in self.chunks:
            chunk.release()


class Zero3Runtime:
    r"""
    ## The runtime

    One per sharded model; it owns the units and the step's state.

    * `comm` is the [communicator](communication.html).
    * `prefetch_depth` is how many units ahead are gathered while one computes.
    * `reshard_after_forward`: release a unit's chunks after its forward
      (ZeRO-3); `False` keeps them gathered until its backward is done, trading
      $C \cdot p$ bytes per unit for one all-gather per unit per step.

    ### One training step

    Forward, for each unit in execution order:

    1. **pre-forward hook**: gather the unit's chunks, queue the gathers of the next
       $D$ units ($D$ the {{term: prefetch depth}}, `prefetch_depth`) on a side
       stream, the {{term: gather stream}}, and wait for this unit's; then the layer
       computes;
    2. **post-forward hook**: release the chunks, and hook the output so that the
       backward pass announces when it reaches this unit.

    Backward, for each unit in reverse:

    3. **pre-backward hook**: gather the chunks again and prefetch the units below;
       a unit whose output needs no gradient (frozen layers at the input end) is
       never gathered again;
    4. **gradient hooks**, during the layer's backward: each parameter's gradient
       goes to its chunk's [gradients](chunk_grads.html), and a chunk whose
       parameters have all reported is reduce-scattered at once on a second side
       stream, the {{term: reduce stream}} (inside `no_sync` it only accumulates);
    5. **post-backward hook**: release;
    6. **end of backward**: reduce what was not (or, inside `no_sync`, end each
       chunk's backward pass), release what is still gathered.

    Then [AdamFP16](../optimizers/adam_fp16.html), the next page, updates the
    shards.

    ### One measured step

    ![training step timeline](figures/step_timeline.svg)

    A step of a Pythia-160M-shaped GPT-NeoX on two GPUs: rank 0's kernels from
    `torch.profiler` (converted by `bench/timeline.py`), one lane per CUDA stream,
    time from left to right. *gather* is the gather stream: each all-gather (hooks 1
    and 3) starts before the compute that needs it, so the compute lane rarely waits
    for one. *compute* is the layers, forward then backward; its long stretch
    without collectives in the middle is the readout and the loss over a
    {{py: neox_model.pythia_160m().n_vocab}}-token vocabulary. *reduce* holds the
    reduce-scatters of hook 4, each started when a chunk's last gradient arrives and
    running beside the backward of the layers below (this run updates during the
    backward pass: the optimizer's updates, queued as each chunk is reduced, are
    among the compute kernels there). The step ends at hook 6, when the compute
    stream has waited for the last reduction.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        prefetch_depth: int = 1,
        reshard_after_forward: bool = True,
        grad_ready: Callable[..., None] | None = None,
    ):
        self.comm = comm
        self.prefetch_depth = prefetch_depth
        self.reshard_after_forward = reshard_after_forward
        self.units: list[Unit] = []
        self.root: Unit | None = None
        self.phase = Phase.IDLE
        self.forward_order: list[Unit] = []
        self.last_forward_order: list[Unit] = []
        # False while accumulating micro-batches: gradients stay in the full-size
        # buffers and are reduced once, by the backward that runs with it True.
        self.sync_gradients = True
        self._reduced: set[int] = set()
        # see `on_grad_ready`; by handle id (an `OrderedDict`: weakly referable)
        self._grad_ready: OrderedDict[int, Callable[..., None]] = OrderedDict()
        if grad_ready is not None:
            self.on_grad_ready(grad_ready)

    def on_grad_ready(self, callback: Callable[..., None]) -> RemovableHandle:
        """
        ### Register what to call when a shard's gradient is final

        `callback(shard, after=reduce_stream)` is called once a trainable
        chunk's gradient shard is final (its reduce-scatter queued on
        `reduce_stream`): the optimizer (`AdamFP16.grad_ready`) may start the
        gradient's copy to the host, or the shard's update, overlapping the rest
        of the backward pass. Callbacks run in registration order.

        Returns a handle whose `remove()` unregisters it, as a module hook's
        does; not from inside a callback, while the reduction iterates them.
        """
        handle = RemovableHandle(self._grad_ready)
        self._grad_ready[handle.id] = callback
        return handle

    @property
    def grad_ready(self) -> tuple[Callable[..., None], ...]:
        """The registered callbacks, in order (read only)."""
        return tuple(self._grad_ready.values())

    ### Registration

    def add_unit(self, module: nn.Module | None, chunks: list[Chunk], *,
                 held: bool = False) -> Unit:
        unit = Unit(len(self.units) if module is not None else -1, module, chunks,
                    held=held)
        if module is None:
            self.root = unit
        else:
            self.units.append(unit)
            unit.handles.append(
                module.register_forward_pre_hook(
                    self._hook_pre_forward(unit), with_kwargs=True
                )
            )
            unit.handles.append(
                module.register_forward_hook(
                    self._hook_post_forward(unit), with_kwargs=True
                )
            )
        for chunk in chunks:
            if not chunk.trainable:
                continue
            for position, param in enumerate(chunk.params):
                unit.handles.append(
                    param.register_post_accumulate_grad_hook(
                        self._hook_grad(chunk, position)
                    )
                )
        return unit

    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root is not None else []) + self.units

    def all_chunks(self) -> list[Chunk]:
        """Every chunk, root first, then the units in registration order."""
        return [c for u in self.all_units() for c in u.chunks]

    ### The root: start and end of a forward pass

    def begin_forward(self) -> None:
        """Called by the wrapper before the model's forward."""
        if self.phase is Phase.BACKWARD:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError("forward called while a backward pass is "
                                   "running through the same model")
            # No backward runs: the last one raised before its end, and autograd
            # dropped its end-of-backward callback with it.
            self._abandon_backward()
        if self.phase is Phase.FORWARD:
            # The last forward had no backward (an evaluation with grad enabled):
            # nothing is pending but gathered chunks.
            self._release_all()
        self.phase = Phase.FORWARD
        self.forward_order = []
        if self.root is not None:
            self.root.gather()
            self.root.wait()

    def end_forward(self, output: Any) -> Any:
        """Called by the wrapper after the model's forward; the wrapper returns
        what it returns: the output, hooked so that its backward pass starts
        with `_enter_backward`, before any of the root's parameters is read
        (a readout in the root is the first thing a backward pass runs)."""
        outputs = needing_grad(output) if torch.is_grad_enabled() else []
        if not outputs:
            # No backward will follow.
            self._release_all()
            self._finish_step()
            return output
        return before_backward_of(output, outputs, self._enter_backward)

    ### Forward hooks

    def _hook_pre_forward(self, unit: Unit):
        """
        ### 1. Pre-forward: gather, prefetch, wait

        Gathers the unit's chunks (nothing to do if a prefetch already queued
        them), queues the gathers of the next `prefetch_depth` units on the
        gather stream, so that they overlap this unit's computation, and makes
        the compute stream wait for this unit's gathers only. It also hooks the
        layer's inputs: when their gradients are computed, the unit's backward is
        done (5).

        With `torch.utils.checkpoint` (non-reentrant), a unit's forward runs a
        second time during the backward. The pre-backward hook has gathered the
        chunks by then, so this hook finds them gathered: no second all-gather.

        A unit must run at most once per forward pass, and reentrant checkpointing
        (`use_reentrant=True`) is not supported.
        """
        def hook(module, args, kwargs):
            if self.phase is Phase.BACKWARD:
                # Activation checkpointing recomputes this forward during backward;
                # the pre-backward hook has already gathered the chunks.
                unit.gather()
                unit.wait()
                return None
            if self.phase is Phase.IDLE:
                # A unit called without the wrapper's forward (a single Zero3Layer).
                self.begin_forward()
            self.forward_order.append(unit)
            unit.gather()
            for ahead in self._next_in_forward(unit):
                ahead.gather()
            unit.wait()
            if torch.is_grad_enabled():
                inputs = needing_grad((args, kwargs))
                if inputs:
                    when_grads_computed(inputs, lambda: self._post_backward(unit),
                                        mode="all")
            return None

        return hook

    def _hook_post_forward(self, unit: Unit):
        """
        ### 2. Post-forward: release, and hook the output

        Releases the chunks (unless `reshard_after_forward` is off and a backward
        will follow, or the unit is held). If the output needs a gradient, `before_backward_of` calls
        the pre-backward hook (3) when the backward pass reaches this unit, and
        `expects_backward` remembers it, so that the backward prefetches only
        units that will run a backward: a frozen embedding at the bottom is never
        gathered again.
        """
        def hook(module, args, kwargs, output):
            if self.phase is Phase.BACKWARD:
                return None
            # a held unit is released with the rest at the end of the step
            if not unit.held and (self.reshard_after_forward
                                  or not torch.is_grad_enabled()):
                unit.release()
            outputs = needing_grad(output) if torch.is_grad_enabled() else []
            unit.expects_backward = bool(outputs)
            if not outputs:
                return None
            # Several outputs come back joined into one autograd node.
            return before_backward_of(output, outputs,
                                      lambda: self._pre_backward(unit))

        return hook

    def _next_in_forward(self, unit: Unit) -> list[Unit]:
        """
        #### The units to prefetch after `unit`

        The forward order of the last step predicts the next one; before the
        first step, the order in which units were registered does, and so does
        a forward that departs from the last one.
        """
        if self.prefetch_depth == 0:
            return []
        order = self.last_forward_order or self.units
        position = len(self.forward_order) - 1
        if position >= len(order) or order[position] is not unit:
            # This forward departs from the last one; fall back to registration order.
            order, position = self.units, self.units.index(unit)
        return order[position + 1 : position + 1 + self.prefetch_depth]

    ### Backward hooks

    def _enter_backward(self) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            self._reduced = set()
            queue_end_of_backward(self._end_backward)
            # The root and held units stay gathered from the forward to here,
            # unless something released them in between: an earlier backward
            # through the same graph (`retain_graph=True`) or a forward without
            # gradients. No hook of theirs runs in the backward pass, so gather
            # them here (a no-op where they are still gathered).
            for unit in self.all_units():
                if unit.module is None or unit.held:
                    unit.gather()
                    unit.wait()

    def _pre_backward(self, unit: Unit) -> None:
        """
        ### 3. Pre-backward: gather again, prefetch the units below

        Called when the gradient of the unit's output is ready. The first call
        of a backward pass queues the end-of-backward callback (6).
        """
        self._enter_backward()
        # the gradients the reduce stream has finished reading can go
        self.comm.reduce_holds.drop_finished()
        unit.gather()
        # Prefetch the units whose backward comes next: those before this one in
        # the forward order that hooked their outputs.
        if unit in self.forward_order:
            position = self.forward_order.index(unit)
            earlier = [u for u in self.forward_order[:position] if u.expects_backward]
            for behind in reversed(
                earlier[-self.prefetch_depth :] if self.prefetch_depth else []
            ):
                behind.gather()
        unit.wait()

    def _hook_grad(self, chunk: Chunk, position: int):
        """
        ### 4. A parameter's gradient goes to its chunk

        Registered with `register_post_accumulate_grad_hook`, on the parameter
        itself, so it fires on every step (labml-nn hooked the gradient
        accumulator node of a view, which current PyTorch does not keep alive:
        the hook was lost and the second step failed). When the chunk's last
        parameter reports, the chunk's gradients go into its buffer (one
        multi-tensor copy) and are reduce-scattered at once, overlapping the
        backward of the layers below; under `no_sync` the copy only adds them up
        (the steps are explained in [a chunk's gradients](chunk_grads.html)).
        """
        # bound once, here: the hook runs once per parameter per backward pass
        add, flush = chunk.grads.add, chunk.grads.flush

        def hook(param: torch.Tensor) -> None:
            self._enter_backward()
            complete = add(position, param.grad)
            # The chunk holds the gradient now; autograd must not add the next
            # micro-batch's into it.
            param.grad = None
            if complete:
                if self.sync_gradients:
                    self._reduce(chunk)
                else:
                    flush()

        return hook

    def _reduce(self, chunk: Chunk) -> None:
        """
        #### Reduce a chunk and say that its shard's gradient is final

        The callbacks of `on_grad_ready` get the shard and the stream to wait
        for; `AdamFP16(update_during_backward=True)` updates the shard right away.
        """
        chunk.grads.reduce()
        self._reduced.add(id(chunk))
        for callback in self._grad_ready.values():
            callback(chunk.shard, after=self.comm.reduce_stream)

    def _post_backward(self, unit: Unit) -> None:
        """
        ### 5. Post-backward: release

        Called when the gradients of the unit's inputs are computed: its
        backward is done, its gathered chunks can go, unless the unit is held
        (the end of backward releases it).
        """
        if self.phase is Phase.BACKWARD and not unit.held:
            unit.release()

    def _end_backward(self) -> None:
        """
        ### 6. End of backward

        A callback queued on the autograd engine. Every trainable chunk not yet
        reduced (its parameters got no gradient) reduces zeros, because every
        rank must take part in every collective; inside `no_sync` each chunk's
        gradients end their backward pass instead, keeping their buffer. Then
        the compute stream waits for the reductions and whatever is still
        gathered is released.

        So ranks must run the same graph: a parameter that gets a gradient on one
        rank and not on another changes the order of the collectives.
        """
        for chunk in self.all_chunks():
            if not chunk.trainable:
                continue
            if self.sync_gradients:
                if id(chunk) not in self._reduced:
                    self._reduce(chunk)
            else:
                chunk.grads.end_backward()
        # compute stream waits: the optimizer reads the gradient shards next
        self.comm.reduce_stream_waited()
        self._release_all()
        self._finish_step()

    ### Step bookkeeping

    def _abandon_backward(self) -> None:
        """
        #### A backward pass that raised

        An exception inside the backward pass (a hook's check, anomaly
        detection) ends it before its end-of-backward callback (6), which
        autograd drops. The caller caught it and runs the next forward: the
        failed pass's gradients, partly held, partly reduced, are discarded
        on every trainable chunk, with those of the micro-batches accumulated
        before it, and said in one warning, so that the next step starts from
        nothing rather than from a part of a step.
        """
        warnings.warn("the last backward pass raised before its end: its "
                      "gradients (and those accumulated before it) are discarded")
        self.comm.reduce_stream_waited()
        for chunk in self.all_chunks():
            if chunk.trainable:
                chunk.grads.discard()
                chunk.local.zero_grad()
        self._release_all()
        self._finish_step()

    def _release_all(self) -> None:
        for unit in self.all_units():
            unit.release()

    def _finish_step(self) -> None:
        self.phase = Phase.IDLE
        if self.forward_order:
            self.last_forward_order = self.forward_order
        for unit in self.units:
            unit.expects_backward = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        r"""
        ### Accumulate gradients without reducing them

        Backward passes inside accumulate into each trainable chunk's
        full-size gradient buffer, kept from one micro-batch to the next (about
        $g_r \Psi_t$ bytes per rank in all, see
        [a chunk's gradients](chunk_grads.html)); the first backward outside
        reduces the sum once: for $k$ micro-batches, one reduce-scatter per
        step instead of $k$.
        """
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """
        ### Every parameter readable, between steps

        For evaluation code that reads weights directly, and for exports. Costs the
        whole model's gathered size; chunks go back to their shards afterwards.
        """
        if self.phase is not Phase.IDLE:
            raise RuntimeError("gathered() is for use between training steps")
        for chunk in self.all_chunks():
            chunk.gather()
        try:
            for chunk in self.all_chunks():
                chunk.wait()
            yield
        finally:
            self._release_all()

    def gathered_chunks(self) -> list[Chunk]:
        return [c for c in self.all_chunks() if c.is_gathered]
