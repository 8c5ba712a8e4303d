"""The activation count against labml_zero's engine as the benchmark builds it:
GPT-NeoX at one rank with recomputation and the W2-1 kernels, every CPU
allocation of one training step's forward and backward passes tracked by the
profiler (sizes as asked, no allocator rounding)."""

from __future__ import annotations

from dataclasses import replace

import torch

from tests.distributed import run_distributed

LAYERS = (2, 4)
B, T, D = 8, 256, 128


def workload(n_layers: int):
    from bench.workloads import shrink, workloads
    from labml_zero.neox.kernels import ModelKernels

    tiny = shrink(workloads()["W2-1"])
    return replace(tiny, model=replace(tiny.model, n_layers=n_layers, d_model=D,
                                       n_heads=4),
                   batch=B, seq=T, chunk_numel=1 << 16,
                   kernels=ModelKernels.from_names("loss,rotary,norms"))


def allocation_timeline(fn) -> list[int]:
    """The bytes each allocation (+) and free (-) of `fn()` moved, in order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return [size for _, size in sorted(events, key=lambda e: e[0])]


def step_memory(ctx, n_layers: int) -> dict[str, int]:
    """Live bytes after the forward pass and the peak of forward and backward,
    both above what the step started with, on the second step (the first made
    the optimizer's states)."""
    from bench.engine import build_labml_zero, lm_loss, random_batches

    w = workload(n_layers)
    torch.manual_seed(0)
    engine = build_labml_zero(ctx, w)
    model = next(c.cell_contents for c in engine.step.__closure__
                 if isinstance(c.cell_contents, torch.nn.Module))
    batch = random_batches(w, ctx, count=1, seed=0)[0]
    engine.step(batch)
    marker = 12345  # an allocation of this size marks the end of the forward

    def forward_backward():
        loss = lm_loss(model, batch)
        torch.empty(marker, dtype=torch.uint8)  # allocated and freed at once
        loss.backward()

    live = peak = after_forward = 0
    for size in allocation_timeline(forward_backward):
        if size == marker:
            after_forward = live
        live += size
        peak = max(peak, live)
    return {"after_forward": after_forward, "peak": peak, "end": live}


def test_checkpointed_neox_step_keeps_what_the_count_says():
    """After the forward pass: each layer's input ($nd$ a layer, the count's
    `per_layer`) and the chunked loss's saved set, besides one CPU RNG state
    per recomputed unit (`checkpoint` stashes it to replay dropout; the
    embedding, every layer and the final norm) and the fp32 loss. The peak
    grows by exactly as much per layer: no layer keeps more under
    recomputation than the count says, on this (eager, CPU) path."""
    from labml_zero.neox import activation_memory as A

    results = {L: run_distributed(step_memory, 1, L)[0] for L in LAYERS}
    nd = B * T * D * 2
    rng = torch.get_rng_state().numel()  # bytes of one stashed CPU RNG state
    for L, got in results.items():
        w = workload(L)
        count = A.activation_bytes(w.model, batch=B, seq=T, finetune=w.finetune,
                                   checkpointing=True, kernels=w.kernels)
        assert count.per_layer == nd
        units = L + 2  # embedding, L layers, final norm; the readout is the head
        assert got["after_forward"] == (L * count.per_layer
                                        + count.readout_loss.saved
                                        + units * rng + 4)
        assert got["end"] < nd // 100  # the step's activations all freed
    low, high = LAYERS
    assert (results[high]["peak"] - results[low]["peak"]
            == (high - low) * (nd + rng))
