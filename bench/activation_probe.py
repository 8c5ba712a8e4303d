r"""
---
title: Probe: what a Llama layer and its loss keep for the backward pass
summary: One decoder layer and the final norm, readout and loss on the device,
  their saved tensors counted beside Llama's activation memory.
---

# Probe: what a Llama layer and its loss keep for the backward pass

The measurement behind [Llama's activation
memory](../labml_zero/llama/activation_memory.html), which counts from the
shapes what the tests check tensor by tensor on CPU. On the GPU the fused
kernels run compiled and the attention runs CUDA's kernels, so this probe
builds one decoder layer and the readout there and counts what autograd
saves:

```bash
python -m bench.activation_probe --model llama-3.2-1b --batch 8 --seq 2048 --kernels all
```

It prints one JSON line: for the layer and for the final norm, readout and
loss, the bytes of the distinct storages that
`torch.autograd.graph.saved_tensors_hooks` sees (parameters, the shared
rotary tables and int64 or 0-dim tensors left out, as the count leaves them
out) beside the count's. On CUDA it adds the most memory the loss allocated
in its forward and its backward pass, beside the count's peaks. `--model
tiny` runs on a CPU, where the fused kernels run as their plain twins: give
`--kernels none` there, or `loss`, whose CPU path is the CUDA one.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch

from labml_zero.llama import activation_memory as A
from labml_zero.llama.config import PRESETS, tiny
from labml_zero.llama.family import finetuner
from labml_zero.llama.kernels import LlamaKernels
from labml_zero.llama.model import build_layers

MODELS = {"tiny": tiny, **PRESETS}


def saved_bytes(fn, *, exclude) -> tuple[object, int]:
    """`fn()` and the bytes of the distinct storages autograd saved in it,
    but those of `exclude` and int64 or 0-dim tensors."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in skip and t.dtype != torch.int64 and t.dim() > 0:
            storages[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def probe(model: str, *, batch: int, seq: int, kernels: LlamaKernels,
          finetune: str, device: torch.device) -> dict:
    """
    ### Count one layer's and the loss's saved bytes, twice

    The first pass compiles the fused kernels; the second is counted. The
    layer's input needs a gradient, as every layer's but the first's does.
    """
    config = MODELS[model]()
    layers = build_layers(replace(config, n_layers=1), device=device,
                          dtype=torch.bfloat16, kernels=kernels)
    finetuner(finetune)(layers)
    layer, norm, readout = layers[1], layers[2], layers[3]
    params = [p for module in layers for p in module.parameters()]
    on_cuda = device.type == "cuda"
    for _ in range(2):
        x = torch.randn(batch, seq, config.d_model, device=device,
                        dtype=torch.bfloat16, requires_grad=True)
        # the tables the layer reads: keyed by the tensors' device, `cuda:0`
        rotary = layer.self_attn.rotary(seq, x.device, x.dtype)
        out, layer_saved = saved_bytes(lambda: layer(x), exclude=[*params, *rotary])
        out.sum().backward()
        del out, x
        x_last = torch.randn(batch, seq, config.d_model, device=device,
                             dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, config.n_vocab, (batch, seq), device=device)
        if on_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        loss, loss_saved = saved_bytes(lambda: readout(norm(x_last), targets),
                                       exclude=params)
        if on_cuda:
            forward_peak = torch.cuda.max_memory_allocated(device) - before
            after = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        loss.backward()
        if on_cuda:
            backward_peak = torch.cuda.max_memory_allocated(device) - after
        for p in params:
            p.grad = None
    size = dict(batch=batch, seq=seq, finetune=finetune, kernels=kernels)
    count = A.readout_loss_bytes(config, **size)
    # x_L was made before the first reading; the count holds it only where the
    # fused norm keeps it (the plain one keeps an fp32 copy, and x_L dies)
    x_bytes = x_last.untyped_storage().nbytes() if kernels.rms_norm else 0
    line = {"model": model, "batch": batch, "seq": seq, "kernels": kernels.names(),
            "finetune": finetune, "device": str(device),
            "layer_saved": layer_saved,
            "layer_count": A.layer_activation_bytes(config, **size),
            "loss_saved": loss_saved, "loss_count": count.saved}
    if on_cuda:
        line |= {"loss_forward_peak": forward_peak + x_bytes,
                 "loss_forward_count": count.forward_peak,
                 "loss_backward_peak": backward_peak + after - before + x_bytes,
                 "loss_backward_count": count.backward_peak}
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="What a Llama layer and its loss keep for the backward pass")
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--kernels", default="all",
                        help="'all', 'none' or fusion names, e.g. 'loss,rms_norm'")
    parser.add_argument("--finetune", default="all", choices=["all", "lora"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available()
                        else "cpu")
    args = parser.parse_args(argv)
    try:
        kernels = LlamaKernels.from_names(args.kernels)
        if args.batch < 1 or args.seq < 1:
            raise ValueError(f"--batch and --seq must be >= 1, got "
                             f"{args.batch} x {args.seq}")
        line = probe(args.model, batch=args.batch, seq=args.seq, kernels=kernels,
                     finetune=args.finetune, device=torch.device(args.device))
    except ValueError as error:
        print(f"activation_probe: {error}", file=sys.stderr)
        return 2
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
