r"""
---
title: A saved checkpoint to Hugging Face
summary: python -m labml_zero.export CHECKPOINT DIR writes any sharded checkpoint
  of the fine-tune as a Hugging Face checkpoint of its family with its tokenizer,
  streamed one tensor at a time, with no process group.
---

# A saved checkpoint to Hugging Face

```bash
python -m labml_zero.export out/checkpoints/step-000120 my-model
```

The fine-tune's [exports](neox/lora_export.html) run at the end of a job; this
command does the same for a [sharded checkpoint](zero3/checkpoint/index.html)
already on disk, of any [family](families.html), whatever was fine-tuned (LoRA's
adapters are merged into their weights). It needs no GPU and no ranks, and
streams one tensor at a time, so the host's memory is bounded by

$$M \approx \max_p |p| + B_\text{shard},$$

the largest tensor read plus one output shard of at most `--max-shard-size`
bytes, whatever the model's size.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path

import torch

from tokenizers import Tokenizer

from labml_zero.families import family_for_model_type
from labml_zero.family import HF_EXPORT
from labml_zero.zero3.checkpoint import (CheckpointError, CheckpointReader,
                                         prefix_rename, saved_tensors,
                                         sequential_parameters)

__all__ = ["main", "ExportPlan", "plan_export", "parse_size"]

# What `--dtype` may name. Without it the export writes the base snapshot's
# dtype, else the training dtype (both in the manifest): bf16 stays bf16.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
# decimal and binary multiples, as `--max-shard-size 2GB` or `2GiB`
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
         "kib": 2**10, "mib": 2**20, "gib": 2**30}


class ExportError(ValueError):
    """Bad input to the command; the message is one line naming it."""


def parse_size(text: str) -> int:
    """Bytes of a size given as `2GB` or `512MiB` (decimal or binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and UNITS.get(match.group(2).lower())
    if not unit or float(match.group(1)) * unit < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2GB, "
                                         f"512MiB, 1000000)")
    return int(float(match.group(1)) * unit)


class ExportPlan:
    r"""
    ## What one export will do, checked before anything is written

    1. the checkpoint's manifest and `export` record (`export` in its `meta`,
       see [the job's checkpoints](finetune/checkpoints.html)): the model's
       `config.json`, whose `model_type` names the family that writes it, each
       layer's Hugging Face prefix, LoRA's settings, the tokenizer the job
       encoded with and the dtype. A checkpoint saved before the manifest
       recorded `export` cannot be exported: its model's head count and rotary
       settings are not in its shapes;
    2. the model: its `config.json`, the names the saved parameters take, and
       that they are a whole model of that shape;
    3. the dtype (`--dtype` replaces the recorded one: the base snapshot's, else
       the training one), the tokenizer (`--tokenizer` replaces it, e.g. once the
       snapshot has moved) and the destination, with room for $p\Psi$: a new
       or empty directory or a previous export, replaced whole once the new one
       is complete; never the checkpoint, nor a directory of other files.

    Every file's size and digest is checked too, before a byte is written; each
    bad input is one line and exit status 2.
    """

    def __init__(self, args: argparse.Namespace):
        self.reader = CheckpointReader(args.checkpoint)
        record = self.reader.meta.get("export")
        if not isinstance(record, dict):
            raise ExportError(f"CHECKPOINT {args.checkpoint} records no model to "
                              f"export (saved before the manifest kept one)")
        try:
            hf_config = record["hf_config"]
            # the family the job asked: its `config.json`'s `model_type`
            # (GPT-NeoX's writer has always named it)
            self.family = family_for_model_type(hf_config["model_type"])
            self.config = self.family.read_config(hf_config)
        except (KeyError, TypeError, ValueError) as error:
            raise ExportError(f"CHECKPOINT {args.checkpoint}: its recorded model "
                              f"config is not valid ({error})") from None
        self.rename = prefix_rename(record["prefixes"])
        lora = record.get("lora")
        self.lora = self.family.finetuner(
            "lora", rank=lora["rank"], alpha=lora["alpha"],
            targets=tuple(lora["targets"])) if lora else None
        self.dtype = DTYPES[args.dtype or record["dtype"]]
        self.check_whole_model(args.checkpoint)
        # every digest now, so a changed file is one line, not a failed write
        self.reader.verify_files()
        tokenizer = Path(args.tokenizer or record["tokenizer"])
        if not tokenizer.is_file():
            raise ExportError(f"--tokenizer {tokenizer} not found (the job's "
                              f"tokenizer file; give its new place)")
        try:
            text = (gzip.decompress(tokenizer.read_bytes()).decode()
                    if tokenizer.suffix == ".gz" else tokenizer.read_text())
            Tokenizer.from_str(text)
        except Exception as error:  # tokenizers raises a bare `Exception`
            raise ExportError(f"--tokenizer {tokenizer} does not load: "
                              f"{str(error).splitlines()[0]}") from None
        snapshot = record.get("snapshot")
        self.tokenizer = tokenizer
        self.snapshot = snapshot if snapshot and Path(snapshot).is_dir() else None
        try:
            self.out = self.family.check_export_destination(
                args.out, HF_EXPORT, flag="DIR", need_bytes=self.need_bytes,
                protected={"CHECKPOINT": args.checkpoint,
                           "the checkpoint's base snapshot": snapshot})
        except ValueError as error:  # the exports' `ExportDestinationError`
            raise ExportError(str(error)) from None
        self.max_shard_bytes = args.max_shard_size

    def check_whole_model(self, path) -> None:
        """
        ### Every tensor of the recorded shape, and nothing else

        From the manifest's names and shapes alone (no tensor is read). A run
        with `--filter-layers` saved only some layers: not a model to release.
        """
        layers = self.family.build(self.config, device="meta")
        if self.lora is not None:
            self.lora(layers)  # the adapters were saved too
        # a tied matrix is one parameter, saved once in its first layer
        prefixes = [self.family.hf_prefix(layer) for layer in layers]
        expected = {prefix_rename(prefixes)(name): tuple(p.shape)
                    for name, p in sequential_parameters(layers)}
        saved = {self.rename(name): p.shape for name, p in self.reader.params.items()}
        missing = sorted(expected.keys() - saved.keys())
        if missing:
            raise ExportError(f"CHECKPOINT {path} has no {missing[0]!r} (and "
                              f"{len(missing) - 1} more): not a whole model "
                              f"(a --filter-layers run?)")
        for name, shape in saved.items():
            if expected.get(name) != shape:
                raise ExportError(f"CHECKPOINT {path}: {name!r} has shape {shape}, "
                                  f"its config.json implies {expected.get(name)}")
        # $p\Psi$, adapters left out: they are folded into their weights
        self.need_bytes = self.family.export_bytes(layers, HF_EXPORT, self.dtype)

    def run(self) -> Path:
        """
        ### Stream the tensors into the Hugging Face writer

        `saved_tensors` yields one parameter at a time, assembled from the
        ranks' files (fp32 where the checkpoint keeps a master, or a
        compensation: $w + c$), cast to the export's dtype; `merged` holds a
        LoRA layer's $W$, $A$, $B$ until all
        three have come; the family's writer (GPT-NeoX's is [its checkpoint
        page](neox/hf_checkpoint.html)) holds one shard, which safetensors
        copies once more while it writes it: the formula above. Module buffers
        are not exported (the engine does not shard them); neither family has
        one that a checkpoint needs.
        """
        tensors = saved_tensors(self.reader, rename=self.rename)
        options = dict(tokenizer=self.tokenizer, snapshot=self.snapshot,
                       dtype=self.dtype, max_shard_bytes=self.max_shard_bytes,
                       overwrite=True, marker=HF_EXPORT)
        if self.lora is not None:
            return self.family.save_merged(self.out, self.config, tensors,
                                           self.lora, **options)
        return self.family.save_hf(self.out, self.config, tensors, **options)


def plan_export(argv: list[str] | None = None) -> ExportPlan:
    """The command line, parsed and checked; raises `ExportError` and its kin."""
    return ExportPlan(parser().parse_args(argv))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labml_zero.export",
        description="Write a sharded checkpoint of the fine-tune as a Hugging "
                    "Face checkpoint of its family (safetensors, config.json, "
                    "tokenizer), one tensor at a time.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a sharded checkpoint directory (out/checkpoints/step-N)")
    p.add_argument("out", metavar="DIR",
                   help="where to write it: a new or empty directory, or an "
                        "earlier export, which is replaced")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="the checkpoint's dtype (default: the base snapshot's, "
                        "else the training one)")
    p.add_argument("--tokenizer", metavar="FILE", default=None,
                   help="the tokenizer.json to ship (default: the job's)")
    p.add_argument("--max-shard-size", type=parse_size, default=2 * 2**30,
                   metavar="SIZE",
                   help="largest safetensors file before the next (default "
                        "2GiB); above it, an index names each tensor's file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, or 2 with one line for bad input found before writing."""
    try:
        plan = plan_export(argv)
    except (ExportError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = plan.run()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
