"""The early update's non-finite flag, and what the communicator holds for its side stream."""

import pytest
import torch

from labml_zero.optimizers.host_offload import non_finite_flag
from labml_zero.zero3.communication import SideStreamHolds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_non_finite_flag(dtype, bad):
    """0-dim fp32, exactly 1.0 (what the fused kernel tests) when the gradient
    has an inf or a nan, else 0.0; also for huge finite values."""
    grad = torch.full((37,), torch.finfo(dtype).max, dtype=dtype)
    grad[::2] = -1.5
    if bad is not None:
        grad[11] = bad
    flag = non_finite_flag(grad)
    assert flag.dtype == torch.float32 and flag.dim() == 0
    assert flag.item() == (0.0 if bad is None else 1.0)


class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_side_stream_holds_drop_in_order():
    holds = SideStreamHolds()
    first, second = FakeEvent(), FakeEvent()
    a, b = torch.ones(3), torch.ones(4)
    holds.hold([a], first)
    holds.hold([b], second)
    # the second passed but the first not: events on one stream pass in
    # order, so nothing is dropped past an unfinished one
    second.done = True
    holds.drop_finished()
    assert len(holds.held) == 2
    first.done = True
    holds.drop_finished()
    assert not holds.held
    holds.hold([a], FakeEvent())
    holds.drop_all()
    assert not holds.held


# ## The cap on the early updates in flight


class LaggingStream:
    """A side stream that runs nothing until the host waits for it: the host
    as far ahead of the GPU as it can be. `record_event()` as a CUDA stream's."""

    def __init__(self):
        self.queued: list = []  # callables, oldest first
        self.ran = 0

    def enqueue(self, work) -> None:
        self.queued.append(work)

    def record_event(self) -> "LaggingEvent":
        return LaggingEvent(self, len(self.queued))

    def run_until(self, position: int) -> None:
        while self.ran < position:
            self.queued[self.ran]()
            self.ran += 1


class LaggingEvent:
    def __init__(self, stream: LaggingStream, position: int):
        self.stream, self.position = stream, position

    def query(self) -> bool:
        return self.stream.ran >= self.position

    def synchronize(self) -> None:
        self.stream.run_until(self.position)


def most_gradients_waiting(in_flight, chunks: int) -> int:
    """The engine's order for each chunk: its gradient is made, room is made,
    its update is queued (it frees the gradient when it runs) and the event
    behind it issued; returns the most freed gradients alive at once."""
    stream, alive, most = LaggingStream(), set(), 0
    for chunk in range(chunks):
        in_flight.make_room()
        alive.add(chunk)
        stream.enqueue(lambda chunk=chunk: alive.discard(chunk))
        in_flight.issued(stream.record_event())
        most = max(most, len(alive))
    in_flight.clear()
    return most


def test_at_most_q_freed_gradients_wait_for_their_update():
    """With the host far ahead of the side stream, the engine's cap holds the
    waiting gradients at exactly Q; a cap beyond the chunks (no cap) would let
    all of them wait, which is what the memory model could not count."""
    from labml_zero.optimizers.early_update import EarlyUpdates, UpdatesInFlight
    from labml_zero.optimizers.early_update import EARLY_UPDATES_IN_FLIGHT

    engine = EarlyUpdates(lambda homes, early: None, free_grads=True).in_flight
    assert most_gradients_waiting(engine, 12) == EARLY_UPDATES_IN_FLIGHT
    for cap in (1, 3):
        assert most_gradients_waiting(UpdatesInFlight(cap), 12) == cap
    assert most_gradients_waiting(UpdatesInFlight(100), 12) == 12
    with pytest.raises(ValueError, match="cap"):
        UpdatesInFlight(0)


def test_the_memory_model_counts_the_engines_q_gradients():
    """`early_update_grads` is the most gradients the engine's cap lets wait,
    each as large as the largest trainable shard, in the bytes given."""
    from labml_zero.optimizers.early_update import EarlyUpdates
    from labml_zero.zero3.chunk_layout import ParamSpec, plan_chunks
    from labml_zero.planner.grad_buffers import early_update_grads

    engine = EarlyUpdates(lambda homes, early: None, free_grads=True).in_flight
    waiting = most_gradients_waiting(engine, 12)
    # a frozen chunk larger than every trainable one: not counted
    params = [ParamSpec("frozen", (64,), False, 0), ParamSpec("w", (6, 4), True, 1),
              ParamSpec("b", (4,), True, 2)]
    layout = plan_chunks(params, 32, 2)
    largest = max(layout.shard_numel(c) for c in layout.chunks if c.trainable)
    assert largest < max(layout.shard_numel(c) for c in layout.chunks)
    for grad_bytes in (2, 4):
        assert early_update_grads(layout, grad_bytes) == waiting * grad_bytes * largest
    frozen = plan_chunks([ParamSpec("f", (8,), False, 0)], 8, 1)
    assert early_update_grads(frozen, 4) == 0


def test_on_the_cpu_every_freed_update_passes_the_cap(monkeypatch):
    """The CPU twin of the side stream: each device update that frees its
    gradient goes through the cap, as passed already, so none is ever waited
    for and none is left after the step."""
    from labml_zero.optimizers.early_update import PASSED, UpdatesInFlight
    from tests.optimizers.test_free_grads import sharded, train

    issued = []
    real = UpdatesInFlight.issued
    monkeypatch.setattr(UpdatesInFlight, "issued",
                        lambda self, event: (issued.append(event), real(self, event)))
    model, optimizer = sharded(torch.float32, offload=False, free=True)
    train(model, optimizer, range(2))
    assert len(issued) == 2 * len(optimizer.homes.of)
    assert all(event is PASSED for event in issued)
    assert not optimizer.early_updates.in_flight.events
