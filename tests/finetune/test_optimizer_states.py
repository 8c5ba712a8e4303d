"""`--optimizer-states` in the job: each state layout trains, is refused in
one line where it cannot apply, is kept by a `--resume` that does not name it,
and converts once, saying so, when a resume names another."""

from __future__ import annotations

import math

import pytest

from labml_zero.finetune.config import FinetuneConfig
from tests.test_finetune import check_ok, finetune, run_dirs, tracked

RUN = ["--steps", "4", "--checkpoint-every", "2", "--sample-tokens", "0"]


@pytest.mark.parametrize("states", ["bf16-stochastic", "bf16-kahan"])
def test_a_layout_that_cannot_apply_is_refused_in_one_line(states):
    # offload applies (the host keeps a copy of the weight); fp16 does not
    FinetuneConfig(optimizer_states=states, offload_optimizer=0.5)
    with pytest.raises(ValueError, match=f"^--optimizer-states {states} rounds "
                                         "into bf16 or fp32 parameters, not "
                                         "--dtype fp16$"):
        FinetuneConfig(optimizer_states=states, dtype="fp16")
    with pytest.raises(ValueError, match="unknown optimizer_states 'int8'; "
                                         "expected one of fp32, bf16-moments"):
        FinetuneConfig(optimizer_states="int8")


def losses(tmp) -> dict[int, float]:
    return tracked(run_dirs(tmp)[0])["loss.train"]


def test_each_layout_trains_and_a_resume_keeps_or_converts_it(tmp_path):
    moments = tmp_path / "moments"
    check_ok(finetune(moments, *RUN, "--optimizer-states", "bf16-moments"))
    trained = losses(moments)
    assert sorted(trained) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in trained.values())
    assert trained[4] < trained[1]
    saved = moments / "out" / "checkpoints" / "step-000002"

    # no flag: the saved layout, nothing converted, the same losses
    kept = finetune(tmp_path / "kept", *RUN, "--resume", str(saved))
    check_ok(kept)
    assert "converted" not in kept.stderr
    again = losses(tmp_path / "kept")
    assert {s: again[s] for s in (3, 4)} == {s: trained[s] for s in (3, 4)}

    # another layout named: converted once, in one line, and it trains on
    changed = finetune(tmp_path / "changed", *RUN, "--resume", str(saved),
                       "--optimizer-states", "fp32")
    check_ok(changed)
    lines = [line for line in changed.stderr.splitlines() if "converted" in line]
    assert len(lines) == 1 and "'bf16-moments'" in lines[0] and "'fp32'" in lines[0]
    assert "optimizer_states bf16-moments → fp32" in changed.stdout + changed.stderr

    stochastic = tmp_path / "stochastic"
    check_ok(finetune(stochastic, *RUN, "--optimizer-states", "bf16-stochastic"))
    assert losses(stochastic)[4] < losses(stochastic)[1]


def test_bf16_kahan_trains_and_a_resume_keeps_it_bit_exact(tmp_path):
    """bf16 chunks, so the compensation is used; it is saved with the
    moments: a resume that names no layout keeps it, and steps 3 and 4
    repeat the same losses exactly."""
    kahan = tmp_path / "kahan"
    check_ok(finetune(kahan, *RUN, "--dtype", "bf16",
                      "--optimizer-states", "bf16-kahan"))
    trained = losses(kahan)
    assert sorted(trained) == [1, 2, 3, 4]
    assert trained[4] < trained[1]
    saved = kahan / "out" / "checkpoints" / "step-000002"
    kept = finetune(tmp_path / "kept", *RUN, "--dtype", "bf16", "--resume",
                    str(saved))
    check_ok(kept)
    assert "converted" not in kept.stderr
    again = losses(tmp_path / "kept")
    assert {s: again[s] for s in (3, 4)} == {s: trained[s] for s in (3, 4)}
    # half the states on the host, which updates its copy of the weight: the
    # same losses, and a resume of that run with the offload keeps them
    offload = ("--optimizer-states", "bf16-kahan", "--offload-optimizer", "0.5")
    hosted = tmp_path / "hosted"
    check_ok(finetune(hosted, *RUN, "--dtype", "bf16", *offload))
    assert losses(hosted) == trained
    resumed = tmp_path / "resumed"
    check_ok(finetune(resumed, *RUN, "--dtype", "bf16", *offload, "--resume",
                      str(hosted / "out" / "checkpoints" / "step-000002")))
    again = losses(resumed)
    assert {s: again[s] for s in (3, 4)} == {s: trained[s] for s in (3, 4)}


def test_8bit_moments_train_and_a_resume_keeps_them(tmp_path):
    coded = tmp_path / "coded"
    check_ok(finetune(coded, *RUN, "--optimizer-states", "8bit-moments"))
    trained = losses(coded)
    assert sorted(trained) == [1, 2, 3, 4]
    assert trained[4] < trained[1]
    saved = coded / "out" / "checkpoints" / "step-000002"
    kept = finetune(tmp_path / "kept", *RUN, "--resume", str(saved))
    check_ok(kept)
    assert "converted" not in kept.stderr
    again = losses(tmp_path / "kept")
    assert {s: again[s] for s in (3, 4)} == {s: trained[s] for s in (3, 4)}
