"""The inputs on which the calculator's script is compared with the Python model:
every preset of both families, N from 1 to 1,024, each dtype and fine-tuner,
with and without offload, checkpointing and accumulation, fixed and searched
chunk sizes; and the step time's cluster of each (GPU, nodes, compiled
layers)."""

from __future__ import annotations

from dataclasses import replace

from docsite.calculator import LLAMA_PRESETS, PRESETS
from labml_zero.llama import config as llama_config
from labml_zero.llama.family import LLAMA
from labml_zero.neox import config as neox_config
from labml_zero.neox.family import NEOX
from labml_zero.neox.kernels import ModelKernels
from labml_zero.neox.lora import TARGETS
from labml_zero.planner.memory_budget import BudgetInputs
from labml_zero.zero3.state_layout import LAYOUTS


def neox_inputs(model=None, **fields) -> BudgetInputs:
    """A GPT-NeoX job's inputs; the model Pythia-1.4B unless given."""
    return BudgetInputs(neox_config.pythia_1_4b() if model is None else model,
                        family=NEOX, **fields)

WORLDS = (1, 2, 3, 8, 16, 64, 256, 1024)
DTYPES = (("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp32"))
FINETUNES = ("all", "biases", "ffn", "lora")
OFFLOADS = (0.0, 0.35, 1.0, None)
LAYOUT_NAMES = tuple(LAYOUTS)
# fixed chunk sizes in elements, odd ones included (the granule rounds them)
CHUNKS = (2**20, 3 * 2**20 + 17, 5_000_000, 2**24, 40_000_000)
GIB = 2**30
# plain, the bench's usual set, and the loss alone in chunks longer than some
# sequences (c = min(chunk rows, BT))
KERNELS = (ModelKernels(), ModelKernels.from_names("loss,rotary,norms"),
           ModelKernels(loss=True, loss_chunk_rows=3000))

# The tiny model on two CPU ranks, whose real bytes tests/neox/test_memory_budget.py
# counts: the end-to-end case, in the grid like any other.
ENGINE_CASES = (
    neox_inputs(model=neox_config.tiny(), world_size=2, batch=2, seq=16,
                 micro_batches=2),
    neox_inputs(model=neox_config.tiny(), world_size=2, batch=2, seq=16,
                 micro_batches=2, finetune="biases", reduce_dtype="bf16",
                 chunk_numel=20_000, prefetch_depth=0),
)


def grid_inputs(count: int = 224) -> list[BudgetInputs]:
    """`count` inputs that walk every axis at coprime strides, so that each value
    of each axis meets many values of the others."""
    cases = []
    for i in range(count):
        model = getattr(neox_config, PRESETS[i % len(PRESETS)])()
        world = WORLDS[(i // 2) % len(WORLDS)]
        # every third case of several ranks is hybrid: groups of a divisor
        group = None
        if world > 1 and i % 3 == 0:
            group = 2 if world % 2 == 0 else 1
        param_dtype, reduce_dtype = DTYPES[i % 4 if i % 7 else (i // 7) % 4]
        finetune = FINETUNES[(i // 3) % 4]
        # all four projections, two of them, or the attention output alone
        targets = (("query_key_value", "dense_4h_to_h"), ("dense",))[i % 5] \
            if i % 5 < 2 else tuple(TARGETS)
        # every state layout, each with every offload
        states = LAYOUT_NAMES[(i // 11) % len(LAYOUT_NAMES)]
        offload = OFFLOADS[(i // 6) % 4]
        cases.append(neox_inputs(
            model=model, world_size=world, shard_group_size=group,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, states=states,
            finetune=finetune,
            lora_rank=(4, 8, 16, 64)[i % 4], lora_targets=targets,
            chunk_numel=CHUNKS[i % len(CHUNKS)], prefetch_depth=(0, 1, 2)[i % 3],
            checkpointing=i % 2 == 1, batch=(1, 2, 4, 8)[(i // 5) % 4],
            seq=(128, 512, 2048)[(i // 4) % 3], micro_batches=(1, 1, 4)[i % 3],
            update_during_backward=i % 4 == 3, kernels=KERNELS[(i // 2) % 3],
            offload_fraction=offload,
            device_bytes=(80 * GIB, 150_109_880_320)[i % 2]))
    return cases + list(ENGINE_CASES)


# Llama's kernels as the calculator has its counts: none, and the job's `auto`
# on a GPU (the planner's)
LLAMA_KERNELS = (LLAMA.resolve_kernels("none", "cpu"),
                 LLAMA.resolve_kernels("auto", "cuda"))


def llama_inputs(count: int = 42) -> list[BudgetInputs]:
    """The Llama family's presets on the same axes: every rank count, dtype,
    state layout and offload, both fine-tuners (LoRA on some or all seven
    projections), both kernels, fixed chunk sizes and, every sixth, searched."""
    cases = []
    for i in range(count):
        world = WORLDS[(i // 2) % len(WORLDS)]
        states = LAYOUT_NAMES[(i // 5) % len(LAYOUT_NAMES)]
        offload = OFFLOADS[(i // 4) % 4]
        cases.append(BudgetInputs(
            getattr(llama_config, LLAMA_PRESETS[i % len(LLAMA_PRESETS)])(),
            family=LLAMA, world_size=world,
            shard_group_size=2 if world > 1 and world % 2 == 0 and i % 3 == 0
            else None,
            param_dtype=DTYPES[i % 4][0], reduce_dtype=DTYPES[i % 4][1],
            states=states, finetune=("all", "lora")[(i // 3) % 2],
            lora_rank=(4, 8, 16, 64)[i % 4],
            lora_targets=(("q_proj", "down_proj"), ("o_proj",), None)[i % 3],
            chunk_numel=CHUNKS[i % len(CHUNKS)] if i % 6 else None,
            prefetch_depth=(0, 1, 2)[i % 3], checkpointing=i % 2 == 1,
            batch=(1, 2, 4, 8)[(i // 5) % 4], seq=(128, 512, 2048)[(i // 4) % 3],
            micro_batches=(1, 1, 4)[i % 3], update_during_backward=i % 4 == 3,
            kernels=LLAMA_KERNELS[(i // 2) % 2], offload_fraction=offload,
            device_bytes=(80 * GIB, 150_109_880_320)[i % 2]))
    return cases


def searched_inputs() -> list[BudgetInputs]:
    """The chunk-size search on every preset, and the closing note's three jobs:
    Pythia-12B on one H200 with and without offload, GPT-NeoX-20B on 8 GPUs."""
    cases = []
    for i, name in enumerate(PRESETS):
        cases.append(neox_inputs(
            model=getattr(neox_config, name)(), world_size=(1, 2, 8, 3, 64)[i % 5],
            finetune=FINETUNES[i % 4], checkpointing=i % 2 == 0, batch=2,
            prefetch_depth=(1, 2)[i % 2], chunk_numel=None))
    w6 = neox_inputs(model=neox_config.pythia_12b(), world_size=1, batch=4,
                      checkpointing=True, update_during_backward=True)
    cases += [w6, replace(w6, offload_fraction=None),
              neox_inputs(model=neox_config.gpt_neox_20b(), world_size=8, batch=4,
                           checkpointing=True)]
    return cases + list(ENGINE_CASES)


GPU_NAMES = ("h100", "h200", "a100")


def cluster_of(index: int, case: BudgetInputs) -> dict:
    """The step time's GPU, nodes and compilation for the grid's `index`th case:
    every GPU, one node or several (the NIC's bus), compiled or not."""
    nodes = (1, 2, 4)[index % 3]
    while case.world_size % nodes:
        nodes //= 2
    return {"gpu": GPU_NAMES[(index // 3) % 3], "nodes": nodes,
            "compile": index % 5 in (1, 3)}
