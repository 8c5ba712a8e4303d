r"""
---
title: What each optimizer-state choice costs in quality
summary: One command trains the same model on the same data and seed once per
  optimizer-state choice and writes each run's loss curves, its final
  validation loss and that loss's relative difference to the fp32 states.
---

# What each optimizer-state choice costs in quality

```
python -m bench.quality --model pythia-160m --steps 500
```

For each `--optimizer-states` choice of [the state
layouts](../labml_zero/zero3/state_layout.html) the fine-tune job
(`python -m labml_zero.finetune_neox`) trains the same model from the same
weights, on the same data in the same order, for the same steps; only the
choice differs. One JSON line per choice records the training loss of every
step, the validation loss every `--valid-every` steps and at the last, and the
final validation loss's relative difference to the fp32 states' run,

$$\delta = \frac{L_\text{choice} - L_\text{fp32}}{L_\text{fp32}}.$$

The [results page](../results.html) draws the curves and the table of $\delta$
from these files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from labml_zero.neox.config import PRESETS
from labml_zero.zero3.state_layout import LAYOUTS

__all__ = ["BASELINE", "QUALITY_GOAL", "QUALITY_KIND", "parse_args", "job_command",
           "tracked", "quality_line", "relative_differences", "default_out", "main"]

REPO = Path(__file__).resolve().parent.parent
# The choice every other is measured against: fp32 master and moments.
BASELINE = "fp32"
# The most a choice's final validation loss may differ from the fp32 states'
# relatively, $|\delta|$, for the choice to cost nothing worth a user's notice.
QUALITY_GOAL = 0.005
# What marks a line of a result file as one of these runs.
QUALITY_KIND = "quality"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.quality",
        description="Train one model once per optimizer-state choice and record "
                    "the loss curves and the final validation loss's difference "
                    "to the fp32 states. Flags after `--` go to the fine-tune job "
                    "unchanged (for example --checkpoint DIR, --dtype bf16).")
    p.add_argument("--model", default="pythia-160m", choices=tuple(PRESETS))
    p.add_argument("--choices", default=",".join(LAYOUTS), metavar="NAMES",
                   help=f"comma-separated, from {','.join(LAYOUTS)}; "
                        f"{BASELINE} is always run first")
    p.add_argument("--steps", type=int, default=500, metavar="N")
    p.add_argument("--valid-every", type=int, default=25, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="PATH",
                   help="the JSON lines file; default bench/results/"
                        "<date>-quality-<model>-1x<device>.jsonl")
    p.add_argument("job_args", nargs=argparse.REMAINDER,
                   help="-- then flags for the fine-tune job")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.valid_every < 1:
        p.error(f"--valid-every must be at least 1, got {args.valid_every}")
    names = [n for n in args.choices.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        p.error(f"--choices: unknown {','.join(unknown) or '(none given)'}; "
                f"expected names from {','.join(LAYOUTS)}")
    # the baseline first, since every other line is measured against it
    args.choices = [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]
    if args.job_args[:1] == ["--"]:
        args.job_args = args.job_args[1:]
    return args


def job_command(args: argparse.Namespace, choice: str, workdir: Path) -> list[str]:
    """The fine-tune job's command line for one choice; its outputs in `workdir`.
    A `--checkpoint` among the job's flags gives the model itself (the job takes
    one of the two), and `--model` then only names the lines."""
    from_checkpoint = any(a == "--checkpoint" or a.startswith("--checkpoint=")
                          for a in args.job_args)
    model = [] if from_checkpoint else ["--model", args.model]
    return [sys.executable, "-m", "labml_zero.finetune_neox",
            *model, "--steps", str(args.steps),
            "--valid-every", str(args.valid_every), "--seed", str(args.seed),
            "--sample-tokens", "0", "--optimizer-states", choice,
            "--out", str(workdir / "out"), "--log-dir", str(workdir / "logs"),
            *args.job_args]


def tracked(log_dir: Path) -> dict[str, dict[int, float]]:
    """
    `{indicator: {step: value}}` from rank 0's labml local log

    The job's tracked numbers are already means over the ranks
    ([tracking](../labml_zero/finetune/tracking.html)), so rank 0's log
    (`<log_dir>/zero3_neox/<uuid>.0/log.jsonl`) is the run's.
    """
    runs = sorted((log_dir / "zero3_neox").glob("*.0"))
    if len(runs) != 1:
        raise SystemExit(f"{log_dir}: expected one labml run of rank 0, found {len(runs)}")
    out: dict[str, dict[int, float]] = {}
    for text in (runs[0] / "log.jsonl").read_text().splitlines():
        for name, points in json.loads(text).get("track", {}).items():
            for step, values in points:
                out.setdefault(name, {})[int(step)] = float(values[-1])
    return out


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def quality_line(args: argparse.Namespace, choice: str,
                 series: dict[str, dict[int, float]]) -> dict:
    """One choice's record: both curves as `[step, loss]` pairs, step order."""
    train = sorted(series.get("loss.train", {}).items())
    valid = sorted(series.get("loss.valid", {}).items())
    if not train or not valid:
        raise SystemExit(f"--optimizer-states {choice}: the job recorded no "
                         f"{'training' if not train else 'validation'} loss")
    return {"kind": QUALITY_KIND, "model": args.model, "optimizer_states": choice,
            "steps": args.steps, "valid_every": args.valid_every, "seed": args.seed,
            "job_args": args.job_args, "device": device_name(),
            "train_loss": [list(p) for p in train],
            "valid_loss": [list(p) for p in valid],
            "final_valid_loss": valid[-1][1]}


def relative_differences(lines: list[dict]) -> None:
    r"""Sets each line's `valid_loss_rel_diff`, $\delta$ against the fp32 line."""
    base = next(l for l in lines if l["optimizer_states"] == BASELINE)
    for line in lines:
        line["valid_loss_rel_diff"] = ((line["final_valid_loss"]
                                        - base["final_valid_loss"])
                                       / base["final_valid_loss"])


def default_out(model: str, device: str, today: datetime.date) -> Path:
    """`bench/results/<date>-quality-<model>-1x<device>.jsonl`, the device's
    short name (`H200` of `NVIDIA H200`) as the other result files spell it."""
    short = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]*)\b", device)
    return (REPO / "bench" / "results"
            / f"{today.isoformat()}-quality-{model}-1x{short.group(1) if short else device}.jsonl")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.model, device_name(),
                                                       datetime.date.today())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    lines = []
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        for choice in args.choices:
            workdir = Path(tmp) / choice
            workdir.mkdir()
            print(f"# {args.model}, --optimizer-states {choice}", flush=True)
            done = subprocess.run(job_command(args, choice, workdir), cwd=workdir,
                                  env=env)
            if done.returncode != 0:
                raise SystemExit(f"--optimizer-states {choice}: the job failed "
                                 f"(exit {done.returncode}); nothing written")
            lines.append(quality_line(args, choice, tracked(workdir / "logs")))
    relative_differences(lines)
    # written only once every choice has run, so a file is never half a comparison
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(l) + "\n" for l in lines))
    for line in lines:
        print(f"{line['optimizer_states']:>16}: final loss.valid "
              f"{line['final_valid_loss']:.4f} ({line['valid_loss_rel_diff']:+.2%})")
    print(f"wrote {out}")
    return lines


if __name__ == "__main__":
    main()
