"""
---
title: The fine-tune of any family
summary: `python -m labml_zero.finetune` picks the model family from `--model`
  or from the checkpoint's config.json, and refuses in one line what the job
  cannot train yet.
---

# The fine-tune of any family

`python -m labml_zero.finetune` is [the fine-tune's command line](cli.html)
with one question asked first: which [family](../families.html)? A `--model`
preset names its family; a `--checkpoint` directory names it in its
`config.json`'s `model_type`. A family the job trains goes on to the command
line; any other, or a `model_type` no family reads, is one line and exit 2,
before anything starts.

## Limitations

* The job trains GPT-NeoX only: a Llama-family preset or checkpoint is
  refused (it would need the family's sharded build, exports and sampling).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from labml_zero.families import UnknownFamily, family_for_model_type, family_for_preset
from labml_zero.finetune.cli import main as job_main
from labml_zero.finetune.config import FAMILY

__all__ = ["main"]

# Refusals name this command; what passes on prints the job's own usage.
PROG = "python -m labml_zero.finetune"


def model_type(checkpoint: str) -> str:
    """`config.json`'s `model_type`; `ValueError` naming the file otherwise."""
    path = Path(checkpoint) / "config.json"
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--checkpoint {checkpoint}: no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--checkpoint {checkpoint}: config.json does not read: "
                         f"{' '.join(str(e).split())}") from None
    if not isinstance(value, dict) or not isinstance(value.get("model_type"), str):
        raise ValueError(f"--checkpoint {checkpoint}: config.json has no "
                         f"'model_type' string")
    return value["model_type"]


def main(argv: Sequence[str] | None = None) -> int:
    """
    ## The family first, then the job

    Only `--checkpoint` and `--model` are read here (`--checkpoint` wins, as
    in the job); everything else, `--help` included, is the job's to parse.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # exact flags only: the job's parser, not this one, judges abbreviations
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--checkpoint")
    first.add_argument("--model")
    known, _ = first.parse_known_args(argv)
    try:
        if known.checkpoint is not None:
            kind = model_type(known.checkpoint)
            family, source = family_for_model_type(kind), f"model_type {kind!r}"
        elif known.model is not None:
            family, source = family_for_preset(known.model), f"--model {known.model}"
        else:
            family, source = FAMILY, ""
    except (ValueError, UnknownFamily) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if family is not FAMILY:
        print(f"{PROG}: error: {source} is the {family.name} family, not yet "
              f"supported by the job; supported: {FAMILY.name}", file=sys.stderr)
        return 2
    return job_main(argv)


if __name__ == "__main__":
    sys.exit(main())
