r"""
---
title: FSDP2 with float8 linears
summary: The FSDP2 peer with torchao's float8 training: every transformer
  layer's matrix products in e4m3 with tensorwise scales, its weights
  all-gathered in fp8, the embedding and readout in bf16.
---

# FSDP2 with float8 linears

The engine `fsdp2_float8` is [FSDP2](baselines.html) as `build_fsdp2` builds
it, with torchao's float8 training on top, as torchtitan runs it: the peer at
its best where the matrices are large. Everything FSDP2 keeps stays: fp32
parameters sharded per transformer layer, fp32 gradients reduce-scattered,
fused `AdamW` on the fp32 shards, and with `--compile` each layer compiled
before it is sharded. What changes is inside the layers' linears.

## The float8 linear

`convert_to_float8_training` swaps each chosen `nn.Linear` for a
`Float8Linear`, which computes $y = x W^\top$ as

$$y = \frac{1}{s_x s_W}\,\bigl(\operatorname{fp8}(s_x x)\,
  \operatorname{fp8}(s_W W)^\top\bigr),
\qquad s_A = \frac{448}{\max |A|} \text{ for } A = x, W,$$

with one scale per tensor (tensorwise, the dynamic recipe), 448 the largest
e4m3 number
(tested: tests/layers/test_float8.py::test_the_formats_of_the_notes), and the product accumulated in fp32 by the fp8 tensor cores.
Backward does the same for the two gradient products, with the output
gradient cast to e5m2 (torchao's default for this recipe: 2 mantissa bits for
a range up to 57344
(tested: tests/layers/test_float8.py::test_the_formats_of_the_notes),
which gradients need more than precision). Each e4m3 cast
rounds to 3 mantissa bits, a relative error of at most $u = 2^{-4}$ against
bf16's $2^{-8}$ (below $2^{-6}$, e4m3's subnormals, an absolute error of at
most $2^{-10}$ before the scale is undone). So one product's element is off by
at most about $2u \sum_i |x_i| |W_{ji}|$, the bound the tests hold a
`Float8Linear` to, forward and backward; through the model the relative errors
of the products on a value's path add, as in the tests' tolerance rule,
with e4m3's $u$.

Three choices make it the strongest setting of this peer:

* **fp8 all-gather** (`enable_fsdp_float8_all_gather`): each rank casts its
  fp32 shard to e4m3 before FSDP2's all-gather, so a layer's gather moves 1
  byte a weight instead of bf16's 2, and the gathered weight is already the
  GEMM's operand. The cast needs the scale of the *whole* weight, which no
  rank has alone: `precompute_float8_dynamic_scale_for_fsdp` computes every
  converted weight's $\max|W|$ with one all-reduce after each optimizer step,
  and each rank casts its shard with it. It is part of the step here.
* **Which linears**: those of the transformer layers whose two dimensions are
  multiples of 16, the fp8 GEMM's alignment, and whose weight is large enough
  to gain (`fp8_linear`, the filter
  `to_float8` passes to torchao: labml_zero's own choice, so both engines
  run the same products in fp8). The embedding is a
  lookup and the readout stays bf16: its logits feed the loss directly, and
  torchtitan leaves it out for the same reason.
* **Compiled**: eagerly, the casts and the scale's reduction are separate
  kernels that read and write each operand once more than the product itself;
  compiled per layer (the same `compile_calls` as FSDP2's) Inductor fuses them
  into the neighbouring passes. The comparison of engines takes each at its
  best, so this peer's figure is its compiled one.

fp8 pays where the matrices are large: an e4m3 GEMM runs at twice bf16's
peak, but the casts cost a pass over each operand, a cost linear in the
matrix's size against the product's cubic one. With the width $d$ of a few
thousand (Pythia-6.9B, Llama-3.1-8B) the product dominates; at Pythia-160M's
768 the casts eat most of the gain.

## Memory

The model states are FSDP2's: the fp32 parameters are the masters and the
fp8 copies exist only gathered, during a layer's forward and backward. The
memory model and formula are therefore `fsdp2_memory`'s; a gathered layer
takes half its bf16 size.

## MFU against two peaks

The line's `mfu` is, as for every engine, the model's FLOPs over the dense
bf16 peak ([workloads](workloads.html)), so that the engines compare on one
scale. This engine's line also has `mfu_fp8`: the same FLOPs over the data
sheet's dense fp8 peak, 1978.9 TFLOP/s for an H100 or H200 SXM
(`PEAK_FLOPS` in [what a step shows](../labml_zero/finetune/step_metrics.html)),
the share of what the fp8 tensor cores could do. Not every FLOP is fp8 (the
readout, attention's two products), so `mfu_fp8` understates the use of the
fp8 units and `mfu` overstates that of the bf16 ones.

## Limitations

* torchao is optional, as DeepSpeed is: when `import torchao.float8` fails,
  the run reports why and skips the engine.
* The fused bias-GELU kernel (`--kernels bias_gelu`) reads the MLP's weight
  itself and would bypass the float8 product; this engine builds its MLP
  without it. The other kernels act between the products and are kept.
* On a CPU (the tests) there is no fp8 GEMM: torchao's `emulate` computes
  the product of the fp8-rounded operands in fp32 instead, the same values
  up to the order of the accumulation.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from labml_zero.launch import DistContext
from labml_zero.layers.float8 import to_float8
from labml_zero.neox.kernels import ModelKernels

from .baselines import (
    EngineUnavailable,
    adamw,
    fsdp2_formula,
    fsdp2_memory,
    fsdp2_model,
    trainable,
)
from .engine import Engine, lm_loss
from .workloads import DECODER_LAYERS, Workload

def import_float8():
    """`torchao.float8`, or `EngineUnavailable` saying why it does not import."""
    try:
        import torchao
        import torchao.float8 as float8
    except Exception as error:  # missing, or built against another torch
        raise EngineUnavailable(
            f"torchao is not installed or does not import: {error!r}") from error
    return torchao, float8


def float8_config(device: torch.device):
    """Tensorwise dynamic scaling, fp8 all-gather; emulated off the GPU."""
    _, float8 = import_float8()
    return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True,
                                     emulate=device.type != "cuda")


def convert_layers(layers: list[nn.Module], config) -> None:
    """
    ### The transformer layers' linears to `Float8Linear`, in place

    Only the repeating layers, with labml_zero's own choice of linears and
    swap ([fp8 linears](../labml_zero/layers/float8.html), `to_float8`: a
    linear whose dimensions are multiples of 16 and whose weight is large
    enough to gain, frozen weights kept frozen); the embedding, final norm
    and readout are left as they are. Emulated (the CPU's runs of tiny
    models, where no shape gains), every linear of such dimensions, so the
    fp8 path runs at all.
    """
    import_float8()
    for layer in layers:
        if isinstance(layer, DECODER_LAYERS):
            to_float8(layer, config=config, every_linear=config.emulate)


def without_weight_kernels(workload: Workload) -> Workload:
    """The workload with GPT-NeoX's fused bias-GELU off (see Limitations)."""
    kernels = workload.kernels
    if isinstance(kernels, ModelKernels) and kernels.bias_gelu:
        return replace(workload, kernels=replace(kernels, bias_gelu=False))
    return workload


def build_fsdp2_float8(ctx: DistContext, workload: Workload) -> Engine:
    """
    ## The engine

    FSDP2's model with the layers converted before they are compiled and
    sharded (torchtitan's order: float8, compile, `fully_shard`); the step
    is FSDP2's, then the scales of the next step's gathers.
    """
    torchao, float8 = import_float8()
    workload = without_weight_kernels(workload)
    config = float8_config(ctx.device)
    model, _, psi_t, psi_f = fsdp2_model(
        ctx, workload, convert=lambda layers: convert_layers(layers, config))
    offload = workload.offload is not None
    optimizer = adamw(trainable(model), fused=offload or ctx.device.type == "cuda")
    # the first step's gathers need scales too
    float8.precompute_float8_dynamic_scale_for_fsdp(model)

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # max|W| of every converted weight, one all-reduce for all of them
        float8.precompute_float8_dynamic_scale_for_fsdp(model)
        return loss.detach()

    from torchao.float8.float8_linear import Float8Linear

    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    return Engine(
        step=step,
        memory_model=fsdp2_memory(psi_t, psi_f, ctx.world_size, offload=offload),
        memory_formula=fsdp2_formula(offload) + "; fp8 weights only gathered",
        psi_trainable=psi_t,
        psi_frozen=psi_f,
        info={"torchao": torchao.__version__, "float8_linears": converted,
              "float8": "tensorwise e4m3, fp8 all-gather"
                        + (", emulated" if config.emulate else "")},
    )
