r"""
---
title: Benchmark workloads
summary: The GPT-NeoX and Llama training jobs every engine runs, and the FLOPs a token costs.
---

# Benchmark workloads

Each workload is a model shape, a per-GPU micro-batch and a fine-tuner, the same
for every engine: GPT-NeoX or Llama layers (`model_layers`), random
initialisation, random tokens, bf16 computation, AdamW with fp32 master
weights and moments (`--optimizer-states` gives labml_zero, and the update
floor, another of the fine-tune's [state
layouts](../labml_zero/zero3/state_layout.html); the peers keep fp32).

| name | model | per-GPU batch × sequence | trains |
| --- | --- | --- | --- |
| W1 | Pythia-1.4B | 8 × 2048 | everything |
| W2 | Pythia-6.9B | 2 × 2048 | everything |
| W3 | GPT-NeoX-20B | 16 × 128 | biases only |
| W4 | Pythia-160M | 16 × 1024 | everything |
| W5 | GPT-NeoX-20B | 4 × 2048 | everything; recomputation, offload |
| W3R | GPT-NeoX-20B | 16 × 128 | biases only, frozen chunks resident (labml_zero) |
| W6 | Pythia-12B | 2 × 2048 | everything; recomputation, offload; one GPU |
| W2-1 | Pythia-6.9B | 2 × 2048 | everything; recomputation; one GPU |
| W2-1O | Pythia-6.9B | 2 × 2048 | everything; recomputation, offload; one GPU |
| L1 | Llama-3.2-1B, untied | 8 × 2048 | everything |
| L2 | Llama-3.1-8B | 2 × 2048 | everything; recomputation |

W5 is the capability job of heterogeneous memory: its model states alone,
$(2 + 4 + 12) \cdot 20.6 \cdot 10^9 / 2 = 185$ GB per rank, do not fit an H200
(149 GB), so each engine runs it with its own offload: labml_zero places the
optimizer states of whole chunks in host memory by the
[automatic placement](../labml_zero/planner/placement.html) (the first step
measured, then as few chunks offloaded as make it fit), PyTorch FSDP2 with
`CPUOffloadPolicy` (parameters, gradients and optimizer all on the host),
DeepSpeed ZeRO-3 with `offload_optimizer` to the CPU. DDP is not run on it.

W6 is the same job on one GPU (`--world-size 1`): Pythia-12B's
$18 \cdot 11.85 \cdot 10^9 = 213$ GB of model states do not fit one H200
either. Its tokens per step are a choice: `--batch 2,4,8` runs it (like any
workload) once per micro-batch size, and an out-of-memory error, device or host,
is a line of its own. W2-1 is Pythia-6.9B, $18 \cdot 6.86 \cdot 10^9 = 123$ GB
of model states, on one GPU with recomputation and no offload, every engine
as it is; W2-1O is the same with each engine's offload, for the engines that do
not fit without it.

L1 and L2 are the [Llama model](../labml_zero/llama/model.html), built from
its presets by every engine. Llama-3.2-1B ties its readout to its embedding;
L1 runs the same shape with the readout a matrix of its own, $V d$ =
{{py: workloads.workloads()['L1'].model.n_vocab *
workloads.workloads()['L1'].model.d_model | ,}} parameters more, as it was
first measured, when labml_zero's layer-by-layer sharding refused a parameter
of two layers (it now holds a tied matrix in its first layer: the [sharded
model](../labml_zero/zero3/sharded_model.html)). L2's $18 \cdot 8
\cdot 10^9$ bytes of model states are spread over the GPUs.

## FLOPs per token

For model FLOPs utilisation (MFU) we count, as the peers do, the matrix products
only (for Llama, [its FLOPs page](../labml_zero/llama/flops.html)'s count,
the same formula with its three MLP matrices and grouped K and V). With $N$ the parameters of the matrix products (the four weight matrices
of every layer and the readout; the embedding is a lookup), $L$ layers, sequence
length $T$ and width $d$, a token costs

$$F = 6N + 12 L T d$$

in a full training step: $2N$ forward, $2N$ for the gradients of the activations
and $2N$ for those of the weights, and $4LTd$ for the two attention products
($QK^\top$ and the weighted sum of $V$) forward, three times over. Training the
biases only skips the weight gradients of the matrices, so $F = 4N + 12LTd$. MFU
is $F$ times the tokens per second of one GPU, over its dense bf16 peak from
the data sheet, 989.4 TFLOP/s on an H200: the job's own
[`mfu`](../labml_zero/finetune/step_metrics.html), by the device's name; a GPU
not in its table (or a CPU) gets none.

## Limitations

* The attention term counts the whole $T \times T$ score matrix although the
  causal mask makes half of it unnecessary, as the usual formula does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from labml_zero.families import family_for_config
from labml_zero.finetune import step_metrics
from labml_zero.llama import model as llama_model
from labml_zero.llama.config import LlamaConfig, llama_3_1_8b, llama_3_2_1b
from labml_zero.llama.kernels import LlamaKernels
from labml_zero.neox import model as neox_model
from labml_zero.neox.model import (
    ModelKernels,
    NeoXConfig,
    gpt_neox_20b,
    pythia_160m,
    pythia_1_4b,
    pythia_6_9b,
    pythia_12b,
)
from labml_zero.planner.step_time import model_flops_per_token
from labml_zero.zero3.state_layout import LAYOUTS as STATE_LAYOUTS

FINETUNES = ("all", "biases")
# eager steps of a `cuda_graph` workload before its step is recorded: the
# optimizer's state, NCCL's communicators and the prefetch order exist by then
GRAPH_WARMUP = 2


@dataclass(frozen=True)
class Workload:
    """
    ## One training job
    """

    name: str
    """Short name, `W1`..`W6`; `tiny` workloads keep it."""
    model: NeoXConfig | LlamaConfig
    """The model shape, GPT-NeoX's or Llama's; initialised at random."""
    batch: int
    """Sequences per GPU per step (the micro-batch; no gradient accumulation)."""
    seq: int
    """Tokens per sequence, $T$."""
    finetune: str = "all"
    """`'all'` (full fine-tune) or `'biases'` (the bias-only fine-tuner)."""
    chunk_numel: int | None = None
    """labml_zero's chunk size; `None` lets the engine search for it."""
    activation_checkpointing: bool = False
    """Recompute each transformer layer's activations in backward."""
    offload: str | float | None = None
    """`None`: everything on the GPUs. `'auto'`: each engine's host offload of
    the optimizer (see W5); labml_zero decides how much from the first step.
    A fraction in $(0, 1]$: labml_zero offloads at least that share of the
    trainable elements' optimizer state, whole chunks from the output end (the
    fine-tune's `--offload-optimizer`, the planner's choice under `--auto`)."""
    resident: bool = False
    """labml_zero keeps frozen chunks gathered where memory allows, decided from
    a probe step (W3R); the other engines run as without it."""
    compile: bool = False
    """Compile each transformer layer with `torch.compile` (`--compile`); the
    embedding, final norm and readout stay eager. Each engine says how in its
    builder ([ours](engine.html), [FSDP2](baselines.html))."""
    cuda_graph: bool = False
    """labml_zero records its whole step as one CUDA graph after the warm-up and
    replays it (`--cuda-graph`, [the step as one CUDA
    graph](../labml_zero/optimizers/graphed_step.html)); the other engines run
    eagerly."""
    prefetch_depth: int = 1
    """labml_zero's prefetch depth, the units gathered ahead of the one that
    computes (`--prefetch-depth`); the other engines keep their own."""
    peer_gather: bool = False
    """labml_zero gathers chunks by copying the shards out of the other GPUs'
    memory on the copy engines (`--peer-gather`, [peer
    memory](../labml_zero/zero3/peer_memory.html)); the other engines keep NCCL."""
    peer_reduce: bool = False
    """labml_zero reduce-scatters through a workspace in the other GPUs' memory,
    bf16 gradients sent in bf16 and averaged in fp32 (`--peer-reduce`)."""
    kernels: ModelKernels | LlamaKernels | None = None
    """The model's fused kernels ([GPT-NeoX's](../labml_zero/neox/kernels.html),
    [Llama's](../labml_zero/llama/kernels.html)) (`--kernels`), the same for
    every engine but DeepSpeed, whose hooks gather a submodule's weights only
    when that submodule is called: it runs the plain model. `None` is the
    plain model of the workload's family."""
    optimizer_states: str = "fp32"
    """labml_zero's optimizer [state layout](../labml_zero/zero3/state_layout.html)
    by name (`--optimizer-states`), the fine-tune's choices; `update_floor`
    keeps the same states. The other engines keep fp32 master weights and
    moments whatever it says."""

    def __post_init__(self):
        llama = isinstance(self.model, LlamaConfig)
        if self.kernels is None:
            object.__setattr__(self, "kernels",
                               LlamaKernels() if llama else ModelKernels())
        if isinstance(self.kernels, LlamaKernels) != llama:
            raise ValueError(
                f"Workload {self.name}: kernels {type(self.kernels).__name__} "
                f"do not fit a {type(self.model).__name__} model")
        if llama and self.model.tie_embeddings:
            raise ValueError(
                f"Workload {self.name}: a tied Llama model has a parameter in "
                f"two layers, which zero3_layers refuses; untie it")
        if llama and self.finetune != "all":
            raise ValueError(
                f"Workload {self.name}: Llama workloads train everything, "
                f"got finetune={self.finetune!r}")
        if self.batch < 1 or self.seq < 1:
            raise ValueError(
                f"Workload {self.name}: batch and seq must be >= 1, "
                f"got {self.batch} x {self.seq}"
            )
        if self.seq > self.model.max_position:
            raise ValueError(
                f"Workload {self.name}: seq {self.seq} exceeds the model's "
                f"max_position {self.model.max_position}"
            )
        if self.prefetch_depth < 0:
            raise ValueError(
                f"Workload {self.name}: prefetch_depth must be >= 0, "
                f"got {self.prefetch_depth}"
            )
        fraction = (isinstance(self.offload, float)
                    and 0.0 < self.offload <= 1.0)
        if self.offload not in (None, "auto") and not fraction:
            raise ValueError(
                f"Workload {self.name}: offload must be None, 'auto' or a "
                f"fraction in (0, 1], got {self.offload!r}"
            )
        if self.optimizer_states not in STATE_LAYOUTS:
            raise ValueError(
                f"Workload {self.name}: optimizer_states must be one of "
                f"{', '.join(STATE_LAYOUTS)}, got {self.optimizer_states!r}"
            )
        if self.finetune not in FINETUNES:
            raise ValueError(
                f"Workload {self.name}: finetune must be one of {FINETUNES}, "
                f"got {self.finetune!r}"
            )

    @property
    def tokens_per_gpu(self) -> int:
        return self.batch * self.seq


def flops_per_token(workload: Workload) -> float:
    """$F = 6N + 12LTd$, or $4N + 12LTd$ when only biases train: the
    planner's `model_flops_per_token`, the one count of every MFU."""
    config = workload.model
    return model_flops_per_token(family_for_config(config), config,
                                 workload.seq, workload.finetune)


def mfu(workload: Workload, tokens_per_s: float, world_size: int,
        device_name: str | None, *,
        dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Model FLOPs utilisation against the `dtype` (bf16, or e4m3 for the fp8
    engine's `mfu_fp8`) data-sheet peak of `device_name` (`None`: a CPU, an
    unknown GPU, or one without fp8 tensor cores)."""
    return step_metrics.mfu(
        token_flops=flops_per_token(workload), tokens_per_s=tokens_per_s,
        world_size=world_size,
        peak=step_metrics.peak_flops_of(device_name, dtype))


# ## The workloads


def workloads() -> dict[str, Workload]:
    """W1..W4, the capability job W5, W3 with resident frozen chunks (W3R),
    the one-GPU jobs W6, W2-1 and W2-1O, and the Llama jobs L1 and L2."""
    return {
        "W1": Workload("W1", pythia_1_4b(), batch=8, seq=2048),
        "W2": Workload("W2", pythia_6_9b(), batch=2, seq=2048),
        "W3": Workload("W3", gpt_neox_20b(), batch=16, seq=128, finetune="biases"),
        "W4": Workload("W4", pythia_160m(), batch=16, seq=1024),
        "W3R": Workload("W3R", gpt_neox_20b(), batch=16, seq=128,
                        finetune="biases", resident=True),
        "W5": Workload("W5", gpt_neox_20b(), batch=4, seq=2048,
                       activation_checkpointing=True, offload="auto"),
        "W6": Workload("W6", pythia_12b(), batch=2, seq=2048,
                       activation_checkpointing=True, offload="auto"),
        "W2-1": Workload("W2-1", pythia_6_9b(), batch=2, seq=2048,
                         activation_checkpointing=True),
        "W2-1O": Workload("W2-1O", pythia_6_9b(), batch=2, seq=2048,
                          activation_checkpointing=True, offload="auto"),
        "L1": Workload("L1", replace(llama_3_2_1b(), tie_embeddings=False),
                       batch=8, seq=2048),
        "L2": Workload("L2", llama_3_1_8b(), batch=2, seq=2048,
                       activation_checkpointing=True),
    }


def shrink(workload: Workload) -> Workload:
    """
    ### A tiny copy of a workload, for CPU smoke tests

    Two layers of width 64, a 512-token vocabulary, 2 sequences of 32 tokens;
    the fine-tuner and the GELU flavour are kept, so every code path of the
    full workload still runs. The chunk size is fixed (8192 elements, several
    chunks per model): the search's candidate grid is made for real widths.
    """
    if isinstance(workload.model, LlamaConfig):
        # grouped-query attention kept: 4 query heads over 2 key-value heads
        model = replace(workload.model, n_vocab=512, d_model=64, n_heads=4,
                        n_kv_heads=2, head_dim=None, d_ff=172, n_layers=2)
    else:
        model = replace(workload.model, n_vocab=512, d_model=64, n_heads=4,
                        n_layers=2)
    return replace(workload, model=model, batch=2, seq=32, chunk_numel=8192)


# ## The model of a workload, whichever its family

DECODER_LAYERS = (neox_model.TransformerLayer, llama_model.DecoderLayer)
"""The layer types that repeat: the units each engine wraps, recomputes or
compiles; the embedding, final norm and readout are the rest."""


def model_layers(workload: Workload, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, plain: bool = False
                 ) -> list[nn.Module]:
    """
    ### The workload's layers, `[embedding, layers..., final norm, readout]`

    Both families' `build_layers` take the same arguments; `plain` builds
    without the fused kernels (DeepSpeed's model).
    """
    family = (llama_model if isinstance(workload.model, LlamaConfig)
              else neox_model)
    kernels = None if plain else workload.kernels
    return family.build_layers(workload.model, device=device, dtype=dtype,
                               kernels=kernels)
