"""The step's metrics reach the labml app: the fine-tune of `tests/test_app.py`
tracked into a live app, and every metric of [what a step
shows](labml_zero/finetune/step_metrics.py) read back through the app's API."""

import pytest

from tests.test_app import app, runs, series  # noqa: F401  (pytest fixtures)


def test_the_step_metrics_are_in_the_app(app, runs):  # noqa: F811
    sent = series(app, runs.finetune_uuid)
    for name in ("lr", "grad_norm", "tokens_per_s", "memory.peak"):
        logged = runs.finetune_log[name]
        assert sorted(sent[name]) == sorted(logged) == list(range(1, 13)), name
        assert all(v > 0 for v in sent[name].values()), name
    # the same on every rank (the schedule; the all-reduced norm): the app's
    # mean over the ranks is rank 0's value, stored as float32 (2^-24 relative)
    for name in ("lr", "grad_norm"):
        for step, value in runs.finetune_log[name].items():
            assert sent[name][step] == pytest.approx(value, rel=2**-23), (name, step)
