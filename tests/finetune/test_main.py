"""`labml_zero/finetune/__main__.py`: `python -m labml_zero.finetune` asks the
registry for the family first, and refuses in one line, exit 2, a family it
does not know; any family goes on to the job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labml_zero.finetune.__main__ import main
from labml_zero.llama import config as llama_config
from labml_zero.neox import config as neox_config

REPO = Path(__file__).resolve().parents[2]


def snapshot(path: Path, hf: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


def refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m labml_zero.finetune: ")
    return err


def test_an_unknown_model_type_names_the_families(tmp_path, capsys):
    path = snapshot(tmp_path / "gpt2", {"model_type": "gpt2"})
    err = refusal(capsys, ["--checkpoint", path])
    assert "model_type 'gpt2'" in err
    assert all(t in err for t in ("gpt_neox", "llama", "qwen2", "mistral"))


def test_a_llama_checkpoint_or_preset_goes_on_to_the_job(tmp_path, capsys):
    # the job's own checks answer: here a snapshot with no weights, refused by
    # the Llama family's check before any rank starts
    hf = llama_config.to_hf_config(llama_config.qwen2_5_0_5b())
    path = snapshot(tmp_path / "qwen", hf)
    with pytest.raises(SystemExit) as info:
        main(["--checkpoint", path, "--steps", "1", "--out", str(tmp_path / "o"),
              "--log-dir", str(tmp_path / "l")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no model.safetensors" in err
    for argv in (["--model", "smollm2-135m", "--help"],
                 ["--checkpoint", path, "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
        assert "--checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("text, says", [
    (None, "no config.json"), ("{", "config.json does not read"),
    ("[]", "no 'model_type' string"), ('{"model_type": 3}', "no 'model_type'")])
def test_a_config_json_that_names_no_family(tmp_path, capsys, text, says):
    path = tmp_path / "ckpt"
    path.mkdir()
    if text is not None:
        (path / "config.json").write_text(text)
    assert says in refusal(capsys, ["--checkpoint", str(path)])


def test_an_unknown_preset_is_one_line(capsys):
    assert "unknown model preset 'gpt2'" in refusal(capsys, ["--model", "gpt2"])


def test_gpt_neox_goes_on_to_the_job(tmp_path, capsys):
    # the job's own parser answers --help: the family was accepted
    path = snapshot(tmp_path / "neox",
                    neox_config.to_hf_config(neox_config.tiny()))
    for argv in (["--help"], ["--model", "pythia-70m", "--help"],
                 ["--checkpoint", path, "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
        assert "--checkpoint" in capsys.readouterr().out


def test_the_module_runs(tmp_path):
    path = snapshot(tmp_path / "gpt2", {"model_type": "gpt2"})
    run = subprocess.run([sys.executable, "-m", "labml_zero.finetune",
                          "--checkpoint", path], cwd=REPO, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2 and "model_type 'gpt2'" in run.stderr
    assert run.stdout == "" and run.stderr.count("\n") == 1


def test_the_jobs_lines_name_the_command_the_user_ran(capsys):
    """The job's own refusals (here a bad `--lr`, found by its parser) start
    with `python -m labml_zero.finetune`, not the GPT-NeoX entry point's name."""
    with pytest.raises(SystemExit) as stopped:
        main(["--lr", "-1"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m labml_zero.finetune: error: --lr: lr must be > 0, "
                   "got -1.0 (see --help)"]
