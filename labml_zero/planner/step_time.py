r"""
---
title: The time of a step
summary: A roofline of one optimizer step from the engine's own quantities:
  the FLOPs of the matrix products, the bytes of the element-wise work, of the
  readout and of the update, the GPU's gaps between kernels, the host link's
  bytes, the collectives' bytes, each over its rate; which of them overlap
  and which are exposed.
---

# The time of a step

A step of $A$ micro-batches of $B$ sequences of $T$ tokens on each of $N_d$ ranks
is the sum of what cannot overlap,

$$t = t_{\text{compute}} + t_{\text{update}} + t_{\text{comm}}^{\text{exposed}}
      + t_{\text{host}}^{\text{exposed}},$$

each term the engine's own bytes or FLOPs over the rate of the unit that
serves them ([the machines](devices.html)), with constants the benchmark
measured on one H200. Both families share them: a Llama model is timed by its
own FLOPs, layers, width and vocabulary, with no constant of its own
(tested: tests/planner/test_step_time.py::test_whole_steps_are_predicted_within_ten_percent).

## Limitations

* The constants are an H200's in bf16; other GPUs get them at their own rates.
  An H100's measured steps are closer to an H200's than the ratio of their
  memory bandwidths, so its element-wise kernels and readout are timed at a
  rate fitted on its own lines ([the machines](devices.html)), and its steps
  come within the goal
  (tested: tests/planner/test_step_time.py::test_an_h100s_steps_are_within_the_goal);
  an A100 keeps its data sheet's.
* The element-wise bytes are one count for every layer of both families with
  every fusion on; a choice with some off adds the bytes its plain twins move,
  counted from the model's code ([the kernels' bytes](../layers/kernel_traffic.html)),
  but not the gaps of their extra launches, so a plain eager step comes out
  short (tested: tests/planner/test_step_time.py::test_the_kernels_are_timed_by_their_twins_bytes).
* One bus bandwidth at large sizes.
"""

from __future__ import annotations

from typing import NamedTuple

from labml_zero.planner.devices import Cluster
from labml_zero.planner.memory_budget import DTYPE_BYTES, Budget
from labml_zero.planner.setting import Job, Setting
from labml_zero.planner.memory_model import GRAD_BYTES
from labml_zero.zero3.state_layout import state_layout

__all__ = ["MATMUL_EFFICIENCY", "ELEMENTWISE_BYTES", "READOUT_BYTES",
           "LAYER_PASS_IDLE", "UPDATE_BANDWIDTH_SHARE", "COMPILED_ELEMENTWISE",
           "HOST_UPDATE_RATE", "FP8_CAST_BYTES", "ADAPTER_FORWARD",
           "ADAPTER_BACKWARD", "StepTime", "step_time", "fp8_products",
           "adapter_widths",
           "matmul_params", "attention_flops", "model_flops_per_token",
           "hardware_flops_per_token"]

# ## The measured constants
#
# The test beside this page derives each of them again from the benchmark's
# result lines and checks that the model reproduces the measured steps
# (tested: tests/planner/test_step_time.py::test_constants_are_the_bench_fit).
# The profiler's idle share of {{see: W4}}'s step, recorded as one CUDA graph
# (so the host never holds the GPU back), over its layers' passes: the gaps
# between one pass's kernels, each kernel's start and drain, whatever the
# width. {{see: W1}}'s eager step leaves the same idle per layer pass.
LAYER_PASS_IDLE = 1.18e-4
r"""$\tau$: seconds a layer's pass leaves the GPU idle between its kernels."""
# `MATMUL_EFFICIENCY`, `ELEMENTWISE_BYTES` and `READOUT_BYTES` are the
# least-squares solution of $t_{\text{tok}}$ (`step_time`), less those gaps,
# for the benchmark's model-only bound (the model's forward and backward with
# no engine: no collectives, no update) of W1 and {{see: W2-1}} (recomputed)
# and W4's graphed step less its update, on one H200: three workloads of
# different width and vocabulary, three unknowns.
MATMUL_EFFICIENCY = 0.801
"""$e$: the share of the data sheet's peak that the products reach."""
ELEMENTWISE_BYTES = 118
"""$b_e$: element-wise bytes per token, layer, unit of width and pass."""
# The readout's logits, written by one product and read twice by the loss, and
# their gradient, written by the loss and read by the two products, are
# $2 + 4 + 2 + 4$ bytes a token and vocabulary entry; the fit's figure is
# {{py: step_time.READOUT_BYTES / (2 + 4 + 2 + 4) | .1f}} times that, and
# what the rest is (the readout's products, the loss's passes) these lines do
# not tell apart.
# The benchmark's Llama-3.2-1B job, which no fit saw, checks it: its
# vocabulary has {{py: llama_config.llama_3_2_1b().n_vocab | ,}} entries, W4's
# {{py: workloads.workloads()["W4"].model.n_vocab | ,}}
# (tested: tests/planner/test_step_time.py::test_l1_checks_the_readout_term).
READOUT_BYTES = 41.1
"""$b_V$: the readout's and the loss's bytes per token and vocabulary entry."""
# W2-1's whole engine step less its model-only bound, over the update's bytes:
# the share of the memory bandwidth the update pass reaches.
UPDATE_BANDWIDTH_SHARE = 0.79
"""$u$."""
# Compiled against eager W1 steps on one H200, the same kernels: the saving,
# as a factor on the layers' element-wise term (the products are the same
# kernels, and the readout's loss is compiled either way).
COMPILED_ELEMENTWISE = 0.84
# The host's AdamW and the rounding of the master to bf16, one chunk of
# {{see: W6}} timed alone on the benchmark's host (the test holds the figures).
HOST_UPDATE_RATE = 2.6e9
"""Offloaded elements the host updates per second and rank."""
# An fp8 product runs at the same share $e$ of the fp8 peak as a bf16 one of
# its peak; what it adds are the casts of its operands (an amax pass and the
# cast, forward and backward), bytes that grow with $d_\text{in} +
# d_\text{out}$. The least-squares solution for the compiled fp8 steps on one
# H100, each over the bf16 step of its own lease: {{see: W1}} and W2-1's model
# at eight layers with every linear in fp8, {{see: L1}} with the per-linear
# choice (tested: tests/planner/test_step_time.py::test_fp8_cast_bytes_are_the_bench_fit).
FP8_CAST_BYTES = 3.87
r"""$b_8$: bytes per token, fp8 linear, unit of $d_\text{in} + d_\text{out}$
and pass, of the casts."""


def matmul_params(family, model) -> int:
    r"""$N$: the weights of the matrix products, the family's count
    (GPT-NeoX's four of every layer, $3d^2 + d^2 + 2 d\, d_{ff}$, and the
    readout, $d V$)."""
    return family.matmul_parameters(model)


def attention_flops(family, model, seq: int) -> float:
    r"""
    ### The attention products' forward FLOPs a token, $4 L T d$

    The part of the family's training count that grows with $T$: the count
    at $T$ less the count at 0 is the attention products' forward and
    backward, three times the forward's
    (tested: tests/planner/test_step_time.py::test_a_llama_models_flops_are_its_familys);
    Llama's products are $n_h d_h$ wide instead of $d$.
    """
    flops = family.flops_per_token
    return (flops(model, seq) - flops(model, 0)) / 3


def model_flops_per_token(family, model, seq: int, finetune: str = "all") -> float:
    r"""
    ### $F$: the FLOPs a token of the fine-tune needs, the MFU's count

    The one count behind every MFU in the project (the job's line, the
    benchmark's, the planner's, the calculator's, the results page's):
    `hardware_flops_per_token` without recomputation, which is work the
    setting adds, not the model. A full fine-tune's is PaLM's $6N + 12 L T d$
    (tested: tests/planner/test_step_time.py::test_flops_are_palm_count_and_the_hardwares);
    where only some weights train, the frozen matrices' weight gradients are
    not computed and not counted, so biases and LoRA count $4N$ where a full
    fine-tune counts $6N$; their MFU would otherwise claim half as many FLOPs
    again as the GPU ran.
    """
    return hardware_flops_per_token(family, model, seq, finetune=finetune,
                                    checkpointing=False)


def hardware_flops_per_token(family, model, seq: int, *, finetune: str,
                             checkpointing: bool) -> float:
    r"""
    ### The FLOPs the GPU runs per token

    $2N$ forward and $2N$ for the activations' gradients always; $2N$ more for
    the weights' gradients of the matrices that train (the family's
    `matmul_parameters` for the fine-tuner: all of them, GPT-NeoX's MLP for
    `ffn`; a bias or a LoRA adapter adds nothing worth counting); the
    attention products $4LTd$ forward, twice that backward. Recomputation runs
    the forward once more: $2N + 4LTd$.
    """
    n = matmul_params(family, model)
    weights = family.matmul_parameters(model, finetune)
    attention = attention_flops(family, model, seq)
    flops = 4.0 * n + 2.0 * weights + 3 * attention
    if checkpointing:
        flops += 2.0 * n + attention
    return flops


# LoRA's adapter beside an adapted product moves, in bf16, per token: forward,
# the product's input read for $A x$, then $B A x$ written, scaled and added to
# the product's output, each of those three steps reading and writing a row
# of $d_\text{out}$; backward, the output's gradient scaled and read for $B$'s
# gradient and $A x$'s, the input read again for $A$'s, and the input's
# gradient written and added to the product's. Bytes per unit of
# $(d_\text{in}, d_\text{out})$, counted from the layer's code, not fitted; the
# LoRA step measured checks them
# (tested: tests/planner/test_step_time.py::test_a_lora_step_counts_its_adapters).
ADAPTER_FORWARD = (2, 12)
"""Bytes per token and unit of $(d_\text{in}, d_\text{out})$, forward."""
ADAPTER_BACKWARD = (10, 8)
"""The same, backward."""


def adapter_widths(job: Job) -> tuple[int, int]:
    r"""$(\sum d_\text{in}, \sum d_\text{out})$ over one layer's adapted products:
    the fine-tune's targets, or every one the family has; none but for LoRA."""
    if job.finetune != "lora":
        return 0, 0
    family = job.family
    shapes = dict(zip(family.lora_targets, family.layer_linears(job.model)))
    targets = job.lora_targets or family.lora_targets
    return (sum(shapes[t][0] for t in targets), sum(shapes[t][1] for t in targets))


def fp8_products(job: Job, setting: Setting, gpu) -> tuple[float, int]:
    r"""
    ### The products that run in fp8: their FLOPs a token, and their widths

    With the `fp8` kernels, compiled, on a GPU with fp8 products: the
    FLOPs a token of the layers' linears that [the per-linear
    choice](../layers/float8.html) runs in fp8, $(6 + 2c) L N_8$ with
    $N_8 = \sum d_\text{in} d_\text{out}$ over them and $c = 1$ when
    recomputing (fp8 trains every weight), and their $\sum (d_\text{in} +
    d_\text{out})$, what their casts' bytes grow with. Eager fp8 products
    are slower (each cast is a pass of its own) and are counted as bf16:
    `(0, 0)`, as for every other case.
    """
    if not (setting.compile and gpu.peak_flops_fp8):
        return 0.0, 0
    chosen = job.family.fp8_linears(job.model, job.kernels)
    n8 = job.model.n_layers * sum(d_in * d_out for d_in, d_out in chosen)
    return (6.0 + 2 * setting.checkpointing) * n8, sum(map(sum, chosen))


def update_bytes_per_element(job: Job, *, alone: bool, micro_batches: int) -> int:
    """
    #### Bytes the update moves per trainable element

    It reads the gradient (in the parameter's dtype on one rank alone, as the
    budget counts it, else fp32), reads and writes every state, and writes
    the parameter, which it also reads when there is no master.
    """
    p = DTYPE_BYTES[job.param_dtype]
    states = state_layout(job.states)
    grad = p if alone and micro_batches == 1 else GRAD_BYTES
    param = p if states.master is not None else 2 * p
    return grad + 2 * states.bytes_per_element() + param


class StepTime(NamedTuple):
    """
    ## One step's seconds, term by term
    """

    matmul: float
    elementwise: float
    """The layers' element-wise work, LoRA's adapters' with it."""
    readout: float
    """The readout's and the loss's element-wise work."""
    idle: float
    """The gaps between the layers' kernels."""
    casts: float
    """The fp8 products' casts (0 without them)."""
    compute: float
    """The five, over the step's micro-batches, compiled or not."""
    update: float
    comm: float
    """The collectives' whole time on the link."""
    comm_exposed: float
    host: float
    """The host link's and the host update's time."""
    host_exposed: float
    total: float


def exposed_collectives(comm: float, compute: float, *, units: int,
                        micro_batches: int, depth: int) -> float:
    r"""
    ### The collectives that compute does not hide

    Per micro-batch, each of the $U$ units needs its gather, $g$ of link time,
    done while the $D$ units before it compute, $c$ each: $\max(0, g - Dc)$
    shows after them. The link is one, so a micro-batch takes at least $Ug$;
    the first unit's gather has nothing to hide behind:
    $$t_{\text{mb}} = \max\big(U c + U \max(0, g - D c),\; U g\big) + g,
    \qquad t_{\text{comm}}^{\text{exposed}} = A\, t_{\text{mb}} - t_{\text{compute}}.$$
    With equal units a deeper prefetch gains nothing here ($Ug$ binds first
    once $g > c$); it pays for unequal units and uneven timing, which this
    roofline does not see, so the search keeps $D = 1$ unless it is pinned.
    """
    if comm == 0:
        return 0.0
    g = comm / (micro_batches * units)
    c = compute / (micro_batches * units)
    behind_compute = units * c + units * max(0.0, g - depth * c)
    per_micro_batch = max(behind_compute, units * g) + g
    return max(0.0, micro_batches * per_micro_batch - compute)


def step_time(job: Job, setting: Setting, cluster: Cluster,
              budget: Budget) -> StepTime:
    r"""
    ## The step's time for one setting

    `budget` is `setting`'s memory budget: its shards, its collectives and
    its host traffic are the ones timed. Term by term:

    * **compute**, per token: the products' FLOPs over the peak at their
      efficiency $e$ (those in fp8 over the fp8 peak, plus their casts'
      bytes, `fp8_products`), the layers' element-wise work (norms, GELU or SwiGLU,
      residuals, rotary, the softmax's passes; LoRA's adapters, `adapter_widths`)
      and the readout's over the memory bandwidth (the GPU's measured rate for
      these kernels where it has one),
      $t_{\text{tok}} = \frac{F_{\text{hw}}}{e P} + \frac{b_e L d\, m + b_V V}{W}$,
      and per micro-batch the gaps between the kernels of the $L m$ layer
      passes, $\tau L m$;
    * **update**: one pass over the device-resident shard's states at the
      share $u$ of $W$ it reaches;
    * **collectives** (several ranks): every micro-batch's all-gathers and the
      step's reduce-scatter inside the shard group, and hybrid sharding's
      all-reduce across it, behind compute up to the prefetch depth;
    * **host** (offloaded state): gradients down, masters up and the host's
      update, behind the last micro-batch's backward pass.
    """
    gpu, world = cluster.gpu, cluster.world_size
    model, a = job.model, setting.micro_batches
    tokens = setting.batch * a * job.seq  # per rank and step
    flops = hardware_flops_per_token(job.family, model, job.seq,
                                     finetune=job.finetune,
                                     checkpointing=setting.checkpointing)
    fp8_flops, fp8_widths = fp8_products(job, setting, gpu)
    matmul = tokens * (
        (flops - fp8_flops) / (MATMUL_EFFICIENCY * gpu.peak_flops)
        + (fp8_flops / (MATMUL_EFFICIENCY * gpu.peak_flops_fp8) if fp8_flops else 0.0))
    passes = 3 + setting.checkpointing  # forward, backward as two, recompute
    casts = (tokens * FP8_CAST_BYTES * model.n_layers * fp8_widths * passes
             / gpu.memory_bandwidth)
    # the layers' element-wise kernels and the readout's at the GPU's own
    # measured rate where it has one (the [GPU table](devices.html))
    kernels_rate = gpu.elementwise_bandwidth or gpu.memory_bandwidth
    d_in, d_out = adapter_widths(job)
    # the forward runs again where the layers are recomputed
    adapter = ((1 + setting.checkpointing)
               * (ADAPTER_FORWARD[0] * d_in + ADAPTER_FORWARD[1] * d_out)
               + ADAPTER_BACKWARD[0] * d_in + ADAPTER_BACKWARD[1] * d_out)
    # the bytes the plain twins of the fusions left off add ([their
    # count](../layers/kernel_traffic.html)); a compiled layer fuses them itself
    unfused = job.family.unfused_bytes(model, job.kernels, batch=setting.batch,
                                       seq=job.seq)
    twins = (0.0 if setting.compile else
             unfused.layer_forward * (1 + setting.checkpointing)
             + unfused.layer_backward)
    elementwise = (tokens * model.n_layers
                   * (ELEMENTWISE_BYTES * model.d_model * passes + adapter)
                   / kernels_rate)
    if setting.compile:
        elementwise *= COMPILED_ELEMENTWISE
    elementwise += tokens * model.n_layers * twins / kernels_rate
    # the readout and its loss run once a micro-batch, never recomputed
    readout = (tokens * (READOUT_BYTES * model.n_vocab + unfused.rest)
               / kernels_rate)
    idle = a * model.n_layers * passes * LAYER_PASS_IDLE
    compute = matmul + elementwise + readout + idle + casts

    # the update of the device-resident shard, a pass over its states
    trainable = budget.grad_shards // GRAD_BYTES  # S_t, this rank's elements
    offloaded = round(trainable * budget.offloaded_fraction)
    alone = world == 1 and budget.reduce_scatter == 0
    per_element = update_bytes_per_element(job, alone=alone, micro_batches=a)
    update = ((trainable - offloaded) * per_element
              / (UPDATE_BANDWIDTH_SHARE * gpu.memory_bandwidth))

    # ring collectives: each rank of a group of $n$ moves $\frac{n-1}{n}$ of
    # the full size. The all-gathers and the reduce-scatter run inside the
    # shard group of $N_s$ ranks; with [hybrid sharding](../zero3/hybrid.html)
    # the shards' all-reduce across its $R$ replicas moves twice that share
    # (a reduce-scatter and an all-gather of the shard). A group within one
    # host talks over NVLink, so only the all-reduce crosses the hosts' NICs.
    group = job.shard_group_size or world
    replicas = world // group
    comm = ((group - 1) / group * (a * budget.all_gather + budget.reduce_scatter)
            / cluster.group_bus_bandwidth(group))
    if budget.all_reduce:
        comm += (2 * (replicas - 1) / replicas * budget.all_reduce
                 / cluster.bus_bandwidth)
    units = model.n_layers + 2  # embedding, layers, final norm with readout
    comm_exposed = exposed_collectives(comm, compute, units=units,
                                       micro_batches=a,
                                       depth=setting.prefetch_depth)

    # offloaded shards: the link and the host's update run beside the last
    # micro-batch's backward (the chunks from the output end reduce first)
    host_rate = gpu.host_update_rate or HOST_UPDATE_RATE
    host = (max(budget.host_down, budget.host_up) / gpu.host_link
            + offloaded / host_rate) if offloaded else 0.0
    backward = compute / a * (3 if setting.checkpointing else 2) / passes
    host_exposed = max(0.0, host - backward)
    total = compute + update + comm_exposed + host_exposed
    return StepTime(matmul=matmul, elementwise=elementwise, readout=readout,
                    idle=idle, casts=casts, compute=compute,
                    update=update, comm=comm, comm_exposed=comm_exposed,
                    host=host, host_exposed=host_exposed, total=total)
