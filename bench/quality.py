r"""
---
title: What each precision choice costs in quality
summary: One command trains the same model on the same data and seed once per
  precision choice (a state layout, or fp8 products) and writes each run's loss curves, its final
  validation loss and that loss's relative difference to the fp32 states.
---

# What each precision choice costs in quality

```
python -m bench.quality --model pythia-160m --steps 500
python -m bench.quality --model pythia-410m --choices fp8 --steps 500
```

For each `--optimizer-states` choice of [the state
layouts](../labml_zero/zero3/state_layout.html), and for `fp8`, the layers'
large linears in [fp8](../labml_zero/layers/float8.html) with fp32 states
(`--kernels auto,fp8`), the fine-tune job
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
from labml_zero.neox.family import NEOX
from labml_zero.neox.kernels import ModelKernels
from labml_zero.zero3.state_layout import LAYOUTS

__all__ = ["BASELINE", "QUALITY_GOAL", "QUALITY_KIND", "PRODUCT_CHOICES", "CHOICES",
           "choice_of", "parse_args", "job_command", "tracked", "quality_line",
           "relative_differences", "default_out", "main"]

REPO = Path(__file__).resolve().parent.parent
# The choice every other is measured against: fp32 master and moments.
BASELINE = "fp32"
# The most a choice's final validation loss may differ from the fp32 states'
# relatively, $|\delta|$, for the choice to cost nothing worth a user's notice.
QUALITY_GOAL = 0.005
# What marks a line of a result file as one of these runs.
QUALITY_KIND = "quality"
# The matrix products' precision, a choice beside the state layouts: the job's
# flags for it. The states stay fp32, so only the products differ from the
# baseline; `auto,fp8` leaves out the fusion that calls a product itself.
PRODUCT_CHOICES = {"fp8": ("--kernels", "auto,fp8")}
CHOICES = (*LAYOUTS, *PRODUCT_CHOICES)


def choice_of(line: dict) -> str:
    """A line's choice: its `choice`, or for a line written before products
    were a choice, its state layout."""
    return line.get("choice", line["optimizer_states"])


def fp8_refusal(model: str) -> str | None:
    """Why `fp8` would measure nothing on `model`: no linear of its layers is
    large enough to run in fp8 (`fp8_pays`), so the run would be the
    baseline's again."""
    if NEOX.fp8_linears(PRESETS[model](), ModelKernels(fp8=True)):
        return None
    return (f"--choices fp8: no linear of {model} runs in fp8 (each weight is "
            f"below the size where fp8 pays), so it would train as the {BASELINE} run")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.quality",
        description="Train one model once per optimizer-state choice and record "
                    "the loss curves and the final validation loss's difference "
                    "to the fp32 states. Flags after `--` go to the fine-tune job "
                    "unchanged (for example --checkpoint DIR, --dtype bf16).")
    p.add_argument("--model", default="pythia-160m", choices=tuple(PRESETS))
    p.add_argument("--choices", default=",".join(LAYOUTS), metavar="NAMES",
                   help=f"comma-separated, from {','.join(CHOICES)} (fp8: the "
                        f"layers' large linears in fp8, fp32 states; a GPU); "
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
    unknown = [n for n in names if n not in CHOICES]
    if unknown or not names:
        p.error(f"--choices: unknown {','.join(unknown) or '(none given)'}; "
                f"expected names from {','.join(CHOICES)}")
    # the baseline first, since every other line is measured against it
    args.choices = [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]
    if args.job_args[:1] == ["--"]:
        args.job_args = args.job_args[1:]
    for name in PRODUCT_CHOICES.keys() & set(args.choices):
        flag = PRODUCT_CHOICES[name][0]
        if any(a == flag or a.startswith(flag + "=") for a in args.job_args):
            p.error(f"{flag} among the job's flags: the {name} choice sets it, "
                    f"and the baseline must run the same kernels but {name}")
    if "fp8" in args.choices and (why := fp8_refusal(args.model)):
        p.error(why)
    return args


def job_command(args: argparse.Namespace, choice: str, workdir: Path) -> list[str]:
    """The fine-tune job's command line for one choice; its outputs in `workdir`.
    A `--checkpoint` among the job's flags gives the model itself (the job takes
    one of the two), and `--model` then only names the lines."""
    from_checkpoint = any(a == "--checkpoint" or a.startswith("--checkpoint=")
                          for a in args.job_args)
    model = [] if from_checkpoint else ["--model", args.model]
    states = BASELINE if choice in PRODUCT_CHOICES else choice
    return [sys.executable, "-m", "labml_zero.finetune_neox",
            *model, "--steps", str(args.steps),
            "--valid-every", str(args.valid_every), "--seed", str(args.seed),
            "--sample-tokens", "0", "--optimizer-states", states,
            *PRODUCT_CHOICES.get(choice, ()),
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
        raise SystemExit(f"--choices {choice}: the job recorded no "
                         f"{'training' if not train else 'validation'} loss")
    return {"kind": QUALITY_KIND, "model": args.model, "choice": choice,
            "optimizer_states": BASELINE if choice in PRODUCT_CHOICES else choice,
            "products": "fp8" if choice == "fp8" else "bf16",
            "steps": args.steps, "valid_every": args.valid_every, "seed": args.seed,
            "job_args": args.job_args, "device": device_name(),
            "train_loss": [list(p) for p in train],
            "valid_loss": [list(p) for p in valid],
            "final_valid_loss": valid[-1][1]}


def relative_differences(lines: list[dict]) -> None:
    r"""Sets each line's `valid_loss_rel_diff`, $\delta$ against the fp32 line."""
    base = next(l for l in lines if choice_of(l) == BASELINE)
    for line in lines:
        line["valid_loss_rel_diff"] = ((line["final_valid_loss"]
                                        - base["final_valid_loss"])
                                       / base["final_valid_loss"])


def default_out(model: str, device: str, today: datetime.date,
                choices: list[str] | None = None) -> Path:
    """`bench/results/<date>-quality-<model>[-<choices>]-1x<device>.jsonl`, the
    device's short name (`H200` of `NVIDIA H200`) as the other result files
    spell it; the choices beside the baseline are named unless they are every
    state layout, so that two runs of one day do not share a file."""
    short = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]*)\b", device)
    others = [c for c in choices or LAYOUTS if c != BASELINE]
    named = "" if set(others) == set(LAYOUTS) - {BASELINE} else "-" + "-".join(others)
    return (REPO / "bench" / "results"
            / f"{today.isoformat()}-quality-{model}{named}"
              f"-1x{short.group(1) if short else device}.jsonl")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.model, device_name(),
                                                       datetime.date.today(),
                                                       args.choices)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    lines = []
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        for choice in args.choices:
            workdir = Path(tmp) / choice
            workdir.mkdir()
            print(f"# {args.model}, {choice}", flush=True)
            done = subprocess.run(job_command(args, choice, workdir), cwd=workdir,
                                  env=env)
            if done.returncode != 0:
                raise SystemExit(f"--choices {choice}: the job failed "
                                 f"(exit {done.returncode}); nothing written")
            lines.append(quality_line(args, choice, tracked(workdir / "logs")))
    relative_differences(lines)
    # written only once every choice has run, so a file is never half a comparison
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(l) + "\n" for l in lines))
    for line in lines:
        print(f"{choice_of(line):>16}: final loss.valid "
              f"{line['final_valid_loss']:.4f} ({line['valid_loss_rel_diff']:+.2%})")
    print(f"wrote {out}")
    return lines


if __name__ == "__main__":
    main()
