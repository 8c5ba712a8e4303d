r"""
---
title: Host memory of the offline export
summary: The peak resident memory of python -m labml_zero.export for models of
  several sizes, beside the largest tensor and the output shard it should track.
---

# Host memory of the offline export

```bash
python -m bench.export_memory --model tiny --model pythia-160m --model pythia-1b
```

[The offline export](../labml_zero/export.html) claims its host memory is

$$M \approx M_0 + \max_p |p| + c\,B_{shard},$$

a constant $M_0$ (the interpreter, torch, the tokenizer), the largest tensor
as read (fp32 where the checkpoint keeps a master) and one output shard, which
safetensors copies once more while writing it ($c \le 2$), independent of
the model's size $\Psi$. For each model this script builds it sharded at world
size 1 (gloo, the host), in bf16 with random weights, saves it with the engine's
own `save_checkpoint` and the job's export record, then runs the export as a
child process and reads the child's peak resident set (`ru_maxrss` from
`os.wait4`). One JSON line per model; the `tiny` line is $M_0$ in practice.

Writing a 1B-parameter model takes its bf16 size on the host to build and
twice that on disk (checkpoint and export) under `--dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from labml_zero.finetune.checkpoints import export_meta
from labml_zero.finetune.config import MODEL_PRESETS, FinetuneConfig
from labml_zero.launch import spawn
from labml_zero.neox.model import build_layers, init_parameter
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.checkpoint import CheckpointReader, save_checkpoint

REPO = Path(__file__).resolve().parent.parent


def save_random(ctx, preset: str, path: str) -> None:
    """One rank: the model in bf16, random, saved with the job's export record."""
    config = FinetuneConfig(model=preset, dtype="bf16")
    neox = config.model_config()
    layers = build_layers(neox, device="meta")
    model = Zero3Sequential(zero3_layers(
        layers, device=ctx.device, config=ZeroConfig(dtype=torch.bfloat16),
        init_param=init_parameter(neox)))
    save_checkpoint(path, model, meta={"export": export_meta(config, model)})


def largest_read_bytes(path: Path) -> int:
    """The largest tensor the export assembles: fp32 where a master is saved."""
    reader = CheckpointReader(path)
    return max(p.numel * (4 if reader.chunk_of(name)["has_master"]
                          else reader.dtype(name).itemsize)
               for name, p in reader.params.items())


def measure(preset: str, work: Path, max_shard: int) -> dict:
    ckpt, out = work / f"{preset}-ckpt", work / f"{preset}-hf"
    spawn(save_random, 1, preset, str(ckpt), backend="gloo")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-m", "labml_zero.export", str(ckpt),
                              str(out), "--max-shard-size", str(max_shard)],
                             env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"the export of {preset} failed ({child.returncode})")
    model_bytes = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    row = {"model": preset, "export_bytes": model_bytes,
           "largest_tensor_read_bytes": largest_read_bytes(ckpt),
           "max_shard_bytes": max_shard,
           "peak_rss_bytes": usage.ru_maxrss * 1024}  # Linux reports KiB
    shutil.rmtree(ckpt)
    shutil.rmtree(out)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.export_memory")
    p.add_argument("--model", action="append", choices=tuple(MODEL_PRESETS),
                   help="repeat for several sizes (default: tiny, pythia-160m)")
    p.add_argument("--max-shard-size", type=int, default=256 * 2**20,
                   help="bytes per output shard (default 256 MiB)")
    p.add_argument("--dir", default=None, help="where to write (a temporary "
                   "directory, removed after, by default)")
    args = p.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="export-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    for preset in args.model or ["tiny", "pythia-160m"]:
        print(json.dumps(measure(preset, work, args.max_shard_size)), flush=True)
    if args.dir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
