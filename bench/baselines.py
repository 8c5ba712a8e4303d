r"""
---
title: Baselines
summary: The same GPT-NeoX training step under PyTorch FSDP2, DDP and DeepSpeed ZeRO-3,
  with their own activation checkpointing and host offload for W5.
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

"AdamW with fp32 master weights", the setting of every workload, is met by all
three: FSDP2 and DDP keep the parameters themselves in fp32 (the master *is*
the parameter, and bf16 exists only as the gathered or autocast copy used by the matrix
products); DeepSpeed keeps bf16 parameters and a separate fp32 master.

A workload may ask for two more things (W5 asks for both):

* `activation_checkpointing`: every transformer layer is wrapped in
  `Recomputed`, which keeps only the layer's input for backward and runs the
  layer again there, with `torch.utils.checkpoint`'s non-reentrant variant. All
  three engines use the same wrapper.
* `offload='auto'`: each engine's own host offload, below. DDP has none and is
  skipped.

## FSDP2

As torchtitan does: build on the meta device, `fully_shard` each transformer
layer (one all-gather and one reduce-scatter per layer), then the root (the
embedding, final norm and readout), then `to_empty` on the GPU and
`reset_parameters`, so each rank only ever allocates its own shards. With
activation checkpointing the layer is wrapped first and the *wrapper* is
sharded (torchtitan's order), so FSDP2's hooks gather the parameters before the
recomputation in backward exactly as before the forward.

With `compile`, each transformer layer is compiled first, `module.compile()`
before `fully_shard` (torchtitan's order again, and that of the project's
compiled peer figures): its whole call is compiled, and FSDP2's hooks on it run
eagerly (FSDP2 marks them `torch._dynamo.disable`). With recomputation the
layer inside `Recomputed` is compiled, as ours is; the backend is the same as
ours ([compiled layers](../labml_zero/zero3/compiled.html)).

With offload, every group gets `CPUOffloadPolicy`: the fp32 shards live in
pinned host memory and are copied to the GPU only to be all-gathered; the
reduce-scattered fp32 gradients are copied back to the host, and `AdamW`
(fused, which torch also implements on the CPU) steps there. `to_empty` then
allocates the shards on the CPU, as torchtitan does with CPU offload. The GPU
keeps no model states between steps:

$$M_{\text{GPU}} = 0, \qquad
M_{\text{host}} = \frac{(4+4+8)\Psi_t + 4\Psi_f}{N_d}\ \text{per rank}.$$

## DDP

The whole fp32 model on every GPU, built there directly (no CPU copy);
`gradient_as_bucket_view=True` makes the gradients views into the all-reduce
buckets instead of a second copy. Forward runs under `torch.autocast(bf16)`.
A workload with `offload` is skipped (`EngineUnavailable`): DDP replicates
everything and has nothing to offload to.

## DeepSpeed ZeRO-3

`deepspeed.zero.Init` partitions each module's parameters as soon as the module
is constructed, so the full model never exists on one GPU. Parameters are built
by the modules' own constructors (PyTorch's default initialisation; the
`reset_parameters` that follows sees only empty placeholders), which changes the
starting loss but not the cost of a step. The optimizer is `torch.optim.AdamW`
(`torch_adam`, fused), so no DeepSpeed C++/CUDA extension has to be compiled at
start-up. Other ZeRO-3 settings are DeepSpeed's defaults.

With offload, `zero_optimization.offload_optimizer` is `{"device": "cpu",
"pin_memory": true}` (the whole optimizer: ratio 1). `torch_adam` still holds:
DeepSpeed builds its compiled `DeepSpeedCPUAdam` only when `torch_adam` is off,
and with it on it steps `torch.optim.AdamW` on the host partitions (fused on the
CPU), slower than its AVX kernel but with nothing to compile. What DeepSpeed
0.19 then keeps where (`stage3.py`: with the optimizer offloaded its "device"
is the CPU):

* GPU: the bf16 parameter partitions, $2\Psi / N_d$; the gradient partitions
  go straight to the host as each bucket is reduce-scattered;
* host: the fp32 master partitions (4), Adam's moments (8), an fp32 gradient
  buffer for the optimizer (4) and the bf16 partition the reduced gradients are
  first copied into (2, its gradient accumulation buffer):

$$M_{\text{GPU}} = \frac{2\Psi}{N_d}, \qquad
M_{\text{host}} = \frac{(4+8+4+2)\Psi_t}{N_d}\ \text{per rank}.$$

`offload_optimizer.ratio` (ZeRO-3 only) keeps the optimizer of the first
$1 - \text{ratio}$ of the sub-groups on the GPU ("Twin-Flow"), which is the
closest peer of our automatic placement. It is not used: DeepSpeed 0.19 asserts
that the host optimizer is `DeepSpeedCPUAdam` whenever the ratio is below 1
("Hybrid Optimizer Only Supports DeepSpeedCPUAdam"), which needs its compiled
extension, and full offload is the documented standard set-up.

## Offload (W5)

GPT-NeoX-20B has $\Psi = 20.55 \cdot 10^9$ parameters, all trained in W5, on
$N_d = 2$ GPUs of one host with 256 GiB ($275 \cdot 10^9$ bytes) of memory.

* **FSDP2**, everything on the host: $16\Psi / 2 = 164$ GB per rank, $329$ GB
  ($306$ GiB) for the two ranks, more than the host has. The shards (41 GB a
  rank) and the gradients (41 GB) fit; Adam's moments, created at the first
  optimizer step, do not: we expect a host out-of-memory during step 1.
* **DeepSpeed**, the optimizer on the host: $18\Psi / 2 = 185$ GB per rank,
  $370$ GB ($344$ GiB) for the two, also more than the host. The masters and
  the two gradient buffers (10 B a parameter, 206 GB for both ranks) are
  allocated by `deepspeed.initialize`; the moments at the first step no longer
  fit.
* On the GPUs, both would fit easily: FSDP2 keeps no model states there,
  DeepSpeed $2\Psi / 2 = 21$ GB.

An out-of-memory on the host is a result, not a failure of the benchmark: it
says that offloading *all* of the optimizer, as these engines do, costs 16 to 18
bytes of host memory per parameter and rank share, where ours offloads only the
chunks that do not fit on the GPU (see [workloads](workloads.html)). The run's
host-memory watchdog reports it.

## Limitations

* DeepSpeed is optional: when `import deepspeed` fails, the run reports the
  reason and skips it.
* `compile` is implemented for FSDP2, DDP (and ours); the run skips DeepSpeed
  when it is asked for.
* DeepSpeed ZeRO-3 with non-reentrant checkpointing fails in 0.19 when a layer
  has *frozen* parameters (its forward hooks free them while the recomputation
  still refers to them; deepspeedai/DeepSpeed#8130). W5 trains everything, so
  it is not affected; a bias-only workload with checkpointing would be.
* The memory models count model states only: activations, gathered layers,
  communication buckets and pinned staging buffers come on top. Pinned host
  memory comes from torch's caching host allocator, which rounds each block up
  to a power of two, so the pinned states may take up to twice their size.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labml_zero.launch import DistContext
from labml_zero.neox.finetuners import finetuner
from labml_zero.layers.layer_list import LayerChain
from labml_zero.neox.model import TransformerLayer
from labml_zero.zero3.compiled import default_compile_backend
from labml_zero.planner.memory_model import zero_model_states

from .engine import (
    LEARNING_RATE,
    WEIGHT_DECAY,
    Engine,
    InitialWeights,
    lm_loss,
    meta_layers,
)
from .workloads import DECODER_LAYERS, Workload, model_layers


class EngineUnavailable(Exception):
    """The engine cannot run here; the message says why (reported, not an error)."""


def adamw(params: list[nn.Parameter], *, fused: bool) -> torch.optim.AdamW:
    """`torch.optim.AdamW`; `fused` runs one kernel for all tensors (CUDA or CPU)."""
    return torch.optim.AdamW(
        params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, fused=fused
    )


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def plain_step(model: nn.Module, optimizer, *, autocast_device: str | None = None):
    """A step for engines driven by a plain torch optimizer."""

    def step(batch: torch.Tensor) -> torch.Tensor:
        if autocast_device is None:
            loss = lm_loss(model, batch)
        else:
            with torch.autocast(autocast_device, dtype=torch.bfloat16):
                loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# ## Activation checkpointing


class Recomputed(nn.Module):
    """
    ## A layer whose activations are recomputed in backward

    Forward keeps only the input `[B, T, d]`; backward runs `layer` again to
    rebuild what its own backward needs. Non-reentrant: the recomputation is
    driven by autograd's saved-tensor hooks, so module hooks (FSDP2's gathers,
    DeepSpeed's fetches) fire around it as around any forward, and parameters
    need not be inputs. Without gradients (evaluation) it is the plain layer.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.layer(x)
        return checkpoint(self.layer, x, use_reentrant=False)


def compile_calls(layers: list[nn.Module], workload: Workload,
                  device: torch.device) -> None:
    """
    ## Each transformer layer's whole call compiled, its rotary tables made first

    `module.compile()` compiles `nn.Module.__call__`, hooks included, so the
    layer's pre-hook that makes the rotary tables' entry runs inside the
    trace, where it does nothing ([the model](../labml_zero/neox/model.html),
    `prepare_rotary_tables`). The entry is made here instead, once, for the
    step's length in bf16 (the peers compute in bf16: FSDP2's parameter
    dtype, DDP's autocast), so the compiled attention reads the tables as
    ours does rather than computing the angles for every element.
    """
    for layer in layers:
        if isinstance(layer, TransformerLayer) and workload.model.rotary_dim > 0:
            layer.attention.rotary_tables(workload.seq, device, torch.bfloat16)
        elif isinstance(layer, DECODER_LAYERS):
            # Llama's `LlamaRotary`, the same cache: the first call at a
            # length builds the tables, later calls (the traced one) read them
            layer.self_attn.rotary(workload.seq, device, torch.bfloat16)
        if isinstance(layer, DECODER_LAYERS):
            layer.compile(backend=default_compile_backend(device))


def with_recompute(layers: list[nn.Module], workload: Workload) -> list[nn.Module]:
    """The layers, each transformer layer wrapped in `Recomputed` if asked for."""
    if not workload.activation_checkpointing:
        return list(layers)
    return [Recomputed(m) if isinstance(m, DECODER_LAYERS) else m for m in layers]


# ## Memory models


def fsdp2_memory(psi_t: int, psi_f: int, world_size: int, *,
                 offload: bool) -> dict[str, int]:
    r"""
    ### FSDP2's model states per rank, on the GPU and on the host

    fp32 parameters (4), fp32 gradients (4) and Adam's moments (8) per trainable
    parameter, the parameter alone (4) per frozen one, all over $N_d$; all of
    it in `zero_states` (the GPU), or all of it in `host_states` with offload.
    """
    states = zero_model_states(psi_t, psi_f, world_size, param_bytes=4,
                               grad_bytes=4, optimizer_bytes=8)
    if offload:
        return {"zero_states": 0, "host_states": states}
    return {"zero_states": states}


def deepspeed_memory(psi_t: int, psi_f: int, world_size: int, *,
                     offload: bool) -> dict[str, int]:
    r"""
    ### DeepSpeed ZeRO-3's model states per rank, on the GPU and on the host

    Without offload, the ZeRO paper's $(2+2+12)\Psi_t + 2\Psi_f$ over $N_d$.
    With the optimizer offloaded, the GPU keeps the bf16 partitions ($2\Psi$)
    and the host the master, the moments and two gradient partitions, fp32 and
    bf16 ($4+8+4+2$ per trainable parameter; see DeepSpeed ZeRO-3 above).
    """
    if not offload:
        return {"zero_states": zero_model_states(
            psi_t, psi_f, world_size, param_bytes=2, grad_bytes=2,
            optimizer_bytes=12)}
    return {
        "zero_states": zero_model_states(psi_t, psi_f, world_size, param_bytes=2,
                                         grad_bytes=0, optimizer_bytes=0),
        "host_states": zero_model_states(psi_t, 0, world_size, param_bytes=4,
                                         grad_bytes=4 + 2, optimizer_bytes=8),
    }


# ## FSDP2


def fsdp2_model(ctx: DistContext, workload: Workload, *,
                convert=None) -> tuple[nn.Module, list[nn.Module], int, int]:
    r"""
    ### The model under FSDP2, as the section above builds it

    Returns the sharded `LayerChain`, its layers (the unwrapped ones, which the
    initial weights are copied into), $\Psi_t$ and $\Psi_f$. `convert`, if
    given, rewrites the meta layers in place before anything is compiled or
    sharded (the [float8 peer](float8_peer.html) swaps the layers' linears).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # the run's seed, set by `bench.run` just before building, read before
    # anything below draws or reseeds
    seed = torch.initial_seed()
    layers, psi_t, psi_f = meta_layers(workload)
    if convert is not None:
        convert(layers)
    modules = with_recompute(layers, workload)
    model = LayerChain(*modules)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    offload = workload.offload is not None
    # Pinned host memory makes the copies to and from the GPU asynchronous;
    # without a GPU there is nothing to pin for.
    offload_policy = (CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
                      if offload else OffloadPolicy())
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    shard = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload_policy}
    # 0. with compile, each transformer layer's call is compiled before its hooks
    #    are installed
    if workload.compile:
        compile_calls(layers, workload, ctx.device)
    # 1. one FSDP group per transformer layer (or its Recomputed wrapper), in
    #    execution order
    for module in modules:
        if isinstance(module, (*DECODER_LAYERS, Recomputed)):
            fully_shard(module, **shard)
    # 2. the root group: embedding, final norm, readout
    fully_shard(model, **shard)
    # 3. each rank allocates and initialises only its shards (DTensor locals),
    #    on the host when they are to live there
    model.to_empty(device="cpu" if offload else ctx.device)
    InitialWeights(workload, seed=seed, device=ctx.device).copy_into(layers)
    return model, layers, psi_t, psi_f


def fsdp2_formula(offload: bool) -> str:
    formula = "(4+4+8)·Ψt/N + 4·Ψf/N (fp32 params are the masters)"
    if offload:
        formula = "GPU: 0; host: " + formula + ", CPUOffloadPolicy"
    return formula


def build_fsdp2(ctx: DistContext, workload: Workload) -> Engine:
    model, _, psi_t, psi_f = fsdp2_model(ctx, workload)
    offload = workload.offload is not None
    # With offload the optimizer steps host tensors: fused has a CPU kernel.
    optimizer = adamw(trainable(model), fused=offload or ctx.device.type == "cuda")
    return Engine(
        step=plain_step(model, optimizer),
        memory_model=fsdp2_memory(psi_t, psi_f, ctx.world_size, offload=offload),
        memory_formula=fsdp2_formula(offload),
        psi_trainable=psi_t,
        psi_frozen=psi_f,
    )


# ## DDP


def build_ddp(ctx: DistContext, workload: Workload) -> Engine:
    from torch.nn.parallel import DistributedDataParallel

    if workload.offload is not None:
        raise EngineUnavailable(
            f"DDP has no offload (workload {workload.name} asks for offload="
            f"{workload.offload!r}): it replicates every model state on each GPU"
        )
    # fp32 on the device, with every engine's initial weights
    layers = model_layers(workload, device="meta")
    count = finetuner(workload.finetune)(layers)
    for layer in layers:
        layer.to_empty(device=ctx.device)
    InitialWeights(workload, seed=torch.initial_seed(),
                   device=ctx.device).copy_into(layers)
    psi_t, psi_f = count.trainable, count.total - count.trainable
    # with compile, each transformer layer's call is compiled, as in FSDP2 above;
    # DDP's hooks are on the parameters' gradients, outside the compiled graphs
    if workload.compile:
        compile_calls(layers, workload, ctx.device)
    model = DistributedDataParallel(
        LayerChain(*with_recompute(layers, workload)),
        device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    optimizer = adamw(trainable(model), fused=ctx.device.type == "cuda")
    return Engine(
        step=plain_step(model, optimizer, autocast_device=ctx.device.type),
        memory_model={"zero_states": zero_model_states(
            psi_t, psi_f, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=8)},
        memory_formula="(4+4+8)·Ψt + 4·Ψf, replicated (N = 1); autocast's bf16 "
        "weight copies not counted",
        psi_trainable=psi_t,
        psi_frozen=psi_f,
    )


# ## DeepSpeed ZeRO-3


def deepspeed_config(workload: Workload, device: torch.device) -> dict:
    zero: dict = {"stage": 3}
    if workload.offload is not None:
        # The whole optimizer (ratio 1) in pinned host memory; see the notes.
        zero["offload_optimizer"] = {
            "device": "cpu", "pin_memory": device.type == "cuda"
        }
    return {
        "train_micro_batch_size_per_gpu": workload.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": LEARNING_RATE,
                "weight_decay": WEIGHT_DECAY,
                # torch.optim.AdamW instead of DeepSpeed's JIT-compiled FusedAdam
                # (GPU) or DeepSpeedCPUAdam (offload)
                "torch_adam": True,
                "adam_w_mode": True,
                # on the GPU partitions, or on the host ones with offload: torch
                # has a fused kernel for both
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
    # the plain model (see `Workload.kernels`)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        layers = model_layers(workload, device=ctx.device, plain=True)
    finetuner(workload.finetune)(layers)
    # Partitioned parameters report numel() 0: count on a meta copy instead.
    _, psi_t, psi_f = meta_layers(workload)
    # The wrappers own no parameters, so they need not be built under Init.
    model = LayerChain(*with_recompute(layers, workload))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trainable(model), config=config
    )

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(engine, batch)
        engine.backward(loss)
        engine.step()  # also zeroes the gradients
        return loss.detach()

    offload = workload.offload is not None
    formula = "(2+2+12)·Ψt/N + 2·Ψf/N (ZeRO paper)"
    if offload:
        formula = "GPU: 2·Ψ/N (bf16 params); host: (4+8+4+2)·Ψt/N (master, Adam, " \
            "fp32 and bf16 grads), offload_optimizer"
    return Engine(
        step=step,
        memory_model=deepspeed_memory(psi_t, psi_f, ctx.world_size, offload=offload),
        memory_formula=formula,
        psi_trainable=psi_t,
        psi_frozen=psi_f,
        info={"deepspeed": deepspeed.__version__},
    )
