"""`neox/lr_schedule.py`: warm-up, then constant, linear or cosine decay."""

import math

import pytest

from labml_zero.finetune.lr_schedule import LRSchedule


def test_warmup_then_decay_to_the_floor():
    cosine = LRSchedule(lr=1.0, total_steps=12, kind="cosine", warmup_steps=2,
                        min_lr=0.1)
    # the peak after the warm-up, the floor only after the last step
    assert [cosine.rate(s) for s in (1, 2, 3)] == [0.5, 1.0, 1.0]
    assert cosine.rate(8) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway
    assert cosine.rate(12) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 10)))
    linear = LRSchedule(lr=1.0, total_steps=12, kind="linear", warmup_steps=2)
    assert linear.rate(8) == pytest.approx(0.5)
    # no step trains at rate 0: the last at 1 / (T - W) of the peak
    assert linear.rate(12) == pytest.approx(0.1)
    assert LRSchedule(lr=3e-3, total_steps=2, kind="linear",
                      warmup_steps=1).rate(2) == 3e-3
    constant = LRSchedule(lr=3e-3, total_steps=5)
    assert {constant.rate(s) for s in range(1, 6)} == {3e-3}
    rates = [cosine.rate(s) for s in range(2, 13)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_the_rate_depends_on_the_step_alone():
    # two equal schedules (as rebuilt after a resume) give the same bits
    a = LRSchedule(lr=3e-4, total_steps=1000, kind="cosine", warmup_steps=30,
                   min_lr=3e-5)
    b = LRSchedule(lr=3e-4, total_steps=1000, kind="cosine", warmup_steps=30,
                   min_lr=3e-5)
    for step in (1, 30, 31, 500, 999, 1000):
        assert a.rate(step).hex() == b.rate(step).hex()
    assert math.isfinite(a.rate(1000))


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="warmup_steps 5 must be below"):
        LRSchedule(lr=1.0, total_steps=5, warmup_steps=5)
    with pytest.raises(ValueError, match="min_lr 2 must be in"):
        LRSchedule(lr=1.0, total_steps=5, min_lr=2.0)
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        LRSchedule(lr=1.0, total_steps=5, kind="step")
