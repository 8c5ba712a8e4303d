"""The fine-tune on the user's data, with a schedule, resumed: `--data` as JSON
Lines, warm-up and cosine decay, the step's metrics, a resume that continues the
same curve bit for bit, flags that override saved settings, a resume on other
data of as many samples refused, and an elastic resume 2 → 3 → 1 ranks against
an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from labml_zero.finetune.cli import main, make_parser, parse_config
from labml_zero.finetune.dataset import load_text
from labml_zero.finetune.lr_schedule import LRSchedule
from tests.test_finetune import SMALL, check_ok, finetune, run_dirs, tracked

SCHEDULE = ["--lr-schedule", "cosine", "--warmup-steps", "2", "--min-lr", "3e-4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Tiny Shakespeare's first 200 kB as JSON Lines, a paragraph a record."""
    path = tmp_path_factory.mktemp("corpus") / "plays.jsonl"
    paragraphs = load_text()[:200_000].split("\n\n")
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return path


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory, corpus) -> Path:
    tmp = tmp_path_factory.mktemp("scheduled")
    result = finetune(tmp, "--data", str(corpus), *SCHEDULE, "--steps", "6",
                      "--checkpoint-every", "3", "--sample-tokens", "0")
    check_ok(result)
    assert "tokenized" in result.stdout  # built once, by the launcher
    return tmp


def test_schedule_and_metrics_are_tracked(scheduled: Path):
    log = tracked(run_dirs(scheduled)[0])
    curve = LRSchedule(lr=3e-3, total_steps=6, kind="cosine", warmup_steps=2,
                       min_lr=3e-4)
    assert log["lr"] == {s: curve.rate(s) for s in range(1, 7)}
    for name in ("grad_norm", "tokens_per_s", "memory.peak"):
        assert sorted(log[name]) == [1, 2, 3, 4, 5, 6], name
        assert all(v > 0 for v in log[name].values()), name
    assert "mfu" not in log and "loss_scale" not in log  # CPU, fp32


def test_resume_continues_the_curve_and_flags_override(scheduled: Path,
                                                       tmp_path: Path, corpus):
    checkpoint = scheduled / "out" / "checkpoints" / "step-000003"
    full = tracked(run_dirs(scheduled)[0])
    # no flags: the saved schedule, steps and data order; the same bits
    result = finetune(tmp_path / "same", "--data", str(corpus), "--resume",
                      str(checkpoint), "--sample-tokens", "0")
    check_ok(result)
    assert "flags override" not in result.stdout
    same = tracked(run_dirs(tmp_path / "same")[0])
    for name in ("loss.train", "lr", "grad_norm"):
        assert {s: same[name][s] for s in (4, 5, 6)} == {
            s: full[name][s] for s in (4, 5, 6)}, name

    # a flag overrides its setting, says so in one line, and trains with it
    result = finetune(tmp_path / "lr", "--data", str(corpus), "--resume",
                      str(checkpoint), "--lr", "1.0", "--weight-decay", "0.1",
                      "--sample-tokens", "0")
    check_ok(result)
    lines = [x for x in result.stdout.splitlines() if "flags override" in x]
    assert lines == ["--resume: flags override saved settings: lr 0.003 → 1, "
                     "weight_decay 0 → 0.1"], lines
    changed = tracked(run_dirs(tmp_path / "lr")[0])
    curve = LRSchedule(lr=1.0, total_steps=6, kind="cosine", warmup_steps=2,
                       min_lr=3e-4)
    assert changed["lr"] == {s: curve.rate(s) for s in (4, 5, 6)}
    assert changed["loss.train"][5] != full["loss.train"][5]


def test_a_resume_on_other_data_of_as_many_samples_is_refused(
        scheduled: Path, corpus: Path, tmp_path: Path, capsys):
    """The same paragraphs in the reverse order hold as many samples, other
    ones: the checkpoint's recorded split tells them apart, before start. The
    same file elsewhere is the same split; a checkpoint saved before the split
    was recorded keeps the count of samples as its only check."""
    from labml_zero.finetune.preflight import preflight

    checkpoint = scheduled / "out" / "checkpoints" / "step-000003"
    records = corpus.read_text().splitlines(keepends=True)
    reversed_ = tmp_path / "reversed.jsonl"
    reversed_.write_text("".join(reversed(records)))
    moved = tmp_path / "moved" / corpus.name
    moved.parent.mkdir()
    shutil.copy(corpus, moved)
    flags = [*SMALL, "--out", str(tmp_path / "out"), "--log-dir",
             str(tmp_path / "logs"), *SCHEDULE, "--steps", "6"]

    def resumed_step(path: Path, data: Path) -> int:
        config, world_size = parse_config(
            [*flags, "--resume", str(path), "--data", str(data)], make_parser())
        return preflight(config, world_size=world_size,
                         device=torch.device("cpu")).resumed_step

    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--resume", str(checkpoint), "--data", str(reversed_)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--resume {checkpoint} trained on another training split than " \
        f"--data {reversed_} gives" in err, err
    assert resumed_step(checkpoint, moved) == 3

    older = tmp_path / "older"
    shutil.copytree(checkpoint, older)
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["meta"]["training_data"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    assert resumed_step(older, reversed_) == 3


def test_elastic_resume_two_three_one_ranks(tmp_path: Path, capsys):
    # G = 6 sequences a step: 2 ranks × 3, then 3 ranks × 1 × 2 micro-batches,
    # then 1 rank × 3 × 2 (one rank accumulating in its chunks' buffers); the
    # same samples each step, so the same losses up to the order of fp32 sums
    def run(name, world, batch, accum, *args, stop_after=None):
        # a run stopped after a step (by a test-only failure) keeps the whole
        # run's schedule, which `--steps` would change
        env = {} if stop_after is None else {
            "LABML_ZERO_FAIL_AT_STEP": f"0:{stop_after}"}
        result = finetune(tmp_path / name, "--world-size", str(world),
                          "--batch-size", str(batch), "--grad-accum", str(accum),
                          *SCHEDULE, "--steps", "6", "--checkpoint-every", "2",
                          "--sample-tokens", "0", *args, env=env)
        assert result.returncode == (0 if stop_after is None else 1), \
            result.stderr[-3000:]
        return tracked(run_dirs(tmp_path / name)[0])

    def saved(name, step):
        return str(tmp_path / name / "out" / "checkpoints" / f"step-{step:06d}")

    full = run("full", 2, 3, 1)
    three = run("three", 3, 1, 2, "--resume", saved("full", 2), stop_after=4)
    one = run("one", 1, 3, 2, "--resume", saved("three", 4))
    elastic = {**three["loss.train"], **one["loss.train"]}
    assert sorted(elastic) == [3, 4, 5, 6]
    # each step's sums are reordered once (ε each); Adam's normalised updates
    # carry a difference on, so it may grow by about one ε per step and term
    eps = torch.finfo(torch.float32).eps
    for step, loss in elastic.items():
        assert loss == pytest.approx(full["loss.train"][step],
                                     rel=64 * step * eps), step
    # the rate is a pure function of the step: the same bits at every layout
    assert {**three["lr"], **one["lr"]} == {s: full["lr"][s] for s in range(3, 7)}
    assert one["loss.valid"][6] == pytest.approx(full["loss.valid"][6],
                                                 rel=64 * 6 * eps)

    # a global batch that 4 ranks cannot keep: refused, one line, exit 2
    with pytest.raises(SystemExit) as exit_info:
        main(["--world-size", "4", "--batch-size", "3", "--seq-len", "32",
              "--resume", saved("full", 2), "--out", str(tmp_path / "x"),
              "--log-dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "saved with a global batch of 6 sequences" in err
    assert "6 sequences cannot be split over 4 ranks" in err


def test_grad_norm_is_the_same_where_the_updates_free_the_gradients(
        tmp_path: Path):
    # Without clipping each update frees its gradient during the backward
    # pass and sums its squares (`ConsumedGradSquares`); with a bound no
    # gradient reaches (the coefficient is exactly 1), nothing is freed and
    # the norm is read from the shards after `backward()`. Same weights, same
    # updates, so the same norm at every step, half the state on the host
    # (its squares are summed on the host worker). Each norm is a sum of fp32
    # squares over 2 ranks, then one fp32 sqrt and square: a few fp32 roundings.
    runs = {}
    for name, flags in (("freed", []), ("kept", ["--clip-grad", "1e30"])):
        result = finetune(tmp_path / name, "--steps", "3", "--sample-tokens", "0",
                          "--offload-optimizer", "0.5", *flags)
        check_ok(result)
        runs[name] = tracked(run_dirs(tmp_path / name)[0])
    freed, kept = runs["freed"]["grad_norm"], runs["kept"]["grad_norm"]
    assert sorted(freed) == sorted(kept) == [1, 2, 3]
    for step in freed:
        assert freed[step] == pytest.approx(kept[step], rel=8 * 2.0 ** -24), step
    assert runs["freed"]["loss.train"] == runs["kept"]["loss.train"]
