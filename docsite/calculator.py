"""
---
title: The memory calculator's page block
summary: The form, the table and the chart of the memory model's calculator,
  with the Python model's constants and worked example written into the page.
---

# The memory calculator's page block

`{{calculator}}` in a note becomes the calculator: a form whose controls are
the fields of `planner/memory_budget.BudgetInputs`, a table of every part of the
`Budget` and a bar chart of the peak. The arithmetic is
`docs_src/static/calculator.js`, a line-by-line port of the Python functions;
this module writes into the page, as JSON, everything that port must not
restate: the presets of `neox/config.py`, the bytes per element of the memory
model and of each optimizer state layout (`zero3/state_layout.py`), the
search's knobs, each family's fine-tuners, LoRA targets and kernels, the
step-time roofline's constants and GPUs (`planner/step_time.py`,
`planner/devices.py`), and the worked example's inputs with the bytes
`memory_budget.budget` computes for them. The script recomputes that example
when the page loads and says whether it agrees.

The port is GPT-NeoX's layers and activation count; a Llama-family preset
comes with its own numbers instead (`model_json`): its units' parameters as
the engine lays them out, its family's activation count as a line in the
tokens for each fine-tuner, recomputation and kernels, and its FLOPs. So the
script sizes both families exactly, and restates no Llama formula.

With scripting off the block is still a page: the form shows the example's
inputs, and the table its outputs, computed when the site was built.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import json
import re

from .mathml import to_mathml
from .paths import rel_href

CALCULATOR = re.compile(r"\{\{calculator\}\}")

# planner.sharding.choose_chunk_numel caps the search at this many steps of the
# hidden size (before stretching it to the largest layer)
RANGE_STEPS = 4096

PRESETS = ("tiny", "pythia_70m", "pythia_160m", "pythia_410m", "pythia_1b",
           "pythia_1_4b", "pythia_2_8b", "pythia_6_9b", "pythia_12b", "gpt_neox_20b")
"""GPT-NeoX's presets (`neox/config.py`), whose shapes the script's own port
of GPT-NeoX's layers and activation count sizes, custom shapes too."""
LLAMA_PRESETS = ("smollm2_135m", "qwen2_5_0_5b", "llama_3_2_1b", "llama_3_2_3b",
                 "qwen2_5_7b", "mistral_7b", "llama_3_1_8b")
"""The Llama family's presets (`llama/config.py`): the script takes each one's
parameters, activation count and FLOPs as numbers computed from the Python
(`model_json`), not a port."""

# (key, unit, symbol in TeX, name): the table's rows, in the page's notation
ROWS = (
    ("psi_trainable", "count", r"\Psi_t", "trainable parameters of the model"),
    ("psi_frozen", "count", r"\Psi_f", "frozen parameters of the model"),
    ("chunk_numel", "count", r"C", "chunk size (elements)"),
    ("chunks", "count", r"n_c", "chunks of the model"),
    ("padding", "count", r"\sum_k (C_k - u_k)", "padding of the model (elements)"),
    ("params", "bytes", r"p \sum_k S_k", "parameter shards"),
    ("grad_shards", "bytes", r"g\,S_t", "fp32 gradient shards"),
    ("optimizer_device", "bytes", r"K_d\,(1 - x)\,S_t",
     "master and moments on the device"),
    ("optimizer_host", "bytes", r"(K + 4)\,x\,S_t",
     "master, moments and staging on the host"),
    ("model_states", "bytes", r"M_{\text{states}}",
     "model states on the device, in total (the three rows above it but one)"),
    ("offloaded_fraction", "fraction", r"x", "optimizer state offloaded"),
    ("gathered", "bytes", r"G", "gathered chunks at the peak"),
    ("activations", "bytes", r"A", "activations"),
    ("grad_buffer", "bytes", r"B",
     "largest full-size gradient buffer, with its held gradients"),
    ("accumulation", "bytes", r"g_r \sum_{k\,\text{trainable}} C_k",
     "gradient buffers held under accumulation"),
    ("early_grads", "bytes", r"E", "gradients held by the early updates in flight"),
    ("peak", "bytes", r"M_{\text{peak}}", "predicted peak"),
    ("fits", "yes/no", r"M_{\text{peak}} \le M_{\text{device}}", "fits the device"),
    ("all_gather", "bytes", r"p \sum_k C_k + p \sum_{k\,\text{backward}} C_k",
     "all-gathers per step (full size)"),
    ("reduce_scatter", "bytes", r"g_r \sum_{k\,\text{trainable}} C_k",
     "reduce-scatters per step (full size)"),
    ("all_reduce", "bytes", r"g_r\,S_t", "all-reduce across shard groups per step"),
    ("wire_inside", "bytes", r"\frac{N_s - 1}{N_s}(\ldots)",
     "sent per rank and step inside the shard group"),
    ("wire_across", "bytes", r"2\frac{R - 1}{R} g_r S_t",
     "sent per rank and step across groups"),
    ("host_down", "bytes", r"4\,x\,S_t", "over the host link per step, down"),
    ("host_up", "bytes", r"p\,x\,S_t", "over the host link per step, up"),
)
"""What each row shows; the chart's parts reuse the names. `model_states` is
the page's own total, `params + grad_shards + optimizer_device`."""

# (key, unit, symbol in TeX, name): the step time's rows, `planner/step_time.py`
TIME_ROWS = (
    ("total", "s", r"t", "predicted time of one optimizer step"),
    ("compute", "s", r"t_{\text{compute}}",
     "matrix products, element-wise work, the readout and the gaps between "
     "kernels, every micro-batch"),
    ("update", "s", r"t_{\text{update}}", "the optimizer's pass on the device"),
    ("comm_exposed", "s", r"t_{\text{comm}}^{\text{exposed}}",
     "collectives that compute does not hide"),
    ("host_exposed", "s", r"t_{\text{host}}^{\text{exposed}}",
     "host link and host update that the backward pass does not hide"),
    ("tokens_per_s", "tokens/s", r"G\,T / t", "tokens a second, all GPUs"),
    ("mfu", "fraction", r"\frac{F \cdot G T / t}{N_d P}",
     "model FLOPs utilization, of the data sheet's dense bf16 peak"),
)
DEFAULT_GPU = "h200"

# The symbols the table shows that the memory model's page does not define.
LEGEND = (
    r"$S_k$ a rank's shard of chunk $k$ and $S_t$ its trainable shards together, "
    r"in elements; $C_k$ chunk $k$'s size and $u_k$ the parameter elements in it; "
    r"$n_c$ the number of chunks; $x$ the share of the optimizer state offloaded to "
    r"the host and $K_d$ the optimizer bytes per element kept on the device; $G$ "
    r"the gathered chunks at the peak, $A$ the activations, $B$ the largest "
    r"gradient buffer with the gradients held for it; $N_s$ the GPUs of one "
    r"shard group and $R = N_d / N_s$ the groups (1 without hybrid sharding); "
    r"$p$ and $g_r$ the bytes of an element in the parameters' and the "
    r"reduction's dtype, $g = 4$ an fp32 gradient's, $K$ the optimizer state's "
    r"bytes per element. Step time: $G = B A N_d$ the sequences of a step, $P$ "
    r"the GPU's dense bf16 peak from its data sheet and $F = 6N + 12LTd$ the "
    r"model FLOPs of a token ($N$ the weights of the matrix products)."
)


def total(result: dict, key: str):
    """A row's value: the budget's, or the page's total of the model states."""
    if key == "model_states":
        return result["params"] + result["grad_shards"] + result["optimizer_device"]
    return result[key]


def _legend(page: str) -> str:
    return re.sub(r"\$([^$]+)\$", lambda m: _math(m.group(1), page), LEGEND)


def kernels_key(kernels) -> str:
    """A family's kernels as the script names them: `name=value` of each
    field, sorted, the values as JSON writes them."""
    return ",".join(f"{name}={json.dumps(value)}"
                    for name, value in sorted(dataclasses.asdict(kernels).items()))


# `_family_numbers` computed so far, by the family's name and the model (a
# family, a table of functions and presets, is not hashable)
_NUMBERS: dict[tuple, dict] = {}


def _family_numbers(family, model) -> dict:
    """
    ### A family's model as the script's numbers

    The parameters of its four units (embedding, one transformer layer,
    final norm, readout; a tied readout has none of its own) in the order
    the engine lays them out; $N$ and the attention's forward FLOPs per token
    of sequence, for the step time. The activations are the script's port of
    the family's [activation count](../labml_zero/llama/activation_memory.html), from the
    shape `model_json` gives.
    """
    from labml_zero.zero3.unit_chunks import param_specs

    if (family.name, model) in _NUMBERS:
        return _NUMBERS[family.name, model]
    layers = family.build(dataclasses.replace(model, n_layers=1), device="meta")
    specs, _ = param_specs([layer.named_parameters() for layer in layers])
    units = [[] for _ in layers]
    for spec in specs:
        units[spec.group].append([spec.name, list(spec.shape)])
    flops = family.flops_per_token
    _NUMBERS[family.name, model] = {
        "units": units,
        "matmul_params": family.matmul_parameters(model),
        "attention_flops": (flops(model, 1) - flops(model, 0)) / 3}
    return _NUMBERS[family.name, model]


def model_json(family, model) -> dict:
    """A model as the object the script takes: GPT-NeoX's shape, which the
    script's port sizes, or another family's shape and `_family_numbers`."""
    shape = {"family": family.name, "n_vocab": model.n_vocab,
             "d_model": model.d_model, "n_heads": model.n_heads,
             "n_layers": model.n_layers, "max_position": model.max_position,
             # each LoRA target's (d_in, d_out), for its adapter's bytes
             "layer_linears": dict(zip(family.lora_targets,
                                       map(list, family.layer_linears(model))))}
    if family.name == "gpt-neox":
        return {**shape, "d_ff": model.d_ff, "rotary_pct": model.rotary_pct}
    # what the port of Llama's activation count reads
    counted = {"d_ff": model.d_ff, "n_kv_heads": model.n_kv_heads,
               "head_width": model.head_width, "tie_embeddings": model.tie_embeddings}
    return {**shape, **counted, **_family_numbers(family, model)}


def inputs_json(inputs) -> dict:
    """A `BudgetInputs` as the object `computeBudget` takes (its family by
    name, in its model)."""
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)
              if f.name not in ("family", "model", "kernels")}
    fields["kernels"] = dataclasses.asdict(inputs.kernels)
    fields["model"] = model_json(inputs.family, inputs.model)
    fields["lora_targets"] = list(inputs.lora_targets)
    return fields


def budget_json(budget) -> dict:
    return dataclasses.asdict(budget)


def _cluster(inputs, gpu: str, nodes: int):
    from labml_zero.planner.devices import GPUS, Cluster

    if inputs.world_size % nodes:
        raise ValueError(f"{nodes} nodes do not divide {inputs.world_size} GPUs")
    return Cluster(GPUS[gpu], gpus_per_node=inputs.world_size // nodes, nodes=nodes)


def _job(inputs, **kernels):
    """The planner's job of a `BudgetInputs`: its sequences a step are
    $G = B A N_d$."""
    from labml_zero.planner.setting import Job

    return Job(model=inputs.model, family=inputs.family, seq=inputs.seq,
               global_batch=inputs.batch * inputs.micro_batches * inputs.world_size,
               finetune=inputs.finetune, lora_rank=inputs.lora_rank,
               lora_targets=inputs.lora_targets, states=inputs.states,
               param_dtype=inputs.param_dtype,
               update_during_backward=inputs.update_during_backward,
               shard_group_size=inputs.shard_group_size, **kernels)


def plan_json(inputs, *, gpu: str = DEFAULT_GPU, nodes: int = 1) -> dict | None:
    """`search.plan` for the job of `inputs` (nothing pinned, host memory not
    checked), as `computePlan` returns it; `None` where no setting fits."""
    from labml_zero.planner.search import NoFit, plan

    try:
        chosen = plan(_job(inputs), _cluster(inputs, gpu, nodes))
    except NoFit:
        return None
    best = chosen.best
    return {"setting": dataclasses.asdict(best.setting), "flags": best.setting.flags(),
            "budget": budget_json(best.budget), "time": best.time._asdict(),
            "tokens_per_s": chosen.tokens_per_s, "mfu": chosen.mfu,
            "tried": chosen.tried, "fitting": chosen.fitting}


def step_time_json(inputs, *, gpu: str = DEFAULT_GPU, nodes: int = 1,
                   compile: bool = False) -> dict:
    """`step_time.step_time` of a `BudgetInputs` on `nodes` nodes of `gpu`s,
    with tokens/s and MFU as the planner's `Plan` counts them: what
    `computeStepTime` returns. The step is the job's on a GPU, every fusion on
    (`auto`), whatever kernels size the memory: the script has no count of the
    plain twins' bytes, which the planner takes from running the model on the
    meta device."""
    from labml_zero.planner.memory_budget import budget
    from labml_zero.planner.setting import Setting
    from labml_zero.planner.step_time import model_flops_per_token, step_time

    cluster = _cluster(inputs, gpu, nodes)
    job = _job(inputs)
    setting = Setting(batch=inputs.batch, micro_batches=inputs.micro_batches,
                      checkpointing=inputs.checkpointing,
                      prefetch_depth=inputs.prefetch_depth, compile=compile)
    time = step_time(job, setting, cluster, budget(inputs))._asdict()
    time["tokens_per_s"] = job.global_batch * job.seq / time["total"]
    time["mfu"] = (model_flops_per_token(job.family, job.model, job.seq,
                                          job.finetune)
                   * time["tokens_per_s"]
                   / (cluster.world_size * cluster.gpu.peak_flops))
    return time


@functools.cache
def calculator_data() -> dict:
    """Everything the script takes from the Python model, as JSON."""
    from labml_zero.families import FAMILIES
    from labml_zero.llama import config as llama_config
    from labml_zero.llama.family import LLAMA
    from labml_zero.neox import config as neox_config
    from labml_zero.neox.finetuners import FINETUNERS, FineTuneBiases
    from labml_zero.neox.family import NEOX
    from labml_zero.planner import memory_budget
    from labml_zero.optimizers import early_update
    from labml_zero.planner import memory_model
    from labml_zero.planner import search as planner_search, step_time
    from labml_zero.planner.chunk_search import MEBI, ChunkSearchConfig
    from labml_zero.planner.devices import GPUS
    from labml_zero.zero3.config import ZeroConfig
    from labml_zero.zero3.state_layout import LAYOUTS

    search = ChunkSearchConfig()
    example = memory_budget.BudgetInputs(neox_config.pythia_1_4b(), family=NEOX)
    presets = {name: model_json(NEOX, getattr(neox_config, name)())
               for name in PRESETS}
    presets |= {name: model_json(LLAMA, getattr(llama_config, name)())
                for name in LLAMA_PRESETS}
    return {
        "presets": presets,
        "default_preset": "pythia_1_4b",
        "dtype_bytes": memory_budget.DTYPE_BYTES,
        "grad_bytes": memory_model.GRAD_BYTES,
        # K and the master's bytes of each layout: the script counts K_d, and
        # the host's K, from these
        "state_layouts": {
            name: {"bytes": layout.bytes_per_element(),
                   "master_bytes": layout.master.nbytes if layout.master else 0}
            for name, layout in LAYOUTS.items()},
        "staging_bytes": memory_model.STAGING_BYTES,
        "backward_extra_units": memory_model.BACKWARD_EXTRA_UNITS,
        "early_updates_in_flight": early_update.EARLY_UPDATES_IN_FLIGHT,
        "link_queue_chunks": memory_budget.LINK_QUEUE_CHUNKS,
        "align": ZeroConfig().align,
        "finetuners": list(FINETUNERS),
        "biases": list(FineTuneBiases.BIASES),
        # each family's fine-tuners, LoRA's targets (name -> path in a layer),
        # its plain kernels and the planner's (the job's `auto` on a GPU)
        "families": {family.name: {
            "title": family.title, "finetuners": list(family.finetuners),
            "lora_targets": dict(zip(family.lora_targets, _target_paths(family))),
            "plain_kernels": dataclasses.asdict(family.resolve_kernels("none", "cpu")),
            "planner_kernels": dataclasses.asdict(
                family.resolve_kernels("auto", "cuda"))} for family in FAMILIES},
        "device_bytes": memory_budget.H200_BYTES,
        "search": {"search_range_m": search.search_range_m, "range_steps": RANGE_STEPS,
                   "mebi": MEBI, "memory_weight": search.memory_weight,
                   "collective_bytes": search.collective_bytes,
                   "min_chunk_size": search.min_chunk_size,
                   "filter_exlarge_params": search.filter_exlarge_params,
                   "max_candidates": search.max_candidates},
        # the roofline of a step: its constants and the GPUs' rates
        "step_time": {"matmul_efficiency": step_time.MATMUL_EFFICIENCY,
                      "elementwise_bytes": step_time.ELEMENTWISE_BYTES,
                      "readout_bytes": step_time.READOUT_BYTES,
                      "layer_pass_idle": step_time.LAYER_PASS_IDLE,
                      "update_bandwidth_share": step_time.UPDATE_BANDWIDTH_SHARE,
                      "compiled_elementwise": step_time.COMPILED_ELEMENTWISE,
                      "host_update_rate": step_time.HOST_UPDATE_RATE,
                      "adapter_forward": step_time.ADAPTER_FORWARD,
                      "adapter_backward": step_time.ADAPTER_BACKWARD},
        "gpus": {name: dataclasses.asdict(gpu) for name, gpu in GPUS.items()},
        # the planner's search: its margins and the job's kernels (`auto`)
        "planner": {"device_margin": planner_search.DEVICE_MARGIN,
                    "cuda_context_bytes": planner_search.CUDA_CONTEXT_BYTES},
        "default_gpu": DEFAULT_GPU,
        "reference": {"inputs": {**inputs_json(example), "gpu": DEFAULT_GPU,
                                 "nodes": 1, "compile": False},
                      "budget": budget_json(memory_budget.budget(example)),
                      "step_time": step_time_json(example),
                      "plan": plan_json(example)},
    }


def _target_paths(family) -> list[str]:
    """Each LoRA target's module path in a transformer layer: the target's
    name is its last part (PEFT's match), found in one layer built on meta."""
    layer = family.build(family.presets[next(iter(family.presets))](),
                         device="meta")[1]
    modules = [name for name, _ in layer.named_modules()]
    return [next(m for m in modules if m.rsplit(".", 1)[-1] == target)
            for target in family.lora_targets]


@functools.cache
def preset_names() -> dict[str, str]:
    """Each preset function's name -> the name `--model` takes for it."""
    from labml_zero.finetune.config import MODEL_PRESETS

    return {fn.__name__: cli for cli, fn in MODEL_PRESETS.items()}


def _math(tex: str, page: str) -> str:
    return to_mathml(tex, display=False, where=page)


def _number(name: str, label: str, value, *, minimum: int = 0, hint: str = "") -> str:
    shown = "" if value is None else html.escape(str(value))
    return (f'<label><span>{label}</span> <input type="number" name="{name}" '
            f'min="{minimum}" step="any" value="{shown}" inputmode="numeric" disabled'
            f'{f" placeholder={chr(34)}{hint}{chr(34)}" if hint else ""}></label>')


def _select(name: str, label: str, options, value) -> str:
    items = "".join(
        f'<option value="{html.escape(v)}"{" selected" if v == value else ""}>'
        f"{html.escape(text)}</option>" for v, text in options)
    return (f'<label><span>{label}</span> <select name="{name}" disabled>{items}'
            "</select></label>")


def _gib(value) -> str:
    return "0" if value == 0 else f"{value / 2**30:.4g}"


def _time_text(value: float, unit: str) -> str:
    """A step-time row's figure, as the script writes it."""
    if unit == "s":
        return f"{value:.4g} s"
    if unit == "fraction":
        return f"{100 * value:.1f}%"
    return f"{value:,.0f}"


def _plan_text(chosen: dict | None) -> str:
    """The planner's choice in a sentence, as the script writes it."""
    lead = ("The planner's choice for these sequences a step, on this GPU's "
            "memory (host memory not checked): ")
    if chosen is None:
        return lead + "no setting fits."
    return (lead + f'<code>{chosen["flags"]}</code>, '
            f'{_time_text(chosen["time"]["total"], "s")} a step, '
            f'{_time_text(chosen["tokens_per_s"], "tokens/s")} tokens/s, MFU '
            f'{_time_text(chosen["mfu"], "fraction")}; {chosen["fitting"]} of '
            f'{chosen["tried"]} settings fit.')


def render(page: str) -> str:
    """The block, for the page at `page` (site-relative): one HTML block, no blank
    line, so that Markdown passes it through whole."""
    data = calculator_data()
    example, result = data["reference"]["inputs"], data["reference"]["budget"]
    model = example["model"]
    static = rel_href("static/calculator.js", page).rsplit("calculator.js", 1)[0]
    activation_page = rel_href("labml_zero/neox/activation_memory.html", page)
    llama_activation_page = rel_href("labml_zero/llama/activation_memory.html", page)
    budget_page = rel_href("labml_zero/planner/memory_budget.html", page)
    presets = [(name, preset_names()[name]) for name in PRESETS + LLAMA_PRESETS]
    dtypes = [(name, name) for name in data["dtype_bytes"]]
    # each family's projections; the script shows the preset's family's
    shown = data["presets"][data["default_preset"]]["family"]
    targets = "".join(
        f'<span class="calc-targets" data-family="{name}"'
        f'{"" if name == shown else " hidden"}>'
        + "".join(f'<label class="calc-check"><input type="checkbox" '
                  f'name="lora_targets" value="{t}" data-family="{name}" checked '
                  f'disabled> {t}</label>' for t in family["lora_targets"])
        + "</span>" for name, family in data["families"].items())
    fieldsets = [
        ("Model", _select("preset", "preset", presets + [("custom", "custom")],
                          data["default_preset"])
         + _number("n_layers", f"layers {_math('L', page)}", model["n_layers"],
                   minimum=1)
         + _number("d_model", "width", model["d_model"], minimum=1)
         + _number("n_heads", f"heads {_math('n_h', page)}", model["n_heads"],
                   minimum=1)
         + _number("n_vocab", f"vocabulary {_math('V', page)}", model["n_vocab"],
                   minimum=1)),
        ("Ranks", _number("world_size", f"GPUs {_math('N_d', page)}",
                          example["world_size"], minimum=1)
         + _number("shard_group_size", f"shard group {_math('N_s', page)}",
                   example["shard_group_size"], minimum=1, hint="all")),
        ("Precision", _select("param_dtype", f"parameters {_math('p', page)}", dtypes,
                              example["param_dtype"])
         + _select("reduce_dtype", f"reduction {_math('g_r', page)}", dtypes,
                   example["reduce_dtype"])
         + _select("states", f"optimizer states {_math('K', page)}",
                   [(name, name) for name in data["state_layouts"]],
                   example["states"])),
        ("What trains", _select("finetune", "fine-tuner",
                                [(f, f) for f in data["finetuners"]],
                                example["finetune"])
         + f'<span class="calc-lora">'
         + _number("lora_rank", f"rank {_math('r', page)}", example["lora_rank"],
                   minimum=1)
         + f'{targets}</span>'),
        ("Chunks", _number("chunk_numel", f"chunk size {_math('C', page)}",
                           example["chunk_numel"], minimum=1, hint="searched")
         + _number("prefetch_depth", f"prefetch depth {_math('D', page)}",
                   example["prefetch_depth"])),
        ("Activations", _number("batch", "sequences a micro-batch",
                                example["batch"], minimum=1)
         + _number("seq", f"sequence {_math('T', page)}", example["seq"], minimum=1)
         + _number("micro_batches", "micro-batches a step", example["micro_batches"],
                   minimum=1)
         + '<label class="calc-check"><input type="checkbox" name="checkpointing" '
         + f'{"checked " if example["checkpointing"] else ""}disabled> '
         + "activation checkpointing</label>"
         + '<label class="calc-check"><input type="checkbox" '
         + 'name="update_during_backward" '
         + f'{"checked " if example["update_during_backward"] else ""}disabled> '
         + "update during backward</label>"),
        ("Offload", '<label class="calc-check"><input type="radio" name="offload" '
         'value="fraction" checked disabled> a fraction</label>'
         + _number("offload_fraction", f"offloaded {_math('x', page)}",
                   example["offload_fraction"])
         + '<label class="calc-check"><input type="radio" name="offload" value="fit" '
         'disabled> fit this device</label>'
         + _number("device_gib", "device memory, GiB",
                   round(example["device_bytes"] / 2**30, 2), minimum=1)),
        ("Step time", _select("gpu", "GPU", [(name, gpu["cuda_name"])
                                             for name, gpu in data["gpus"].items()],
                              data["default_gpu"])
         + _number("nodes", f"nodes {_math('h', page)}", 1, minimum=1)
         + '<label class="calc-check"><input type="checkbox" name="compile" '
         'disabled> compiled layers</label>'),
    ]
    form = "".join(f"<fieldset><legend>{legend}</legend>{body}</fieldset>"
                   for legend, body in fieldsets)
    rows = []
    for key, unit, tex, name in ROWS:
        value = total(result, key)
        if unit == "bytes":
            cells = (f'<td class="num">{_gib(value)}</td><td class="num">'
                     f'{value:,}</td>')
        elif unit == "fraction":
            cells = f'<td class="num">{100 * value:.1f}%</td><td></td>'
        elif unit == "yes/no":
            cells = f'<td class="num">{"yes" if value else "no"}</td><td></td>'
        else:
            cells = f'<td class="num"></td><td class="num">{value:,}</td>'
        css = ' class="calc-total"' if key == "model_states" else ""
        rows.append(f'<tr{css} data-key="{key}" data-unit="{unit}"><th scope="row">'
                    f"{_math(tex, page)}</th><td>{html.escape(name)}</td>{cells}</tr>")
    timed = data["reference"]["step_time"]
    time_rows = "".join(
        f'<tr data-time-key="{key}" data-unit="{unit}"><th scope="row">'
        f"{_math(tex, page)}</th><td>{html.escape(name)}</td>"
        f'<td class="num">{_time_text(timed[key], unit)}</td></tr>'
        for key, unit, tex, name in TIME_ROWS)
    step_page = rel_href("labml_zero/planner/step_time.html", page)
    labels = "".join(f' data-label_{key}="{html.escape(name)}"'
                     for key, _, _, name in ROWS)
    payload = json.dumps(data, sort_keys=True).replace("</", "<\\/")
    block = (
        '<div class="calc" id="calculator">'
        '<h2 id="calculator-title">Calculator</h2><p>What one rank holds and moves '
        'for a fine-tune of a GPT-NeoX or a Llama-family model: the '
        f'<a href="{budget_page}">memory budget</a> of this page\'s parts, each '
        'row named by its symbol. GPT-NeoX\'s activations are the '
        f'<a href="{activation_page}">activation count</a>\'s for every '
        'fine-tuner, LoRA\'s adapters at their rank and targets included; a '
        'Llama-family preset brings its parameters and its FLOPs as numbers '
        'the library computed when this page was built, and its activations '
        f'are the <a href="{llama_activation_page}">Llama activation count</a>\'s, '
        'ported as GPT-NeoX\'s is. A custom shape is a GPT-NeoX one.</p>'
        '<noscript><p>The calculator runs in the browser; with scripting off the '
        'form and the table show the worked example, computed by '
        '<code>memory_budget.budget</code> when this page was built.</p></noscript>'
        f'<form class="calc-form" aria-label="calculator inputs">{form}</form>'
        '<p class="calc-status" role="status" aria-live="polite">The table shows '
        'the worked example; change any field to compute another.</p>'
        '<div class="calc-out"><div class="calc-table-box">'
        '<table class="calc-table"><thead><tr>'
        '<th scope="col">symbol</th><th scope="col">what it counts (one rank\'s '
        'bytes, unless it says the model)</th>'
        '<th scope="col">GiB</th><th scope="col">bytes or count, exact</th></tr>'
        '</thead><tbody>'
        + "".join(rows) +
        '</tbody></table>'
        f'<table class="calc-table calc-time"><caption>The step\'s predicted time, '
        f'from <a href="{step_page}">the planner\'s roofline</a>, on the GPU and '
        'nodes of the form</caption><thead><tr><th scope="col">symbol</th>'
        '<th scope="col">what it is</th><th scope="col">value</th></tr></thead>'
        f'<tbody>{time_rows}</tbody></table>'
        f'<p class="calc-plan">{_plan_text(data["reference"]["plan"])}</p>'
        f'<p class="calc-legend">{_legend(page)}</p></div><figure class="calc-chart"{labels}>'
        '<svg viewBox="0 0 1000 40" preserveAspectRatio="none" role="img" '
        'aria-label="the peak\'s parts"></svg><ol></ol>'
        '<figcaption>The peak\'s parts; the line is the device memory.</figcaption>'
        '</figure></div>'
        f'<script type="application/json" id="calc-data">{payload}</script>'
        f'<script src="{static}calculator.js"></script>'
        f'<script src="{static}calculator_form.js"></script>'
        f'<link rel="stylesheet" href="{static}calculator.css">'
        "</div>"
    )
    return block.replace("\n", "")


def expand(text: str, page: str) -> str:
    """`{{calculator}}` -> the block."""
    return CALCULATOR.sub(lambda _: render(page), text)
