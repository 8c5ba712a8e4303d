"""A chunk's gradient accumulation: held, written, reduced, and what each
backward pass leaves (`labml_zero/zero3/chunk_grads.py`)."""

from __future__ import annotations

import torch
from torch import nn

from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.chunk_grads import padding_ranges
from tests.zero3.models import batch, tiny_layers

# fp32 on one rank: a rank's shard is its whole chunk (S = C), so `local.grad`
# is the chunk's reduced gradient slot for slot
CONFIG = ZeroConfig(dtype=torch.float32, chunk_numel=96, align=4)


def tiny_model() -> Zero3Sequential:
    return Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu", config=CONFIG))


def trainable(model) -> list:
    return [c for c in model.chunks if c.trainable]


def test_only_trainable_chunks_hold_gradients():
    model = tiny_model()
    assert all((c.grads is not None) == c.trainable for c in model.chunks)
    assert any(not c.trainable for c in model.chunks)


def test_held_written_reduced_with_small_integers():
    # Gradients of small integers, so every sum is exact in fp32: slot k's
    # gradient is k + 1 everywhere.
    model = tiny_model()
    chunk = next(c for c in trainable(model) if len(c.params) >= 2)
    grads, n = chunk.grads, len(chunk.params)
    slots = chunk.spec.slots

    def grad(position):
        return torch.full(chunk.params[position].shape, float(position + 1))

    def values(tensor, position):
        slot = slots[position]
        return tensor[slot.offset : slot.end]

    # held: `add` says when every slot has arrived; nothing is written yet
    assert [grads.add(k, grad(k)) for k in range(n)] == [False] * (n - 1) + [True]
    assert len(grads.held) == n and grads.full is None
    # a backward pass under no_sync ends: written, nothing held or seen, kept
    grads.end_backward()
    buffer = grads.full
    assert buffer is not None and not grads.held and not grads.seen
    assert grads.written == set(range(n))
    assert all(torch.all(values(buffer, k) == k + 1) for k in range(n))
    # the next micro-batch adds into the same buffer, slot 0 only
    assert grads.add(0, grad(0)) is False
    grads.end_backward()
    assert grads.full is buffer and torch.all(values(buffer, 0) == 2)
    # reduced: slot 0 three times, the others once, padding zero; then empty
    grads.add(0, grad(0))
    grads.reduce()
    expected = torch.zeros(chunk.numel)
    for k in range(n):
        values(expected, k).fill_(3 if k == 0 else k + 1)
    assert torch.equal(chunk.local.grad, expected)
    assert grads.full is None and not (grads.held or grads.seen or grads.written)
    # the next accumulation starts from zero: slot 1 alone, added to local.grad
    grads.add(1, grad(1))
    grads.reduce()
    values(expected, 1).add_(2)
    assert torch.equal(chunk.local.grad, expected)
    for start, end in padding_ranges(chunk.spec):
        assert torch.all(chunk.local.grad[start:end] == 0)


def test_no_sync_keeps_the_buffer_and_a_reduction_starts_the_next_from_zero():
    model = tiny_model()
    x, y = batch(0, 4)

    def backward():
        nn.functional.mse_loss(model(x), y).backward()

    with model.no_sync():
        backward()
    # each chunk's backward pass ended without a reduction: buffer kept
    first = {}
    for chunk in trainable(model):
        grads = chunk.grads
        assert not grads.seen and not grads.held
        assert grads.written == set(range(len(chunk.params)))
        assert grads.full is not None and chunk.local.grad is None
        first[id(chunk)] = (grads.full, grads.full.clone())
    with model.no_sync():
        backward()
    for chunk in trainable(model):
        buffer, once = first[id(chunk)]
        # the same buffer, and the same batch twice: g + g = 2g, exact in fp32
        assert chunk.grads.full is buffer
        written = [chunk.spec.slots[k] for k in chunk.grads.written]
        for slot in written:
            assert torch.equal(buffer[slot.offset:slot.end],
                               2 * once[slot.offset:slot.end])
    backward()  # outside no_sync: the sum of three is reduced once
    eps = torch.finfo(torch.float32).eps
    for chunk in trainable(model):
        grads, (_, once) = chunk.grads, first[id(chunk)]
        assert grads.full is None and not (grads.seen or grads.written)
        # 2g + g rounds once (half an ulp of 3g); the mean over one rank is exact
        for slot in chunk.spec.slots:
            torch.testing.assert_close(chunk.local.grad[slot.offset:slot.end],
                                       3 * once[slot.offset:slot.end],
                                       rtol=eps, atol=0)
    model.zero_grad()
    with model.no_sync():
        backward()
    for chunk in trainable(model):
        # not 4g: the reduction ended the last accumulation (padding is
        # uninitialised: the slots are compared)
        once = first[id(chunk)][1]
        for slot in chunk.spec.slots:
            assert torch.equal(chunk.grads.full[slot.offset:slot.end],
                               once[slot.offset:slot.end])


def test_the_held_gradients_live_beside_the_buffer_they_are_copied_into(monkeypatch):
    """What the memory model's `largest_grad_buffer` counts: at a chunk's copy its
    held gradients (the parameter dtype, its parameters' elements) and its
    full-size buffer (the reduce dtype, all $C$ elements) are alive at once."""
    from labml_zero.zero3.chunk_grads import ChunkGrads
    from labml_zero.planner.grad_buffers import held_grads, largest_grad_buffer

    alive = {}
    flush = ChunkGrads.flush

    def recording(grads, *args, **kwargs):
        held = sum(g.untyped_storage().nbytes() for _, g in grads.held)
        flush(grads, *args, **kwargs)
        if held:  # a call with nothing held returns at once
            # the held list is cleared only after the copy has read it
            alive[grads.numel, grads.slots] = (
                held + grads.full.untyped_storage().nbytes())

    # on the class: the hooks bind `flush` when they are registered
    monkeypatch.setattr(ChunkGrads, "flush", recording)
    config = ZeroConfig(dtype=torch.bfloat16, chunk_numel=96, align=4)
    model = Zero3Sequential(zero3_layers(tiny_layers(0), device="cpu", config=config))
    x, y = batch(0, 4)
    with model.no_sync():  # one rank: only an accumulation writes a buffer
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    p, g_r = 2, 4
    for chunk in trainable(model):
        used = sum(slot.end - slot.offset for slot in chunk.spec.slots)
        assert alive[chunk.numel, chunk.spec.slots] == p * used + g_r * chunk.numel
    layout = model.layout
    largest = max(alive.values())
    padding = max(c.chunk_numel - sum(s.end - s.offset for s in c.slots)
                  for c in layout.chunks if c.trainable)
    # the term bounds the moment, above it by at most the padding's p bytes
    assert largest <= largest_grad_buffer(layout, g_r, p) <= largest + p * padding
    assert largest_grad_buffer(layout, g_r, p) - held_grads(layout, p) == (
        g_r * max(c.chunk_numel for c in layout.chunks if c.trainable))
