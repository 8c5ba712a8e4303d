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
`config.json`'s `model_type`. Every family goes on to the command line,
whose job asks the family for everything model-specific; a `model_type` no
family reads, or a `config.json` without one, is one line and exit 2, before
anything starts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from labml_zero.families import UnknownFamily, family_for_model_type, family_for_preset
from labml_zero.finetune.cli import main as job_main
from labml_zero.finetune.config import snapshot_model_type

__all__ = ["main"]

# Refusals name this command; what passes on prints the job's own usage.
PROG = "python -m labml_zero.finetune"


def main(argv: Sequence[str] | None = None) -> int:
    """
    ## The family first, then the job

    Only `--checkpoint` and `--model` are read here (`--checkpoint` wins, as
    in the job); everything else, `--help` included, is the job's to parse.
    Unlike `python -m labml_zero.finetune_neox`, which reads a `config.json`
    without `model_type` as GPT-NeoX's, this command needs the field.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # exact flags only: the job's parser, not this one, judges abbreviations
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--checkpoint")
    first.add_argument("--model")
    known, _ = first.parse_known_args(argv)
    try:
        if known.checkpoint is not None:
            family_for_model_type(snapshot_model_type(known.checkpoint))
        elif known.model is not None:
            family_for_preset(known.model)
    except (ValueError, UnknownFamily) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    # the job's configuration picks the same family again (`FinetuneConfig.family`)
    return job_main(argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
