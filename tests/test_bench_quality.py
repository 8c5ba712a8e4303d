"""`bench/quality.py` and `docsite/quality_curves.py`: one command trains the
tiny model once per optimizer-state choice and writes each run's curves and its
difference to the fp32 states; the results page draws them, and says plainly
when no quality run is recorded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import quality
from docsite.quality_curves import load_quality, quality_markdown
from labml_zero.zero3.state_layout import LAYOUTS

STEPS, VALID_EVERY = 3, 2
JOB = ["--world-size", "1", "--batch-size", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("root")
    out = root / "bench" / "results" / "2026-01-01-quality-tiny-1xCPU.jsonl"
    returned = quality.main(["--model", "tiny", "--steps", str(STEPS),
                             "--valid-every", str(VALID_EVERY), "--out", str(out),
                             "--", *JOB])
    return root, returned


def test_every_choice_is_recorded_against_fp32(written):
    root, returned = written
    lines = [json.loads(t) for t in
             (root / "bench/results/2026-01-01-quality-tiny-1xCPU.jsonl")
             .read_text().splitlines()]
    assert lines == returned
    assert [l["optimizer_states"] for l in lines] == list(LAYOUTS)
    for line in lines:
        assert [s for s, _ in line["train_loss"]] == list(range(1, STEPS + 1))
        # at step 0, every valid_every steps, and at the last
        assert [s for s, _ in line["valid_loss"]] == [0, 2, 3]
        assert line["final_valid_loss"] == line["valid_loss"][-1][1]
        assert all(math.isfinite(v) for _, v in line["train_loss"] + line["valid_loss"])
    base = lines[0]["final_valid_loss"]
    assert lines[0]["valid_loss_rel_diff"] == 0.0
    for line in lines[1:]:
        assert line["valid_loss_rel_diff"] == pytest.approx(
            (line["final_valid_loss"] - base) / base, rel=1e-12)
    # the same start: every choice's first validation loss is the same number
    assert len({l["valid_loss"][0][1] for l in lines}) == 1


def test_the_results_page_draws_the_runs(written):
    root, lines = written
    assert [model for model, _, _ in load_quality(root)] == ["tiny"]
    page = quality_markdown(root)
    assert page.count("<polyline") == len(LAYOUTS)
    for line in lines:
        assert (f"| {line['optimizer_states']} | {line['final_valid_loss']:.4f} | "
                f"{line['valid_loss_rel_diff']:+.2%} |") in page
    assert "No quality run" not in page


def test_no_quality_run_is_said_plainly(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "2026-01-01-run1-W4.jsonl").write_text(
        '{"workload": "W4", "engine": "fsdp2", "status": "ok"}\n')
    page = quality_markdown(tmp_path)
    assert "No quality run is recorded" in page
    assert "<svg" not in page and "|" not in page


@pytest.mark.parametrize("argv, message", [
    (["--choices", "int4"], "--choices: unknown int4"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--valid-every", "0"], "--valid-every must be at least 1"),
    (["--model", "pythia-160m", "--choices", "fp8"],
     "--choices fp8: no linear of pythia-160m runs in fp8"),
    (["--model", "pythia-410m", "--choices", "fp8", "--", "--kernels", "none"],
     "--kernels among the job's flags: the fp8 choice sets it"),
])
def test_bad_flags_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        quality.parse_args(argv)
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err


def test_the_baseline_always_runs_first():
    assert quality.parse_args(["--choices", "8bit-moments"]).choices == \
        ["fp32", "8bit-moments"]


def test_a_checkpoint_gives_the_model(tmp_path):
    args = quality.parse_args(["--model", "pythia-160m", "--", "--checkpoint", "ckpt"])
    command = quality.job_command(args, "fp32", tmp_path)
    assert "--model" not in command and command[-2:] == ["--checkpoint", "ckpt"]
    plain = quality.job_command(quality.parse_args(["--model", "tiny"]), "fp32", tmp_path)
    assert plain[plain.index("--model") + 1] == "tiny"


def test_fp8_differs_from_the_baseline_only_in_its_products(tmp_path):
    """The fp8 run keeps fp32 states and adds `--kernels auto,fp8` after the
    shared flags; on a model whose MLP is large enough (Pythia-410M's), the
    choice is taken, and its file is named by it."""
    args = quality.parse_args(["--model", "pythia-410m", "--choices", "fp8"])
    assert args.choices == ["fp32", "fp8"]
    base, fp8 = (quality.job_command(args, c, tmp_path) for c in args.choices)
    assert fp8[fp8.index("--optimizer-states") + 1] == "fp32"
    assert [a for a in fp8 if a not in base] == ["--kernels", "auto,fp8"]
    day = quality.datetime.date(2026, 1, 1)
    assert quality.default_out("pythia-410m", "NVIDIA H200", day, args.choices).name \
        == "2026-01-01-quality-pythia-410m-fp8-1xH200.jsonl"
    assert quality.default_out("pythia-410m", "NVIDIA H200", day).name \
        == "2026-01-01-quality-pythia-410m-1xH200.jsonl"


def test_the_page_names_each_lines_choice(written):
    """An fp8 line, its states fp32, is drawn and tabled as `fp8`; a line
    written before products were a choice is named by its states."""
    root, lines = written
    fp8 = dict(lines[0], choice="fp8", products="fp8", valid_loss_rel_diff=0.25)
    old = {k: v for k, v in lines[0].items() if k != "choice"}
    later = root / "bench" / "results" / "2099-01-01-quality-tiny-fp8-1xcpu.jsonl"
    later.write_text("".join(json.dumps(l) + "\n" for l in (old, fp8)))
    try:
        assert ("tiny", "CPU", ("fp32", "fp8")) in load_quality(root)
        page = quality_markdown(root)
        assert f"| fp8 | {fp8['final_valid_loss']:.4f} | +25.00% | missed |" in page
        assert "--choices fp32,fp8" in page
    finally:
        later.unlink()  # the fixture's folder is shared by this file's tests


def test_a_run_of_other_choices_stands_beside_the_earlier_one(written):
    """A later file of the same model with another set of choices (or another
    device) is drawn beside the first; the same set on the same device
    replaces it."""
    root, lines = written
    folder = root / "bench" / "results"
    two = [dict(lines[0]), dict(lines[-1])]
    later = folder / "2099-01-01-quality-tiny-1xcpu.jsonl"
    later.write_text("".join(json.dumps(l) + "\n" for l in two))
    assert len(load_quality(root)) == 2
    later.write_text("".join(json.dumps(l) + "\n" for l in lines))
    assert len(load_quality(root)) == 1
    assert next(iter(load_quality(root).values()))[0] == later.name
    later.unlink()  # the fixture's folder is shared by this file's tests
