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
is [the fine-tune page](neox/finetune.html); this page turns flags into a
`FinetuneConfig` and starts the processes:

* **one host**: `launch.spawn` starts `--world-size` processes (default: every
  GPU, or 2 on CPU);
* **torchrun**: when `RANK`, `WORLD_SIZE` and `LOCAL_RANK` are set, this process
  is one rank and joins the others (`launch.run_torchrun`).

Every flag is checked before a process starts, so a typo costs no start-up: a bad
flag or value prints one line on stderr and exits with status 2. Missing
directories (`--checkpoint`, `--resume`) count as bad values.

## Failure

If any rank raises, dies or hangs, [the launcher](launch.html) ends the others
and this process prints the failing rank's traceback and, last, one line saying
which rank failed and why; the exit status is 1. SIGINT or SIGTERM prints
`interrupted` and exits with the shell's status for that signal. Under
torchrun, each rank prints its own traceback and cause, and torchrun ends the
others.

## Limitations

* `--world-size` larger than the GPU count is refused on CUDA; on CPU the
  processes share the cores (one thread each).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn, Sequence

import torch

from labml_zero import launch
from labml_zero.neox.finetune import (DTYPES, FINETUNERS, MODEL_PRESETS,
                                      FinetuneConfig, train)

PROG = "python -m labml_zero.finetune_neox"


class Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (no usage block) and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


# argparse names the converter in its message ("invalid positive_int value").
positive_int.__name__ = "positive integer"


def fraction_or_auto(text: str) -> float | str:
    """`auto`, or a number (its range is checked by `FinetuneConfig`)."""
    return "auto" if text == "auto" else float(text)


fraction_or_auto.__name__ = "fraction or 'auto'"


def layer_list(text: str) -> tuple[int, ...]:
    layers = tuple(int(x) for x in text.split(",") if x.strip())
    if not layers or min(layers) < 0:
        raise ValueError
    return layers


layer_list.__name__ = "comma-separated layer list"


def make_parser() -> Parser:
    p = Parser(prog=PROG, description="Fine-tune GPT-NeoX with ZeRO-3 "
               "(labml_zero). With no arguments: the tiny model, random weights, "
               "Tiny Shakespeare, a few minutes on a laptop CPU.")
    d = FinetuneConfig()
    p.add_argument("--model", choices=list(MODEL_PRESETS),
                   help=f"model shape, random weights (default {d.model})")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face GPT-NeoX/Pythia snapshot (config.json + "
                        "safetensors); sets the model shape")
    p.add_argument("--finetune", choices=FINETUNERS, default=d.finetune,
                   help=f"what trains (default {d.finetune})")
    p.add_argument("--filter-layers", type=layer_list, metavar="0,1",
                   help="keep only these transformer layers")
    runs = p.add_mutually_exclusive_group()
    runs.add_argument("--steps", type=positive_int,
                      help=f"optimizer steps (default {d.steps})")
    runs.add_argument("--epochs", type=positive_int, help="run whole epochs "
                      "instead of --steps")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help=f"sequences per rank per micro-batch (default {d.batch_size})")
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum,
                   metavar="N", help="micro-batches per optimizer step")
    p.add_argument("--offload-optimizer", type=fraction_or_auto,
                   metavar="FRACTION|auto", default=d.offload_optimizer,
                   help="fraction of the optimizer states kept in host memory, "
                   "or auto: as little as makes the step fit (GPUs)")
    p.add_argument("--offload-params", type=float, metavar="FRACTION",
                   default=d.offload_params,
                   help="fraction of the parameter shards kept in host memory "
                   "(needs --offload-optimizer 1)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (Inductor on GPUs)")
    p.add_argument("--peer-memory", action="store_true",
                   help="gather and reduce through the other ranks' memory "
                   "(copy engines) instead of NCCL's kernels; one host")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute activations in the backward pass")
    p.add_argument("--clip-grad", type=float, metavar="NORM",
                   help="clip the global gradient norm")
    p.add_argument("--world-size", type=positive_int, metavar="N",
                   help="processes (default: every GPU, or 2 on CPU)")
    p.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                   help="write a sharded checkpoint every N steps and at the end")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint "
                   "written by --checkpoint-every")
    p.add_argument("--out", metavar="DIR", default=d.out,
                   help=f"run outputs (default {d.out})")
    p.add_argument("--log-dir", metavar="DIR", default=d.log_dir,
                   help=f"labml's runs directory (default {d.log_dir})")
    p.add_argument("--app-url", metavar="URL",
                   help="labml app API URL; used only if it answers within 2 s")
    p.add_argument("--valid-every", type=positive_int, default=d.valid_every,
                   metavar="N")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens,
                   metavar="N", help="tokens to generate at the end (0: none)")
    p.add_argument("--prompt", default=d.prompt,
                   help=f"prompt of that sample (default {d.prompt!r})")
    return p


def parse_config(argv: Sequence[str] | None, parser: Parser
                 ) -> tuple[FinetuneConfig, int | None]:
    """Flags → a checked config and the requested world size; exits 2 on bad input."""
    args = parser.parse_args(argv)
    if args.checkpoint is not None and args.model is not None:
        parser.error("give --model or --checkpoint, not both (the checkpoint's "
                     "config.json sets the shape)")
    if args.resume is not None and not Path(args.resume).is_dir():
        parser.error(f"--resume: checkpoint directory not found: {args.resume}")
    try:
        config = FinetuneConfig(
            model=args.model or FinetuneConfig.model,
            checkpoint=args.checkpoint, finetune=args.finetune,
            filter_layers=args.filter_layers, seq_len=args.seq_len,
            batch_size=args.batch_size, grad_accum=args.grad_accum,
            steps=None if args.epochs else (args.steps or FinetuneConfig.steps),
            epochs=args.epochs or FinetuneConfig.epochs, lr=args.lr,
            clip_grad=args.clip_grad, dtype=args.dtype,
            offload_optimizer=args.offload_optimizer,
            offload_params=args.offload_params,
            activation_checkpointing=args.activation_checkpointing,
            compile=args.compile, peer_memory=args.peer_memory,
            valid_every=args.valid_every, checkpoint_every=args.checkpoint_every,
            resume=args.resume, out=args.out, log_dir=args.log_dir,
            app_url=args.app_url, seed=args.seed,
            sample_tokens=args.sample_tokens, prompt=args.prompt)
        config.model_config()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return config, args.world_size


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


def main(argv: Sequence[str] | None = None) -> int:
    """
    ## Parse, check, launch; returns the exit status
    """
    parser = make_parser()
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
        if os.environ["RANK"] == "0":
            machine_facts(backend, ranks)
        launch.run_torchrun(train, config, backend=backend)
        return 0

    if world_size is None:
        world_size = torch.cuda.device_count() if backend == "nccl" else 2
    if backend == "nccl" and world_size > torch.cuda.device_count():
        parser.error(f"--world-size {world_size} needs {world_size} GPUs, found "
                     f"{torch.cuda.device_count()}")
    machine_facts(backend, world_size)
    try:
        launch.spawn(train, world_size, config, backend=backend)
    except launch.RankFailed as e:
        # the failing rank's traceback, what the others hit after it, its cause
        print(e.traceback.strip(), *e.others, sep="\n", file=sys.stderr)
        print(f"{PROG}: error: {failure_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # launch.Interrupted: SIGINT or SIGTERM
        print(f"{PROG}: interrupted", file=sys.stderr)
        return getattr(e, "exit_status", 130)
    except Exception as e:  # the parent's own failure (e.g. the spawn itself)
        traceback.print_exc()
        print(f"{PROG}: error: {failure_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
