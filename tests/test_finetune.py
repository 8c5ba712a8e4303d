"""The fine-tune job end to end: `python -m labml_zero.finetune_neox` at world size 2
on CPU (gloo), as a user runs it.

One reference run (6 steps, a checkpoint every 3) serves several tests: the loss
goes down and labml wrote its run files; gradient accumulation over two half
batches gives the same losses; a run whose rank 1 raises after step 5 ends the
whole job quickly with a clear error, and resuming it from its step-3 checkpoint
reproduces the reference losses of steps 4 to 6 exactly. Bad flags are checked in
process (they never start a process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labml_zero.finetune.cli import make_parser, main, parse_config
from labml_zero.finetune.planning import FLAG_DESTS
from labml_zero.finetune.job import (FinetuneConfig, NonFiniteLoss, Totals,
                                     check_loss, laptop, neox_20b_biases)
from labml_zero.neox.family import NEOX
from labml_zero.neox.model import tiny as neox_tiny
from labml_zero.neox.tokenizer import load_tokenizer
from tests import tolerance
from tests.distributed import skip_job_without_gpus
from tests.tolerance import neox_terms

REPO = Path(__file__).resolve().parent.parent

# Small enough for seconds per run: 2 ranks × 2 sequences of 32 tokens.
SMALL = ["--world-size", "2", "--batch-size", "2", "--seq-len", "32",
         "--valid-every", "3", "--sample-tokens", "4"]
# Two fp32 runs of the tiny model's first 3 steps that batch and sum in other
# orders (tests/tolerance.py): the loss of step 3 comes after 2 updates; at
# most 4 ranks of 2 sequences of 32 tokens.
FINETUNE_LOSS_TOLERANCE = tolerance.loss_after(torch.float32, terms=neox_terms(
    neox_tiny(), seq=32, tokens=4 * 2 * 32, backward=True, vocab=False), steps=2)


def closed_port_url() -> str:
    """An http URL on a port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/api/v1/"


def finetune(tmp: Path, *args: str, env: dict | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the job in `tmp` with its outputs and labml logs there."""
    flags = [*SMALL, *args]
    # the last --world-size wins, as in argparse
    sizes = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--world-size"]
    skip_job_without_gpus(int(sizes[-1]))
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "labml_zero.finetune_neox", *SMALL,
         "--out", str(tmp / "out"), "--log-dir", str(tmp / "logs"), *args],
        cwd=tmp, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_dirs(tmp: Path, experiment: str = NEOX.experiment) -> dict[int, Path]:
    """labml's per-rank run directories, `<uuid>.<rank>`, by rank, under the
    family's experiment (GPT-NeoX's unless told)."""
    dirs = list((tmp / "logs" / experiment).iterdir())
    assert len({d.name.split(".")[0] for d in dirs}) == 1, dirs  # one uuid
    return {int(d.name.split(".")[1]): d for d in dirs}


def tracked(run_dir: Path) -> dict[str, dict[int, float]]:
    """`{indicator: {step: value}}` from labml's `log.jsonl`."""
    out: dict[str, dict[int, float]] = {}
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        for name, points in json.loads(line).get("track", {}).items():
            for step, values in points:
                out.setdefault(name, {})[step] = values[-1]
    return out


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("reference")
    result = finetune(tmp, "--steps", "6", "--checkpoint-every", "3",
                      "--app-url", closed_port_url())
    check_ok(result)
    (tmp / "stdout.txt").write_text(result.stdout)
    return tmp


def test_end_to_end(reference: Path):
    stdout = (reference / "stdout.txt").read_text()
    dirs = run_dirs(reference)
    assert sorted(dirs) == [0, 1]
    for rank, d in dirs.items():
        for name in ("run.yaml", "log.jsonl", "run_log.jsonl"):
            assert (d / name).is_file(), (rank, name)
    configs = (dirs[0] / "configs.yaml").read_text()
    assert "AdamFP16" in configs and "zero3_chunks" in configs

    logs = [tracked(dirs[rank]) for rank in (0, 1)]
    # The tracked numbers are means over both ranks: the logs agree.
    assert logs[0]["loss.train"] == logs[1]["loss.train"]
    train, valid = logs[0]["loss.train"], logs[0]["loss.valid"]
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    assert sorted(valid) == [0, 3, 6]
    assert valid[6] < valid[3] < valid[0]
    assert train[6] < train[1]

    # The dead app URL was probed, reported in one line, and skipped.
    assert "no labml app answered" in stdout
    assert "randomly initialised" in stdout
    # no labml warning box (the package holds labml's .labml.yaml); the
    # validation loss gets its own line where measured, and no screen line
    # repeats it
    assert "LABML WARNING" not in stdout
    assert "step 3: loss.valid" in stdout
    assert "Sample after 6 steps:" in stdout
    assert sorted(p.name for p in (reference / "out" / "checkpoints").iterdir()) \
        == ["step-000003", "step-000006"]


def test_grad_accum_matches_full_batch(reference: Path, tmp_path: Path):
    # 2 micro-batches of 1 per rank take the same 4 samples per step as 1 batch
    # of 2 (the sampler's global order is the same), so the mean gradient is the
    # same up to the order of the sums.
    check_ok(finetune(tmp_path, "--steps", "3", "--batch-size", "1",
                      "--grad-accum", "2", "--sample-tokens", "0"))
    accum = tracked(run_dirs(tmp_path)[0])["loss.train"]
    full = tracked(run_dirs(reference)[0])["loss.train"]
    for step in (1, 2, 3):
        assert accum[step] == pytest.approx(full[step], **FINETUNE_LOSS_TOLERANCE)


@pytest.mark.parametrize("offload", [
    ["--offload-optimizer", "0.5"],
    ["--offload-optimizer", "1", "--offload-params", "0.5"],
])
def test_offloaded_optimizer_and_recompute_match(reference: Path, tmp_path: Path,
                                                 offload: list[str]):
    # Half the optimizer states (or all, and half the parameter shards) in host
    # memory, updated during the backward pass, and activations recomputed in
    # the backward: the same update rule and arithmetic, so the same losses.
    check_ok(finetune(tmp_path, "--steps", "3", *offload,
                      "--activation-checkpointing", "--sample-tokens", "0"))
    ours = tracked(run_dirs(tmp_path)[0])["loss.train"]
    full = tracked(run_dirs(reference)[0])["loss.train"]
    for step in (1, 2, 3):
        assert ours[step] == pytest.approx(full[step], **FINETUNE_LOSS_TOLERANCE)


def test_peer_memory_trains_identically(reference: Path, tmp_path: Path):
    # shards gathered and gradients reduced through shared memory: copies, and
    # on two ranks the same fp32 sums, so the losses are the same bits
    check_ok(finetune(tmp_path, "--steps", "3", "--peer-memory",
                      "--sample-tokens", "0"))
    ours = tracked(run_dirs(tmp_path)[0])["loss.train"]
    full = tracked(run_dirs(reference)[0])["loss.train"]
    for step in (1, 2, 3):
        assert ours[step] == full[step]


def test_compiled_layers_match(reference: Path, tmp_path: Path):
    # aot_eager on CPU: the same aten ops as eager, summed maybe in another order
    check_ok(finetune(tmp_path, "--steps", "3", "--compile", "--sample-tokens", "0"))
    ours = tracked(run_dirs(tmp_path)[0])["loss.train"]
    full = tracked(run_dirs(reference)[0])["loss.train"]
    for step in (1, 2, 3):
        assert ours[step] == pytest.approx(full[step], **FINETUNE_LOSS_TOLERANCE)


def test_failing_rank_ends_job_and_resume_reproduces(reference: Path,
                                                     tmp_path: Path):
    start = time.monotonic()
    failed = finetune(tmp_path / "killed", "--steps", "6", "--checkpoint-every",
                      "3", env={"LABML_ZERO_FAIL_AT_STEP": "1:5"})
    assert failed.returncode == 1
    assert time.monotonic() - start < 90
    last = failed.stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "injected failure" in last, last
    assert "Traceback" in failed.stderr
    checkpoints = tmp_path / "killed" / "out" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000003"]

    result = finetune(tmp_path / "resumed", "--steps", "6", "--resume",
                      str(checkpoints / "step-000003"), "--sample-tokens", "0")
    check_ok(result)
    assert (f"weights from checkpoint {checkpoints / 'step-000003'} (after step 3)"
            in result.stdout)
    resumed = tracked(run_dirs(tmp_path / "resumed")[0])
    full = tracked(run_dirs(reference)[0])
    assert sorted(resumed["loss.train"]) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed["loss.train"][step] == full["loss.train"][step]
    assert resumed["loss.valid"][6] == full["loss.valid"][6]


def test_hugging_face_weights_are_loaded(tmp_path: Path):
    # A random tiny GPT-NeoX written as a Hugging Face checkpoint; the job's first
    # validation loss must be that of these weights, computed here unsharded on
    # the same 4 global batches (samples 0..15: batch 2 × 2 ranks × 4).
    import torch
    import torch.nn.functional as F

    from labml_zero.neox import model as neox_model
    from labml_zero.neox.hf_checkpoint import hf_named_tensors, save_hf_checkpoint
    from labml_zero.finetune.dataset import load_datasets

    config = neox_model.tiny()
    torch.manual_seed(7)
    layers = neox_model.build_layers(config)
    with torch.no_grad():
        # Far from a fresh random init's loss (ln 50432 ≈ 10.8), so a run that
        # ignored the checkpoint could not match it by chance.
        layers[-1].embed_out.weight.mul_(30.0)
    save_hf_checkpoint(tmp_path / "hf", config, hf_named_tensors(layers))
    valid = load_datasets(seq_len=32, tokenizer=load_tokenizer()).valid.batch(
        list(range(16)))
    with torch.no_grad():
        logits = torch.nn.Sequential(*layers)(valid.inputs)
        expected = F.cross_entropy(logits.flatten(0, 1), valid.targets.flatten())

    result = finetune(tmp_path / "run", "--checkpoint", str(tmp_path / "hf"),
                      "--finetune", "biases", "--steps", "1", "--sample-tokens", "0")
    check_ok(result)
    assert f"weights from {tmp_path / 'hf'}" in result.stdout
    loss0 = tracked(run_dirs(tmp_path / "run")[0])["loss.valid"][0]
    assert expected.item() > 20
    assert loss0 == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--finetune", "everything"], "--finetune"),
    (["--steps", "0"], "--steps"),
    (["--steps", "3", "--epochs", "1"], "not allowed with"),
    (["--dtype", "fp8"], "--dtype"),
    (["--model", "gpt-5"], "--model"),
    (["--filter-layers", "0,7"], "filter_layers [7] out of range"),
    (["--filter-layers", "a"], "--filter-layers"),
    (["--lr", "-1"], "lr must be > 0"),
    (["--offload-optimizer", "1.5"], "offload_optimizer must be in [0, 1]"),
    (["--offload-params", "0.5"], "offload_params needs offload_optimizer=1"),
    (["--offload-optimizer", "auto"], "--offload-optimizer auto needs GPUs"),
    (["--seq-len", "4096"], "exceeds the model's max_position"),
    (["--checkpoint", "/nonexistent/pythia"], "not found: /nonexistent/pythia"),
    (["--resume", "/nonexistent/step-1"], "not found: /nonexistent/step-1"),
    (["--checkpoint", ".", "--model", "tiny"], "not both"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--app-url", "localhost:5005"], "--app-url: app_url must start with http://"),
])
def test_bad_flags_exit_2_with_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        FinetuneConfig(grad_accum=0)
    with pytest.raises(ValueError, match="unknown fine-tuner 'x'"):
        FinetuneConfig(finetune="x")
    with pytest.raises(ValueError, match="clip_grad must be > 0"):
        FinetuneConfig(clip_grad=0.0)


def test_a_loss_that_stays_nan_stops_the_job_and_keeps_good_checkpoints(
        tmp_path: Path):
    # Every rank's loss is NaN from step 5: the job stops there with exit 1,
    # the checkpoints of steps 3 and 4 (the newest two) stay, and no sample.
    result = finetune(tmp_path, "--steps", "6", "--checkpoint-every", "1",
                      "--keep-checkpoints", "2",
                      env={"LABML_ZERO_NAN_AT_STEP": "5"})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "NonFiniteLoss" in last and "loss became non-finite at step 5" in last
    assert "lower the learning rate" in last, last
    assert "the last good checkpoint is" in last and "step-000004" in last
    checkpoints = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step-000003", "step-000004"]
    assert "Sample after" not in result.stdout


@pytest.mark.parametrize("checkpoint, args, message", [
    ("step-000006", ["--steps", "6"], "already at step 6: --steps 6 leaves nothing"),
    ("step-000003", ["--batch-size", "4"], "saved with a global batch of 4 "
     "sequences, this run's is --batch-size 4 × --grad-accum 1 × 2 ranks = 8"),
    ("step-000003", ["--seed", "1"], "saved with seed=0, this job has 1"),
    ("step-000003", ["--world-size", "1"], "(at 1 rank use --grad-accum 2)"),
    ("step-000003", ["--seq-len", "16"], "training split of 9569 samples, this "
     "run's has 19138"),
    ("step-000003", ["--steps", "6"], None),
    ("step-000003", ["--model", "pythia-70m"], "is of a different model"),
    ("step-000003", ["--finetune", "biases"], "was trained with --finetune all, "
     "this run gives --finetune biases: '0.embed_in.weight' is trained there and "
     "frozen here (leave the flag out to resume it"),
])
def test_resume_is_checked_before_any_rank_starts(reference: Path, tmp_path: Path,
                                                  capsys, checkpoint, args,
                                                  message):
    # The reference's checkpoints, resumed with something that cannot continue
    # them: one line, exit 2, and no process started.
    path = reference / "out" / "checkpoints" / checkpoint
    flags = [*SMALL, "--out", str(tmp_path / "out"), "--log-dir",
             str(tmp_path / "logs"), "--resume", str(path)]
    if message is None:
        # the same job: the meta model's names and shapes are the checkpoint's
        from labml_zero.finetune.preflight import preflight
        import torch

        config, world_size = parse_config([*flags, *args], make_parser())
        assert preflight(config, world_size=world_size,
                         device=torch.device("cpu")).resumed_step == 3
        return
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_resume_keeps_the_fine_tuner_it_was_trained_with(tmp_path: Path):
    """`--finetune` left out of a resume is the checkpoint's, not the default
    `all`: a chunk keeps one optimizer step, so resuming with another set of
    trained parameters could only fail once the ranks read the shards (or train
    frozen weights from no state)."""
    from labml_zero.finetune.preflight import preflight

    check_ok(finetune(tmp_path, "--finetune", "biases", "--steps", "1",
                      "--checkpoint-every", "1", "--sample-tokens", "0"))
    path = tmp_path / "out" / "checkpoints" / "step-000001"
    config, world_size = parse_config(
        [*SMALL, "--out", str(tmp_path / "again"), "--resume", str(path),
         "--steps", "2"], make_parser())
    assert config.finetune == "biases"
    assert preflight(config, world_size=world_size,
                     device=torch.device("cpu")).resumed_step == 1


def test_a_runs_directory_given_for_a_checkpoint_says_which_to_give(
        reference: Path, tmp_path: Path, capsys):
    """`--resume` of a run's `--out` names its newest checkpoint; `--checkpoint`
    of a sharded checkpoint says it is one, and what takes it."""
    flags = ["--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")]
    for given in (reference / "out", reference / "out" / "checkpoints"):
        with pytest.raises(SystemExit):
            main([*SMALL, *flags, "--resume", str(given)])
        err = capsys.readouterr().err
        newest = reference / "out" / "checkpoints" / "step-000006"
        assert err.count("\n") == 1 and f"(its newest checkpoint is {newest})" in err
    sharded = reference / "out" / "checkpoints" / "step-000006"
    with pytest.raises(SystemExit):
        main([*SMALL, *flags, "--checkpoint", str(sharded)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--checkpoint: {sharded} is a sharded " \
        "checkpoint, not a Hugging Face snapshot: continue it with --resume" in err


def test_the_sample_after_the_last_step_is_not_called_a_hang(tmp_path: Path):
    """The sample gathers every layer for every token, seconds past the last
    step's heartbeat: the watch keeps the rank alive while it runs (a run that
    had trained was ended as hung, with exit 1, before its sample and exports)."""
    result = finetune(tmp_path, "--steps", "2", "--sample-tokens", "400",
                      "--hang-timeout", "3")
    check_ok(result)
    assert "Sample after 2 steps" in result.stdout


def test_a_resume_keeps_the_layers_it_trained(tmp_path: Path, capsys):
    """A `--filter-layers` run names its layers by position: another choice of
    the same shapes passes the names check, so the layers' recorded prefixes
    are compared (layer 0's weights would otherwise train as layer 1)."""
    check_ok(finetune(tmp_path, "--filter-layers", "0", "--steps", "1",
                      "--checkpoint-every", "1", "--sample-tokens", "0"))
    path = tmp_path / "out" / "checkpoints" / "step-000001"
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, "--filter-layers", "1", "--resume", str(path), "--steps", "2",
              "--out", str(tmp_path / "again"), "--log-dir", str(tmp_path / "logs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume {path} trained other layers: its " \
        "layer 1 is 'gpt_neox.layers.0.', this run's 'gpt_neox.layers.1.'" in err, err


def test_a_run_neither_overwrites_nor_prunes_another_runs_checkpoints(
        reference: Path, tmp_path: Path, capsys):
    """Checkpoints under `--out` that this run did not write stay as they are: a
    fresh run that would save a step already there is refused before start,
    and a run that branches off an earlier checkpoint prunes only its own."""
    out = tmp_path / "out"
    shutil.copytree(reference / "out", out)
    saved = out / "checkpoints"
    before = {p.name: (p / "manifest.json").read_bytes() for p in saved.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, "--steps", "6", "--checkpoint-every", "3", "--seed", "7",
              "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out} already holds step-000003, " \
        "which this run would write over" in err, err
    # a branch from step 3 at a lower rate, keeping 1 of its own
    check_ok(finetune(tmp_path, "--resume", str(saved / "step-000003"),
                      "--lr", "1e-4", "--steps", "5", "--checkpoint-every", "1",
                      "--keep-checkpoints", "1"))
    assert sorted(p.name for p in saved.iterdir()) == [
        "step-000003", "step-000005", "step-000006"]
    for name, manifest in before.items():
        assert (saved / name / "manifest.json").read_bytes() == manifest


def test_every_flag_has_help_and_shows_its_default():
    parser = make_parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    # one flag per field, written nowhere but in the dataclass, the launcher's
    # and the planner's
    assert set(flags) == fields | {"world_size"} | set(FLAG_DESTS)
    for name, action in flags.items():
        assert action.help and "(default: " in action.help, name
    for name in ("lr", "seq_len", "seed", "valid_every"):
        assert len(flags[name].help) > len("(default: x)") + 10, name
    assert "(default: 0.003)" in flags["lr"].help
    assert "(default: 64)" in flags["seq_len"].help


def test_no_flags_is_the_laptop_preset():
    config, world_size = parse_config([], make_parser())
    assert config == laptop() == FinetuneConfig() and world_size is None
    config, _ = parse_config(["--epochs", "2", "--lr", "1e-4", "--filter-layers",
                              "0,1", "--compile"], make_parser())
    assert (config.steps, config.epochs, config.lr) == (None, 2, 1e-4)
    assert config.filter_layers == (0, 1) and config.compile
    preset = neox_20b_biases("/models/neox-20b")
    assert (preset.model, preset.finetune, preset.dtype) == (
        "gpt-neox-20b", "biases", "fp16")


def test_check_loss_waits_for_the_scaler_floor():
    class Scaler:
        scale_value = 2.0 ** 10

    nan = Totals(float("nan"), 0.0, 10.0)
    check_loss(Totals(5.0, 0.0, 10.0), 1, None, None)
    # fp16: the scaler backs off first; below its floor the job stops
    check_loss(nan, 1, Scaler(), None)
    Scaler.scale_value = 0.5
    with pytest.raises(NonFiniteLoss, match="loss scale at 0.5"):
        check_loss(nan, 2, Scaler(), None)
    with pytest.raises(NonFiniteLoss, match="no checkpoint was written"):
        check_loss(nan, 1, None, None)
