r"""
---
title: The search for the fastest setting that fits
summary: Every setting of a job on a cluster, its memory budget and its step
  time; the fastest of those that fit the device and the host with a margin,
  or one line saying the smallest change that would fit.
---

# The search for the fastest setting that fits

For a [job](setting.html) on a [cluster](devices.html) the planner tries every
setting (`settings`) and keeps one when

$$M_{\text{peak}} \le (1 - m)\,(M - M_{\text{ctx}})
  \quad\text{and}\quad n\,(H_{\text{opt}} + H_{\text{proc}}) \le (1 - m_h)\,H,$$

its [budget](memory_budget.html)'s peak under the device's memory less
the CUDA context, with a margin $m$, and its ranks' host state under the
node's host memory $H$; the shortest [step](step_time.html) wins.

## Limitations

* The margins are round numbers, not fitted.
* Hybrid sharding's group and peer memory are given, not searched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, NamedTuple

from labml_zero.planner.devices import GIB, Cluster
from labml_zero.planner.memory_budget import Budget, budget
from labml_zero.planner.setting import Job, Setting, budget_inputs, budget_of
from labml_zero.planner.step_time import StepTime, model_flops_per_token, step_time

__all__ = ["DEVICE_MARGIN", "CUDA_CONTEXT_BYTES", "HOST_MARGIN",
           "HOST_PROCESS_BYTES", "Pinned", "Candidate", "Plan", "NoFit", "plan",
           "describe"]

DEVICE_MARGIN = 0.05
"""$m$: the device memory kept free beside the budget's peak."""
CUDA_CONTEXT_BYTES = 1 * GIB
r"""$M_{\text{ctx}}$: the CUDA context and NCCL's buffers, which the allocator
does not count."""
HOST_MARGIN = 0.10
"""$m_h$: the host memory kept for the OS and the page cache."""
HOST_PROCESS_BYTES = 4 * GIB
r"""$H_{\text{proc}}$: a rank's process without offloaded state (Python,
torch, CUDA's host side, the data)."""


class Pinned(NamedTuple):
    """
    ## The knobs the user fixed by a flag

    `None`: searched.
    """

    batch: int | None = None
    micro_batches: int | None = None
    checkpointing: bool | None = None
    offload_fraction: float | None = None
    prefetch_depth: int | None = None
    compile: bool | None = None


# each pin as the fine-tune's flag that sets it, for the messages
PIN_FLAGS = {"batch": "--batch-size", "micro_batches": "--grad-accum",
             "checkpointing": "--activation-checkpointing",
             "offload_fraction": "--offload-optimizer",
             "prefetch_depth": "--prefetch-depth", "compile": "--compile"}


class Candidate(NamedTuple):
    setting: Setting
    budget: Budget
    time: StepTime
    host_bytes: int
    """A node's host memory for its ranks' state and processes."""


@dataclass(frozen=True)
class Plan:
    """
    ## The chosen setting, and what it predicts
    """

    job: Job
    cluster: Cluster
    best: Candidate
    tried: int
    """Settings whose budget was computed."""
    fitting: int
    """Of those, the ones that fit."""

    @property
    def tokens_per_s(self) -> float:
        return self.job.global_batch * self.job.seq / self.best.time.total

    @property
    def mfu(self) -> float:
        r"""$\frac{F \cdot \text{tokens/s}}{N_d P}$ with the fine-tune's $F$
        (`model_flops_per_token`), as the job counts it."""
        flops = model_flops_per_token(self.job.family, self.job.model,
                                      self.job.seq, self.job.finetune)
        return flops * self.tokens_per_s / (self.cluster.world_size
                                             * self.cluster.gpu.peak_flops)


class NoFit(ValueError):
    """Nothing fits: the message is one line, with the smallest change that
    would."""


def device_limit(cluster: Cluster) -> int:
    """The bytes a rank's peak may reach."""
    return int((1 - DEVICE_MARGIN) * (cluster.gpu.memory_bytes - CUDA_CONTEXT_BYTES))


def host_need(budget: Budget, cluster: Cluster) -> int:
    """A node's host bytes: its ranks' offloaded state and processes."""
    return cluster.gpus_per_node * (budget.optimizer_host + HOST_PROCESS_BYTES)


def host_usable(cluster: Cluster) -> float:
    """A node's host bytes the ranks may take: all but the margin."""
    return (1 - HOST_MARGIN) * cluster.host_bytes


def host_fits(need: int, cluster: Cluster) -> bool:
    return cluster.host_bytes is None or need <= host_usable(cluster)


def with_offload(job: Job, setting: Setting, cluster: Cluster, *,
                 search: bool = True) -> tuple[Setting, Budget] | None:
    """
    ### The setting as it is, else with the fewest chunks offloaded that fit

    The automatic placement picks the chunks; the job is given their share as
    `--offload-optimizer`, which offloads at least that share from the output
    end, so its budget is computed again and must fit too. `search=False`: the
    user's fraction, as it is.
    """
    world, limit = cluster.world_size, device_limit(cluster)
    first = budget_of(job, setting, world_size=world, device_bytes=limit)
    if first.peak <= limit or not search:
        return (setting, first) if first.peak <= limit else None
    auto = budget(budget_inputs(job, setting, world_size=world,
                                device_bytes=limit, auto_offload=True))
    if not auto.fits:
        return None
    fraction = auto.offloaded_fraction
    placed = replace(setting, offload_fraction=fraction)
    static = budget_of(job, placed, world_size=world, device_bytes=limit)
    return (placed, static) if static.peak <= limit else None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def settings(job: Job, cluster: Cluster, pinned: Pinned) -> Iterator[Setting]:
    """
    ### Every setting the pins allow, largest micro-batch first

    Each micro-batch $B$ that divides the rank's $G / N_d$ sequences, with
    $A = G / (N_d B)$; recomputation off and on; the prefetch depth 1 or 2
    (several ranks only); compiled layers off and on. Flags the user gave
    keep their value.
    """
    per_rank = job.global_batch // cluster.world_size
    batches = ([pinned.batch] if pinned.batch is not None
               else sorted(divisors(per_rank), reverse=True))
    depths = ([pinned.prefetch_depth] if pinned.prefetch_depth is not None
              else [1, 2] if cluster.world_size > 1 else [1])
    for batch in batches:
        for ckpt in ([pinned.checkpointing] if pinned.checkpointing is not None
                     else [False, True]):
            for depth in depths:
                for compiled in ([pinned.compile] if pinned.compile is not None
                                 else [False, True]):
                    yield Setting(batch, per_rank // batch, checkpointing=ckpt,
                                  offload_fraction=pinned.offload_fraction or 0.0,
                                  prefetch_depth=depth, compile=compiled)


def check_batch(job: Job, cluster: Cluster, pinned: Pinned) -> None:
    """The global batch splits over the ranks and the pinned micro-batches."""
    world = cluster.world_size
    if job.global_batch % world:
        raise NoFit(f"--global-batch {job.global_batch} is not a multiple of "
                    f"the {world} ranks")
    per_rank = job.global_batch // world
    if pinned.batch is not None and per_rank % pinned.batch:
        raise NoFit(f"--batch-size {pinned.batch} does not divide the "
                    f"{per_rank} sequences of a rank (--global-batch "
                    f"{job.global_batch} over {world} ranks)")
    if (pinned.micro_batches is not None and pinned.batch is not None
            and pinned.batch * pinned.micro_batches != per_rank):
        raise NoFit(f"--batch-size {pinned.batch} x --grad-accum "
                    f"{pinned.micro_batches} is not the {per_rank} sequences of a "
                    f"rank (--global-batch {job.global_batch} over {world} ranks)")


def plan(job: Job, cluster: Cluster, pinned: Pinned = Pinned()) -> Plan:
    """
    ## The fastest setting that fits, or `NoFit`
    """
    check_batch(job, cluster, pinned)
    per_rank = job.global_batch // cluster.world_size
    if pinned.micro_batches is not None and pinned.batch is None:
        if per_rank % pinned.micro_batches:
            raise NoFit(f"--grad-accum {pinned.micro_batches} does not divide the "
                        f"{per_rank} sequences of a rank")
        pinned = pinned._replace(batch=per_rank // pinned.micro_batches)
    tried, found = 0, []
    for setting in settings(job, cluster, pinned):
        tried += 1
        fitted = with_offload(job, setting, cluster,
                              search=pinned.offload_fraction is None)
        if fitted is None:
            continue
        setting, b = fitted
        need = host_need(b, cluster)
        if not host_fits(need, cluster):
            continue
        found.append(Candidate(setting, b, step_time(job, setting, cluster, b),
                               need))
    if not found:
        raise NoFit(no_fit_line(job, cluster, pinned))
    # fastest; on a tie (a step bound by its link) the simplest: the fewest
    # micro-batches, no recomputation, the shallowest prefetch, the least
    # offload, no compilation
    best = min(found, key=lambda c: (
        round(c.time.total, 9), c.setting.micro_batches, c.setting.checkpointing,
        c.setting.prefetch_depth, c.setting.offload_fraction, c.setting.compile))
    return Plan(job, cluster, best, tried=tried, fitting=len(found))


def smallest(job: Job, cluster: Cluster, *, micro_batches: int
             ) -> tuple[Budget, bool]:
    """The least a rank can run with: one sequence a micro-batch,
    recomputation, and the fewest chunks offloaded that fit the device
    (`with_offload`) where the host holds them; else all the optimizer state
    on the host, the least device memory there is. Returns the budget and
    whether the host holds it. (All on the host alone would call a small host
    the cause where more GPUs without offload fit.)"""
    setting = Setting(1, micro_batches, checkpointing=True, offload_fraction=0.0)
    placed = with_offload(job, setting, cluster)
    if placed is not None and host_fits(host_need(placed[1], cluster), cluster):
        return placed[1], True
    b = budget_of(job, replace(setting, offload_fraction=1.0),
                  world_size=cluster.world_size, device_bytes=device_limit(cluster))
    return b, host_fits(host_need(b, cluster), cluster)


def larger_clusters(cluster: Cluster) -> Iterator[Cluster]:
    """`cluster`'s nodes doubled, up to six times, each like its own (its GPUs
    and its host memory)."""
    for factor in (2, 4, 8, 16, 32, 64):
        yield replace(cluster, nodes=cluster.nodes * factor)


def no_fit_line(job: Job, cluster: Cluster, pinned: Pinned) -> str:
    """
    ### Why nothing fits, and the smallest change that would

    The least a rank can hold (`smallest`) against the device and the host.
    When even that does not fit: one sequence a step on each rank (no
    accumulation, whose gradient buffers hold the whole model's), the fewest
    GPUs (up to six doublings) and the longest sequence (halving)
    at which it would. When it does fit, the user's pins are the cause.
    """
    limit = device_limit(cluster)
    per_rank = job.global_batch // cluster.world_size
    least, host_ok = smallest(job, cluster, micro_batches=per_rank)
    gpu, world = cluster.gpu.name, cluster.world_size
    if least.peak <= limit and host_ok:
        flags = ", ".join(PIN_FLAGS[k] for k, v in pinned._asdict().items()
                          if v is not None)
        return (f"no setting fits with {flags or 'these flags'} given: leave "
                f"them out and the planner chooses them")
    if least.peak <= limit:
        # the fewest chunks offloaded that fit the device: the least host it
        # needs, and the `--host-gib` whose usable share holds it
        placed = with_offload(job, Setting(1, per_rank, checkpointing=True,
                                           offload_fraction=0.0), cluster)
        need = host_need(placed[1] if placed is not None else least, cluster)
        return (f"nothing fits: the optimizer state offloaded to fit the {gpu} "
                f"needs {need / GIB:,.1f} GiB of host memory a node, "
                f"{host_usable(cluster) / GIB:,.1f} GiB usable: it would fit "
                f"with --host-gib {math.ceil(need / (1 - HOST_MARGIN) / GIB)}")
    fixes = []
    # accumulation's buffers hold every chunk's gradients; without them a rank
    # may fit its device and still not the host, which is then the cause
    host_note = ""
    if per_rank > 1:
        b, ok = smallest(job, cluster, micro_batches=1)
        if b.peak <= limit and ok:
            fixes.append(f"with --global-batch {world} (no accumulation)")
        elif b.peak <= limit:
            host_note = (f" (without accumulation {b.peak / GIB:.1f} GiB, but "
                         f"the host needs {host_need(b, cluster) / GIB:,.0f} GiB a "
                         f"node, {host_usable(cluster) / GIB:,.0f}"
                         f" GiB usable: --host-gib)")
    if not fixes:
        # more nodes like these, at the user's global batch where they split
        # it, else at one sequence a rank (said)
        for bigger in larger_clusters(cluster):
            per, batch = divmod(job.global_batch, bigger.world_size)
            note = "" if per and not batch else \
                f" with --global-batch {bigger.world_size}"
            b, ok = smallest(job, bigger, micro_batches=per if not note else 1)
            if b.peak <= limit and ok:
                fixes.append(f"on {bigger.world_size} {gpu} GPUs (--nodes "
                             f"{bigger.nodes}{note})")
                break
        seq = job.seq // 2
        while seq >= 64:
            b, ok = smallest(replace(job, seq=seq), cluster, micro_batches=per_rank)
            if b.peak <= limit and ok:
                fixes.append(f"with --seq-len {seq}")
                break
            seq //= 2
    fix = " or ".join(fixes) if fixes else "on none of the clusters tried"
    accumulated = (f" with {per_rank} micro-batches accumulated"
                   if per_rank > 1 else "")
    return (f"nothing fits: even micro-batch 1, recomputation and all "
            f"optimizer state on the host "
            f"peak at {least.peak / GIB:.1f} GiB a rank{accumulated}, "
            f"{limit / GIB:.1f} GiB usable on {world} x {gpu}{host_note}; "
            f"it would fit {fix}")


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def describe(result: Plan, *, model_name: str) -> str:
    """
    ## The plan as the command prints it

    The setting as flags, then memory and time term by term.
    """
    job, cluster, best = result.job, result.cluster, result.best
    s, b, t = best.setting, best.budget, best.time
    host = ("not checked (no --host-gib)" if cluster.host_bytes is None else
            f"of {host_usable(cluster) / GIB:,.0f} GiB usable")
    lines = [
        f"plan: {model_name}, finetune {job.finetune}, {job.global_batch} "
        f"sequences of {job.seq} tokens a step, on {cluster.describe()}",
        f"setting: {s.flags()} (kernels {job.kernels.names()}); "
        f"{result.fitting} of {result.tried} settings fit",
        f"device memory a rank: peak {gib(b.peak)} of "
        f"{gib(device_limit(cluster))} usable; its parts: parameters "
        f"{gib(b.params)}, gradient shards {gib(b.grad_shards)}, optimizer "
        f"{gib(b.optimizer_device)}, gathered {gib(b.gathered)}, activations "
        f"{gib(b.activations)}, gradient buffers "
        f"{gib(max(b.grad_buffer, b.accumulation))} (not all alive at once)",
        f"host memory a rank: optimizer {gib(b.optimizer_host)} + process "
        f"{gib(HOST_PROCESS_BYTES)}; a node {gib(best.host_bytes)}, {host}",
        f"step time: {t.total:.3f} s = compute {t.compute:.3f} (matrix products "
        f"{t.matmul:.3f}, element-wise {t.elementwise:.3f}, readout "
        f"{t.readout:.3f}, gaps {t.idle:.3f}"
        + (f", fp8 casts {t.casts:.3f}" if t.casts else "") + ") + update "
        f"{t.update:.3f} + exposed collectives {t.comm_exposed:.3f} (of "
        f"{t.comm:.3f}) + exposed host {t.host_exposed:.3f} (of {t.host:.3f})",
        f"throughput: {result.tokens_per_s:,.0f} tokens/s, MFU "
        f"{100 * result.mfu:.1f}% of {cluster.gpu.peak_flops / 1e12:.1f} "
        f"TFLOP/s a GPU",
    ]
    if getattr(job.kernels, "fp8", False) and not result.best.setting.compile:
        # eager fp8 is not modelled (each cast a pass of its own): said, so
        # the figure is not read as fp8's
        lines.append("note: the step time counts eager fp8 products at the bf16 "
                     "rate; measured, they are slower (add --compile)")
    if job.steps is not None:
        lines.append(f"run: {job.steps} steps, about "
                     f"{job.steps * t.total / 60:,.1f} minutes of steps")
    return "\n".join(lines)
