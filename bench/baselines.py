r"""
---
title: Baselines
summary: The same GPT-NeoX training step under PyTorch FSDP2, DDP and DeepSpeed ZeRO-3.
---

# Baselines

Each builder returns an [`Engine`](engine.html) around the same layers, loss and
data as ours; what differs is how parameters, gradients and optimizer states are
placed and in which dtypes.

* **FSDP2**: fp32 parameters, sharded; gathered as bf16 for the computation;
  gradients reduced in fp32; fused `AdamW` on the fp32 shards. Model states per
  rank $\frac{(4+4+8)\Psi_t + 4\Psi_f}{N_d}$.
* **DDP**: fp32 parameters, replicated; bf16 computation under `torch.autocast`;
  gradients all-reduced in fp32; fused `AdamW`. $(4+4+8)\Psi_t + 4\Psi_f$ per
  rank.
* **DeepSpeed ZeRO-3**: bf16 parameters, sharded; gradients reduced in bf16 (its
  default); `AdamW` on fp32 master partitions.
  $\frac{(2+2+12)\Psi_t + 2\Psi_f}{N_d}$ per rank.

"AdamW with fp32 master weights" (`ANCHORS.md`) is met by all three: FSDP2 and
DDP keep the parameters themselves in fp32 (the master *is* the parameter, and
bf16 exists only as the gathered or autocast copy used by the matrix
products); DeepSpeed keeps bf16 parameters and a separate fp32 master.

## FSDP2

As torchtitan does: build on the meta device, `fully_shard` each transformer
layer (one all-gather and one reduce-scatter per layer), then the root (the
embedding, final norm and readout), then `to_empty` on the GPU and
`reset_parameters`, so each rank only ever allocates its own shards.

## DDP

The whole fp32 model on every GPU, built there directly (no CPU copy);
`gradient_as_bucket_view=True` makes the gradients views into the all-reduce
buckets instead of a second copy. Forward runs under `torch.autocast(bf16)`.

## DeepSpeed ZeRO-3

`deepspeed.zero.Init` partitions each module's parameters as soon as the module
is constructed, so the full model never exists on one GPU. Parameters are built
by the modules' own constructors (PyTorch's default initialisation; the
`reset_parameters` that follows sees only empty placeholders), which changes the
starting loss but not the cost of a step. The optimizer is `torch.optim.AdamW`
(`torch_adam`, fused on CUDA), so no DeepSpeed C++/CUDA extension has to be
compiled at start-up. Other ZeRO-3 settings are DeepSpeed's defaults.

## Limitations

* DeepSpeed is optional: when `import deepspeed` fails, the run reports the
  reason and skips it.
* No `torch.compile` anywhere (ours is eager too); `ANCHORS.md` gives compiled
  FSDP2 figures for reference.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from labml_zero.launch import DistContext
from labml_zero.neox.finetuners import finetuner
from labml_zero.neox.model import TransformerLayer, build_layers
from labml_zero.zero3.memory_model import zero_model_states

from .engine import (
    LEARNING_RATE,
    WEIGHT_DECAY,
    Engine,
    lm_loss,
    meta_layers,
)
from .workloads import Workload


def adamw(params: list[nn.Parameter], device: torch.device) -> torch.optim.AdamW:
    """`torch.optim.AdamW`, fused (one kernel for all tensors) on CUDA."""
    return torch.optim.AdamW(
        params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
        fused=device.type == "cuda",
    )


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def plain_step(model: nn.Module, optimizer, *, autocast_device: str | None = None):
    """A step for engines driven by a plain torch optimizer."""

    def step(batch: torch.Tensor) -> torch.Tensor:
        if autocast_device is None:
            logits = model(batch[:, :-1])  # [B, T, V] bf16
        else:
            with torch.autocast(autocast_device, dtype=torch.bfloat16):
                logits = model(batch[:, :-1])  # [B, T, V] bf16
        loss = lm_loss(logits, batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# ## FSDP2


def build_fsdp2(ctx: DistContext, workload: Workload) -> Engine:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers, psi_t, psi_f = meta_layers(workload)
    model = nn.Sequential(*layers)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    # 1. one FSDP group per transformer layer, in execution order
    for layer in layers:
        if isinstance(layer, TransformerLayer):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    # 2. the root group: embedding, final norm, readout
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # 3. each rank allocates and initialises only its shards (DTensor locals)
    model.to_empty(device=ctx.device)
    with torch.no_grad():
        for layer in layers:
            layer.reset_parameters()
    optimizer = adamw(trainable(model), ctx.device)
    sizes = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    return Engine(
        step=plain_step(model, optimizer),
        memory_model={
            "zero_states": zero_model_states(psi_t, psi_f, ctx.world_size, **sizes)
        },
        memory_formula="(4+4+8)·Ψt/N + 4·Ψf/N (fp32 params are the masters)",
        psi_trainable=psi_t,
        psi_frozen=psi_f,
    )


# ## DDP


def build_ddp(ctx: DistContext, workload: Workload) -> Engine:
    from torch.nn.parallel import DistributedDataParallel

    # fp32 on the device directly, initialised there.
    layers = build_layers(workload.model, device=ctx.device)
    count = finetuner(workload.finetune)(layers)
    psi_t, psi_f = count.trainable, count.total - count.trainable
    model = DistributedDataParallel(
        nn.Sequential(*layers),
        device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    optimizer = adamw(trainable(model), ctx.device)
    sizes = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    return Engine(
        step=plain_step(model, optimizer, autocast_device=ctx.device.type),
        memory_model={"zero_states": zero_model_states(psi_t, psi_f, 1, **sizes)},
        memory_formula="(4+4+8)·Ψt + 4·Ψf, replicated (N = 1); autocast's bf16 "
        "weight copies not counted",
        psi_trainable=psi_t,
        psi_frozen=psi_f,
    )


# ## DeepSpeed ZeRO-3


class EngineUnavailable(Exception):
    """The engine cannot run here; the message says why (reported, not an error)."""


def deepspeed_config(workload: Workload, device: torch.device) -> dict:
    return {
        "train_micro_batch_size_per_gpu": workload.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LEARNING_RATE,
                "weight_decay": WEIGHT_DECAY,
                # torch.optim.AdamW instead of DeepSpeed's JIT-compiled FusedAdam
                "torch_adam": True,
                "adam_w_mode": True,
                "fused": device.type == "cuda",
            },
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(ctx: DistContext, workload: Workload) -> Engine:
    # DeepSpeed reads who it is from the environment (its launcher sets these);
    # the process group itself already exists and DeepSpeed reuses it.
    os.environ["LOCAL_RANK"] = str(ctx.local_rank)
    os.environ["RANK"] = str(ctx.rank)
    os.environ["WORLD_SIZE"] = str(ctx.world_size)
    try:
        import deepspeed
    except Exception as error:  # ImportError, or a broken install raising anything
        raise EngineUnavailable(f"import deepspeed failed: {error!r}") from error

    config = deepspeed_config(workload, ctx.device)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        layers = build_layers(workload.model, device=ctx.device)
    finetuner(workload.finetune)(layers)
    # Partitioned parameters report numel() 0: count on a meta copy instead.
    _, psi_t, psi_f = meta_layers(workload)
    model = nn.Sequential(*layers)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trainable(model), config=config
    )

    def step(batch: torch.Tensor) -> torch.Tensor:
        logits = engine(batch[:, :-1])  # [B, T, V] bf16
        loss = lm_loss(logits, batch[:, 1:])
        engine.backward(loss)
        engine.step()  # also zeroes the gradients
        return loss.detach()

    sizes = dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    return Engine(
        step=step,
        memory_model={
            "zero_states": zero_model_states(psi_t, psi_f, ctx.world_size, **sizes)
        },
        memory_formula="(2+2+12)·Ψt/N + 2·Ψf/N (ZeRO paper)",
        psi_trainable=psi_t,
        psi_frozen=psi_f,
        info={"deepspeed": deepspeed.__version__},
    )
