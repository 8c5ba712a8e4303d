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

a constant $M_0$ (the interpreter, torch, the tokenizer), what reading the
largest tensor allocates (`read_bytes`: its fp32 bytes where the checkpoint
keeps a master; where a `"bf16-kahan"` one keeps a compensation instead, the
weight and their fp32 sum at once) and one output shard,
which safetensors copies once more while writing it ($c \le 2$), independent
of the model's size $\Psi$. For each model this script builds it sharded at world
size 1 (gloo, the host), in bf16 (one constant in every weight: `constant_fill`), saves it with the engine's
own `save_checkpoint` and the job's export record, then runs the export as a
child process and reads the child's peak resident set (`ru_maxrss` from
`os.wait4`). One JSON line per model; the `tiny` line is $M_0$ in practice.

A trainable bf16 chunk keeps an fp32 master beside its bf16 weights, so
writing a model takes 6 bytes a parameter on the host to build and as much
again for its checkpoint, and the export its bf16 size under `--dir`.
`--frozen` saves every weight frozen, without masters (2 bytes a parameter
each): how the 12B and 20B shapes fit a 128 GB host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from labml_zero.finetune.checkpoints import export_meta
from labml_zero.finetune.config import MODEL_PRESETS, FinetuneConfig
from labml_zero.launch import spawn
from labml_zero.neox.model import build_layers
from labml_zero.planner.sharding import zero3_layers
from labml_zero.zero3 import ZeroConfig, Zero3Sequential
from labml_zero.zero3.checkpoint import CheckpointReader, save_checkpoint
from labml_zero.zero3.checkpoint.export import ADD_NUMEL
from labml_zero.zero3.checkpoint.format import DTYPES

REPO = Path(__file__).resolve().parent.parent


def save_constant(ctx, preset: str, path: str, frozen: bool = False) -> None:
    """One rank: the model in bf16, saved with the job's export record;
    `frozen`, every weight frozen, so no chunk keeps an fp32 master."""
    config = FinetuneConfig(model=preset, dtype="bf16")
    neox = config.model_config()
    layers = build_layers(neox, device="meta")
    for p in (p for layer in layers for p in layer.parameters()):
        p.requires_grad_(not frozen)
    model = Zero3Sequential(zero3_layers(
        layers, device=ctx.device, config=ZeroConfig(dtype=torch.bfloat16),
        init_param=constant_fill))
    save_checkpoint(path, model, meta={"export": export_meta(config, model)})


def constant_fill(name: str, p: torch.Tensor) -> None:
    """The weights' values change neither the export's memory nor its bytes
    (safetensors stores them raw): one constant, no random numbers to draw."""
    p.fill_(0.01)


def read_bytes(reader: CheckpointReader, name: str) -> int:
    r"""
    The bytes `saved_tensors` holds at once to assemble parameter `name`
    of $n$ elements, $p$ bytes each in the chunk's dtype:

    * a saved master: read straight into an fp32 tensor, $4n$;
    * a weight alone: read in its dtype, $p n$;
    * a weight beside a compensation (`"bf16-kahan"`, no master,
      `add_compensation`): $w$ as read ($p n$) and $w + c$, a new fp32 tensor
      unless $w$ is fp32 ($4n$); $c$ is read into $w$'s buffer where their
      dtypes agree (else $c_b n$ more), and each slice of `ADD_NUMEL` that the
      add reads is widened to fp32 first ($4 \min(n, A)$, unless $c$ is
      fp32): $6n$ and a slice in bf16, three times the weight alone.
    """
    n = reader.params[name].numel
    if reader.chunk_of(name)["has_master"]:
        return 4 * n
    weight = reader.dtype(name)
    if not reader.adds_compensation(name):
        return weight.itemsize * n
    low = DTYPES[reader.states["dtypes"][reader.compensation]]
    wide = 0 if weight == torch.float32 else 4 * n
    apart = 0 if low == weight else low.itemsize * n
    widened = 0 if low == torch.float32 else 4 * min(n, ADD_NUMEL)
    return weight.itemsize * n + wide + apart + widened


def largest_read_bytes(path: Path) -> int:
    """The most that reading one tensor allocates (`read_bytes`), over the
    checkpoint's tensors."""
    reader = CheckpointReader(path)
    return max(read_bytes(reader, name) for name in reader.params)


def measure(preset: str, work: Path, max_shard: int, ckpt_dir: Path,
            frozen: bool) -> dict:
    ckpt, out = ckpt_dir / f"{preset}-ckpt", work / f"{preset}-hf"
    spawn(save_constant, 1, preset, str(ckpt), frozen, backend="gloo")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "labml_zero.export", str(ckpt),
                              str(out), "--max-shard-size", str(max_shard)],
                             env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"the export of {preset} failed ({child.returncode})")
    seconds = time.perf_counter() - started
    model_bytes = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    row = {"model": preset, "export_bytes": model_bytes,
           "largest_tensor_read_bytes": largest_read_bytes(ckpt),
           "masters": not frozen,
           "max_shard_bytes": max_shard,
           "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
           "export_s": round(seconds, 1)}
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
    p.add_argument("--checkpoint-dir", default=None, help="where to write the "
                   "checkpoint, when not beside the export (another disk, or "
                   "/dev/shm: a 20B model is 40 GB in each place)")
    p.add_argument("--frozen", action="store_true", help="save every weight "
                   "frozen: bf16 only, no fp32 master (a 12B model's masters "
                   "and weights, 6 bytes a parameter, do not fit beside its "
                   "checkpoint in a 128 GB host)")
    p.add_argument("--out", default=None, help="append the JSON lines here")
    args = p.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="export-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else work
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for preset in args.model or ["tiny", "pythia-160m"]:
        line = json.dumps(measure(preset, work, args.max_shard_size, ckpt_dir,
                                   args.frozen))
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    if args.dir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
