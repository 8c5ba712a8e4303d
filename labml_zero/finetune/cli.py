r"""
---
title: python -m labml_zero.finetune_neox
summary: The command line of the GPT-NeoX fine-tune: flags, checks before any process
  starts, one process per GPU (or several CPU processes), and clear failures.
---

# `python -m labml_zero.finetune_neox`

With no arguments it fine-tunes the tiny GPT-NeoX (random weights: nothing is
downloaded) on the bundled Tiny Shakespeare, on every GPU with NCCL, or without a
GPU on 2 CPU processes with gloo, and prints a sample at the end. The job itself
is [the fine-tune page](job.html); this page turns flags into a
`FinetuneConfig` and starts the processes. Every flag is generated from a field
of the config, everything is checked before a process starts, and a failure
ends in one line naming the rank and its cause.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re
import sys
import traceback
import typing
from pathlib import Path
from typing import Any, NoReturn, Sequence

import torch

from labml_zero import launch
from labml_zero.finetune.corpus import (JSONL_SUFFIXES, DataError, Source,
                                        find_sources)
from labml_zero.finetune.checkpoints import resume_settings
from labml_zero.finetune.job import FinetuneConfig, train
from labml_zero.finetune.planning import add_plan_flags, pop_request, settle
from labml_zero.finetune.preflight import Preflight, PreflightError, preflight
from labml_zero.launch.spawn import Signals
from labml_zero.zero3.checkpoint import CheckpointError

# What every message of this command starts with, as the user typed it.
PROG = "python -m labml_zero.finetune_neox"


class Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (no usage block) and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ## Converters
#
# argparse names a converter in its message ("invalid positive integer value:
# '0'"), hence the `__name__`s.


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


positive_int.__name__ = "positive integer"


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


non_negative_int.__name__ = "non-negative integer"


def finite_float(text: str) -> float:
    """A number; `nan` and `inf` are refused here (ranges: `FinetuneConfig`)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


finite_float.__name__ = "finite number"


def fraction_or_auto(text: str) -> float | str:
    """`auto`, or a number (its range is checked by `FinetuneConfig`)."""
    return "auto" if text == "auto" else finite_float(text)


fraction_or_auto.__name__ = "fraction or 'auto'"


def layer_list(text: str) -> tuple[int, ...]:
    layers = tuple(int(x) for x in text.split(",") if x.strip())
    if not layers or min(layers) < 0:
        raise ValueError
    return layers


layer_list.__name__ = "comma-separated layer list"

# Integers that may be 0; every other one is at least 1 (the seed's upper
# bound is `FinetuneConfig`'s).
MAY_BE_ZERO = ("sample_tokens", "keep_checkpoints", "warmup_steps",
               "prefetch_depth", "seed")
# LaTeX in the notes, as the terminal can show it
SYMBOLS = {r"\cdot": "·", r"\times": "×", r"\lfloor": "⌊", r"\rfloor": "⌋",
           r"\approx": "≈", r"\ln": "ln", r"\Psi": "Ψ"}


# ## Flags from the config's fields
#
# Every flag is a field of [`FinetuneConfig`](config.html),
# generated from it: `seq_len: int = 64` is `--seq-len N`, its type from the
# annotation (integers at least 1 unless the field allows 0, numbers finite), its
# help the field's note and its default, so a setting is written once, in the
# dataclass. `--world-size` is the one flag of the launcher's own.


def field_notes(cls: type) -> dict[str, str]:
    """
    ### Each field's note: the string literal under it in the class body

    Python keeps no attribute docstrings, so they are read from the source.
    """
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    notes = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            notes[node.target.id] = after.value.value
    return notes


def plain(note: str) -> str:
    """
    #### A note's first paragraph as one line of plain text, for `--help`

    Links keep their text, code and math lose their marks (so math reads as
    source there), and `%` is doubled (argparse formats help strings with
    it).
    """
    text = inspect.cleandoc(note).split("\n\n")[0]
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)

    def math(match: re.Match) -> str:
        formula = match.group(1)
        for macro, symbol in SYMBOLS.items():
            formula = formula.replace(macro, symbol)
        return formula.replace("{", "").replace("}", "").replace("\\", "")

    text = re.sub(r"\$([^$]*)\$", math, text).replace("`", "")
    return " ".join(text.split()).replace("%", "%%")


def converter(name: str, hint: Any) -> Any:
    """The argparse `type=` for a field, from its annotation."""
    args = set(typing.get_args(hint)) - {type(None)}
    if hint is bool:
        return None
    if str in args and float in args:
        return fraction_or_auto
    if args == {tuple[int, ...]}:
        return layer_list
    base = next(iter(args)) if args else hint
    if base is int:
        return non_negative_int if name in MAY_BE_ZERO else positive_int
    if base is float:
        return finite_float
    return str


def add_field_flags(parser: Parser) -> None:
    """
    ### One flag per `FinetuneConfig` field

    `seq_len: int = 64` becomes `--seq-len N`, its type from the annotation, its
    help the field's note and `(default: 64)`; a `bool` becomes a switch. Only
    flags given on the command line reach the config (`SUPPRESS`), so a default
    lives in the dataclass alone; a switch can only turn a field on, so every
    such default is off. `--steps` and `--epochs` exclude each other:
    `--epochs` runs whole epochs instead of a step count.
    """
    notes = field_notes(FinetuneConfig)
    hints = typing.get_type_hints(FinetuneConfig)
    length = parser.add_mutually_exclusive_group()
    for f in dataclasses.fields(FinetuneConfig):
        options = dict(f.metadata.get("flag", {}))
        default = f.default
        shown = "off" if default is False else repr(default) if isinstance(
            default, str) else default
        shown = f.metadata.get("shown_default") or shown
        options["help"] = f"{plain(notes.get(f.name, ''))} (default: {shown})"
        options["default"] = argparse.SUPPRESS
        kind = converter(f.name, hints[f.name])
        if kind is None:
            options["action"] = "store_true"
        elif kind is not str or "choices" not in options:
            options["type"] = kind
            options.setdefault("metavar", "N" if kind in (
                positive_int, non_negative_int) else None)
            if options["metavar"] is None:
                del options["metavar"]
        target = length if f.name in ("steps", "epochs") else parser
        target.add_argument("--" + f.name.replace("_", "-"), **options)


def make_parser(prog: str = PROG) -> Parser:
    p = Parser(prog=prog, description="Fine-tune a GPT-NeoX or Llama-family model with ZeRO-3 "
               "(labml_zero). With no arguments: the tiny model, random weights, "
               "Tiny Shakespeare, a few minutes on a laptop CPU.")
    add_field_flags(p)
    # the one flag that is not the job's: how many processes run it; more than
    # the GPUs is refused on CUDA, on CPU the processes share the cores (one
    # thread each)
    p.add_argument("--world-size", type=positive_int, metavar="N",
                   default=argparse.SUPPRESS,
                   help="processes (default: every GPU, or 2 on CPU)")
    # [the plan](planning.html): `--plan` prints the fastest setting that fits
    # the GPUs (`--gpu h200 --gpus 8`) and starts nothing; `--auto` runs it
    add_plan_flags(p)
    return p


def flag_error(message: str) -> str:
    """A config error names a field first; the user knows it as a flag."""
    name = message.split(" ", 1)[0]
    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    return f"--{name.replace('_', '-')}: {message}" if name in fields else message


def sources(path: str | None) -> list[Source] | None:
    """
    #### The files `--data` or `--valid-data` reads

    None without the flag (the bundled text is no file of the user's); `None`
    for a path that does not read, which [the data's own checks](data.html)
    name.
    """
    if path is None:
        return []
    try:
        return find_sources(path)
    except (DataError, OSError):
        return None


def flag_without_effect(config: FinetuneConfig, given: set[str]) -> str | None:
    """
    ### A flag the user gave that this run would not use, or `None`

    Each would be silently ignored in this run's mode, which reads as if it
    took effect: refused in one line that says what it needs. Only flags in
    `given` count; defaults never trip it. `--text-field` is used if either
    `--data` or `--valid-data` reads a JSON Lines file (a directory's files
    included).
    """
    data, valid = sources(config.data), sources(config.valid_data)
    no_jsonl = all(found is not None and not any(s.jsonl for s in found)
                   for found in (data, valid))
    rules = [
        ("min_lr", config.lr_schedule == "constant",
         "needs --lr-schedule linear or cosine (a constant rate never decays)"),
        ("keep_checkpoints", config.checkpoint_every is None,
         "needs --checkpoint-every (this run saves no checkpoint)"),
        ("valid_fraction", config.valid_data is not None,
         "has no effect with --valid-data (all of --data trains)"),
        ("text_field", no_jsonl, f"needs a JSON Lines --data or --valid-data "
                                 f"({', '.join(JSONL_SUFFIXES)})"),
        *((name, config.sample_tokens == 0,
           "needs --sample-tokens above 0 (this run samples nothing)")
          for name in ("prompt", "top_k")),
    ]
    for name, unused, needs in rules:
        if name in given and unused:
            return f"--{name.replace('_', '-')} {needs}"
    return shared_text(config, data, valid)


def shared_text(config: FinetuneConfig, data: list[Source] | None,
                valid: list[Source] | None) -> str | None:
    """
    #### Why `--valid-data` overlaps `--data`, or `None`

    A file both read (the same path, one inside the other's directory, or a
    link to it) would validate the model on text it trained on, and the
    validation loss would flatter it. Compared by the files each reads,
    resolved.
    """
    if config.data is None or config.valid_data is None:
        return None
    if Path(config.data).resolve() == Path(config.valid_data).resolve():
        return (f"--valid-data {config.valid_data} is --data: the run would "
                f"validate on the text it trains on")
    if not data or not valid:
        return None
    shared = sorted({s.path.resolve() for s in data}
                    & {s.path.resolve() for s in valid})
    if not shared:
        return None
    return (f"--valid-data {config.valid_data} overlaps --data {config.data} "
            f"({shared[0]} is in both): the run would validate on the text it "
            f"trains on")


def parse_config(argv: Sequence[str] | None, parser: Parser
                 ) -> tuple[FinetuneConfig, int | None]:
    """Flags → a checked config and the requested world size; exits 2 on bad input."""
    given = vars(parser.parse_args(argv))
    world_size = given.pop("world_size", None)
    try:
        request = pop_request(given)
    except ValueError as e:
        parser.error(str(e))
    if "checkpoint" in given and "model" in given:
        parser.error("give --model or --checkpoint, not both (the checkpoint's "
                     "config.json sets the shape)")
    if "resume" in given and not Path(given["resume"]).is_dir():
        parser.error(f"--resume: checkpoint directory not found: {given['resume']}")
    if "epochs" in given:
        given["steps"] = None
    try:
        config = FinetuneConfig(**given)
        if config.resume is not None:
            # the checkpoint's settings, but where a flag is given
            config, changed = resume_settings(config, set(given))
            if changed:
                print(changed, flush=True)
        config.model_config()
    except CheckpointError as e:  # the snapshot's config.json: its own file
        parser.error(f"--checkpoint: {e}")
    except (ValueError, FileNotFoundError) as e:
        parser.error(flag_error(str(e)))
    # LoRA's options mean nothing to the other fine-tuners: given without
    # `--finetune lora` they are refused, not ignored. Only flags the user gave
    # are in `given`; the config's defaults never trip this.
    lora_flags = [name for name in ("lora_rank", "lora_alpha", "lora_targets")
                  if name in given]
    if lora_flags and config.finetune != "lora":
        parser.error(f"--{lora_flags[0].replace('_', '-')} needs --finetune lora "
                     f"(this run fine-tunes {config.finetune!r})")
    refusal = flag_without_effect(config, set(given))
    if refusal is not None:
        parser.error(refusal)
    if request.mode is not None:
        # [the plan](planning.html): printed, and nothing starts; or applied
        try:
            config = settle(config, request, given, world_size=world_size)
        except ValueError as e:
            parser.error(str(e))
        if isinstance(config, str):  # --plan: printed, exit 0, as --help does
            print(config, flush=True)
            parser.exit(0)
    return config, world_size


def peer_memory_refusal(config: FinetuneConfig, world_size: int) -> str | None:
    """
    #### Why `--peer-memory` would have no effect at this world size, or `None`

    A chunk is gathered over its shard group: with one rank in it the shard is
    the whole chunk and there is no peer to read from, so [the
    transports](../zero3/transport.html) leave peer memory off. Given there,
    the flag is refused, not quietly dropped; the world size is known here,
    before any rank starts (the launcher's, or torchrun's `WORLD_SIZE`).
    """
    if not config.peer_memory:
        return None
    if world_size == 1:
        return ("--peer-memory needs more than one rank (with one, the shard is "
                "the whole chunk: there is no peer to read from)")
    if config.shard_group_size == 1:
        return ("--peer-memory needs shard groups of more than one rank (with "
                "--shard-group-size 1 each rank holds whole chunks: there is no "
                "peer to read from)")
    return None


def machine_facts(backend: str, world_size: int) -> None:
    """What labml-nn prints before a distributed job: the GPUs and the backends."""
    from labml import logger

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    logger.inspect(gpus=names or "none", n_gpus=len(names),
                   nccl=torch.distributed.is_nccl_available(),
                   mpi=torch.distributed.is_mpi_available(),
                   backend=backend, world_size=world_size)


def failure_line(error: Exception) -> str:
    """One line: which rank failed and its own cause, or the parent's error."""
    if isinstance(error, launch.RankFailed):
        return str(error)
    return f"{type(error).__name__}: {error}"


def check_before_start(config: FinetuneConfig, parser: Parser, *,
                       world_size: int, backend: str) -> Preflight:
    """
    ### The pre-flight checks, as one line and status 2

    Everything is checked before a process starts, so a typo costs no start-up:
    a bad flag or value (`parse_config`), and then everything [the pre-flight
    checks](preflight.html) find on this host (outputs not writable or
    without room for a checkpoint, a snapshot whose `config.json` and tensors
    disagree, a `--resume` that this run cannot continue, a `--cuda-graph`
    where no graph can record the step), prints one line on stderr and exits
    with status 2. Tokenising a corpus is the one long phase before the ranks,
    so SIGINT, SIGTERM and SIGHUP here, as during the job, print `interrupted`
    and exit with the signal's status, leaving no token file.
    """
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    if (why := config.cuda_graph_refusal(device)) is not None:
        parser.error(f"--cuda-graph {why}")
    if (why := config.fp8_refusal(device)) is not None:
        parser.error(f"--kernels fp8 {why}")
    try:
        with Signals():
            return preflight(config, world_size=world_size, device=device)
    except (PreflightError, FileNotFoundError) as e:
        parser.error(str(e))
    except KeyboardInterrupt as e:  # launch.Interrupted: SIGINT, SIGTERM or SIGHUP
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        sys.exit(getattr(e, "exit_status", 130))


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """
    ## Parse, check, launch; returns the exit status

    On one host `launch.spawn` starts `--world-size` processes (default: every
    GPU, or 2 on CPU); under torchrun (`RANK`, `WORLD_SIZE` and `LOCAL_RANK`
    set) this process is one rank and joins the others
    (`launch.run_torchrun`).

    If any rank raises, dies or hangs, [the launcher](../launch/spawn.html) ends
    the others and this process prints the failing rank's traceback and, last,
    one line saying which rank failed and why; the exit status is 1. SIGINT,
    SIGTERM or SIGHUP prints `interrupted` and exits with the shell's status for
    that signal. Under torchrun, each rank prints its own traceback and cause,
    and torchrun ends the others. Every line names `prog`, the command the user
    ran.
    """
    parser = make_parser(prog)
    config, world_size = parse_config(argv, parser)
    backend = launch.default_backend()
    if config.offload_optimizer == "auto" and backend != "nccl":
        parser.error("--offload-optimizer auto needs GPUs (it reads the CUDA "
                     "allocator's peak); give a fraction on CPU")

    if launch.under_torchrun():
        # torchrun started the processes and reports their failures itself.
        ranks = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != ranks:
            parser.error(f"--world-size {world_size} disagrees with torchrun's "
                         f"WORLD_SIZE={ranks}")
        if (why := peer_memory_refusal(config, ranks)) is not None:
            parser.error(why)
        checked = check_before_start(config, parser, world_size=ranks,
                                     backend=backend)
        if os.environ["RANK"] == "0":
            machine_facts(backend, ranks)
        launch.run_torchrun(train, config, checked.data.caches, backend=backend,
                            hang_timeout=config.hang_timeout)
        return 0

    if world_size is None:
        world_size = torch.cuda.device_count() if backend == "nccl" else 2
    if backend == "nccl" and world_size > torch.cuda.device_count():
        parser.error(f"--world-size {world_size} needs {world_size} GPUs, found "
                     f"{torch.cuda.device_count()}")
    if (why := peer_memory_refusal(config, world_size)) is not None:
        parser.error(why)
    try:
        # one handler from the checks to the ranks' end: a signal between the
        # token file's build and the ranks' start ends the job like one during
        # either
        with Signals():
            checked = check_before_start(config, parser, world_size=world_size,
                                         backend=backend)
            machine_facts(backend, world_size)
            # the ranks get the token files decided here (see [deciding
            # once](token_file.html)), not the task of deciding again
            launch.spawn(train, world_size, config, checked.data.caches,
                         backend=backend, hang_timeout=config.hang_timeout)
    except launch.RankFailed as e:
        # the failing rank's traceback, what the others hit after it, its cause
        before = [text for text in (e.traceback.strip(), *e.others) if text]
        if before:
            print(*before, sep="\n", file=sys.stderr)
        print(f"{prog}: error: {failure_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # launch.Interrupted: SIGINT, SIGTERM or SIGHUP
        print(f"{prog}: interrupted", file=sys.stderr)
        return getattr(e, "exit_status", 130)
    except Exception as e:  # the parent's own failure (e.g. the spawn itself)
        traceback.print_exc()
        print(f"{prog}: error: {failure_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
