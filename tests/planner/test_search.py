"""`labml_zero/planner/search.py`: the fastest setting that fits, the margins
it keeps, and the one line when nothing fits."""

import re

import pytest

from labml_zero.neox.build import resolve_kernels
from labml_zero.neox.family import NEOX
from labml_zero.neox.model import gpt_neox_20b, pythia_1_4b, pythia_6_9b, pythia_12b
from labml_zero.planner.devices import GIB, GPUS, Cluster
from labml_zero.planner.search import NoFit, Pinned, describe, plan
from labml_zero.planner.setting import Job
from labml_zero.planner.search import (HOST_MARGIN, HOST_PROCESS_BYTES,
                                       device_limit, host_need, smallest)

H100, H200 = GPUS["h100"], GPUS["h200"]


def test_w1_runs_as_the_benchmark_does():
    # Pythia-1.4B, 8 x 2048 on one H200 fits whole: no recomputation, no
    # offload, one micro-batch, and compiled layers are predicted faster
    result = plan(Job(pythia_1_4b(), family=NEOX, seq=2048, global_batch=8),
                  Cluster(H200))
    s = result.best.setting
    assert (s.batch, s.micro_batches, s.checkpointing, s.offload_fraction,
            s.compile) == (8, 1, False, 0.0, True)
    assert result.best.budget.peak <= device_limit(Cluster(H200))
    assert result.fitting == result.tried == 4 * 2 * 2  # B, recomputation, compile
    assert 0.4 < result.mfu < 0.7
    # pinned eager, the search keeps the pin
    eager = plan(Job(pythia_1_4b(), family=NEOX, seq=2048, global_batch=8), Cluster(H200),
                 Pinned(compile=False))
    assert not eager.best.setting.compile
    assert eager.best.time.total > result.best.time.total


def test_recomputation_and_offload_only_when_needed():
    # Pythia-6.9B at 16 sequences of a rank does not fit an H200 without
    # recomputation; Pythia-12B needs part of its optimizer state on the host
    big = plan(Job(pythia_6_9b(), family=NEOX, seq=2048, global_batch=16), Cluster(H200))
    assert big.best.setting.checkpointing or big.best.setting.micro_batches > 1
    assert big.best.setting.offload_fraction == 0
    twelve = plan(Job(pythia_12b(), family=NEOX, seq=2048, global_batch=8), Cluster(H200))
    fraction = twelve.best.setting.offload_fraction
    assert 0 < fraction < 1
    assert twelve.best.time.host > 0
    # every kept setting keeps the margin
    assert twelve.best.budget.peak <= device_limit(Cluster(H200))


def test_host_memory_is_checked_when_known():
    job = Job(pythia_12b(), family=NEOX, seq=2048, global_batch=8)
    result = plan(job, Cluster(H200, host_bytes=1000 * GIB))
    need = result.best.host_bytes
    assert need == result.best.budget.optimizer_host + HOST_PROCESS_BYTES
    # a node with less host memory than the offload needs: the one line says
    # so, with a --host-gib that fits (the fewest chunks offloaded that fit
    # the device), and that one does
    small = int(need * 0.5 / (1 - HOST_MARGIN))
    with pytest.raises(NoFit, match=r"^nothing fits: .*host memory a node.*"
                                    r"it would fit with --host-gib (\d+)$") as e:
        plan(job, Cluster(H200, host_bytes=small))
    enough = int(re.search(r"--host-gib (\d+)$", str(e.value)).group(1))
    assert plan(job, Cluster(H200, host_bytes=enough * GIB)).best


def test_several_ranks_time_their_collectives_and_prefetch():
    job = Job(pythia_1_4b(), family=NEOX, seq=2048, global_batch=64)
    one_node = plan(job, Cluster(H100, gpus_per_node=8))
    two_nodes = plan(job, Cluster(H100, gpus_per_node=4, nodes=2))
    assert one_node.best.time.comm > 0
    # the ring across nodes runs at the NIC's pace, 8 times slower than NVLink
    assert two_nodes.best.time.comm > 4 * one_node.best.time.comm
    assert one_node.tried == 4 * 2 * 2 * 2  # B, recomputation, depth, compile


def test_nothing_fits_is_one_line_with_the_smallest_fix():
    # states without a master are offloaded too (the host keeps a copy of
    # the weight): 20B fits one H100 with most of them on the host...
    job = Job(gpt_neox_20b(), family=NEOX, seq=2048, global_batch=8,
              states="bf16-stochastic")
    fitted = plan(job, Cluster(H100)).best
    assert 0 < fitted.setting.offload_fraction < 1
    assert fitted.budget.optimizer_host > 0
    # ...but not beside a host too small for them: then only sharded wider
    with pytest.raises(NoFit) as error:
        plan(job, Cluster(H100, host_bytes=128 * GIB))
    line = str(error.value)
    assert "\n" not in line and line.startswith("nothing fits: ")
    # the fix is checked at the job's global batch: 8 nodes of one H100 take a
    # sequence each (2 of them, which the line said before, only with a
    # global batch of 2), and that cluster does fit
    assert ("all optimizer state on the host" in line
            and "would fit on 8 h100 GPUs (--nodes 8)" in line)
    assert plan(job, Cluster(H100, nodes=8, host_bytes=128 * GIB)).best
    # the device's peak is accumulation's; without it the host is the cause
    assert "a rank with 8 micro-batches accumulated" in line
    without = Job(gpt_neox_20b(), family=NEOX, seq=2048, global_batch=1,
                  states="bf16-stochastic")
    alone, host_ok = smallest(without, Cluster(H100, host_bytes=128 * GIB),
                              micro_batches=1)
    assert alone.peak <= device_limit(Cluster(H100)) and not host_ok
    need = host_need(alone, Cluster(H100, host_bytes=128 * GIB))
    assert (f"(without accumulation {alone.peak / GIB:.1f} GiB, but the host "
            f"needs {need / GIB:,.0f} GiB a node, "
            f"{(1 - HOST_MARGIN) * 128:,.0f} GiB usable: --host-gib)"
            in line)
    # accumulation holds every chunk's gradient buffer: one sequence a step fits
    with pytest.raises(NoFit, match="with --global-batch 1 \\(no accumulation\\)"):
        plan(Job(gpt_neox_20b(), family=NEOX, seq=2048, global_batch=8), Cluster(H100),
             Pinned(batch=1))


def test_a_global_batch_the_ranks_cannot_split_is_refused():
    with pytest.raises(NoFit, match="^--global-batch 7 is not a multiple of the "
                                    "2 ranks$"):
        plan(Job(pythia_1_4b(), family=NEOX, seq=2048, global_batch=7),
             Cluster(H200, gpus_per_node=2))
    with pytest.raises(NoFit, match="--batch-size 3 does not divide"):
        plan(Job(pythia_1_4b(), family=NEOX, seq=2048, global_batch=8), Cluster(H200),
             Pinned(batch=3))


def test_fp8_compiled_keeps_less_and_is_timed_with_its_casts():
    # with fp8 products the compiled layers keep less than the eager ones
    # (their inputs are recomputed); compiled, the step is timed at the fp8
    # rate with the casts' term, and eager the plan says it is not
    job = Job(pythia_1_4b(), family=NEOX, seq=2048, global_batch=8,
              kernels=resolve_kernels("auto,fp8", "cuda"))
    compiled = plan(job, Cluster(H100), Pinned(compile=True))
    eager = plan(job, Cluster(H100), Pinned(compile=False))
    assert compiled.best.budget.activations < eager.best.budget.activations
    text = describe(compiled, model_name="W1")
    assert "fp8 casts" in text and "note:" not in text
    assert "eager fp8 products at the bf16 rate" in describe(eager, model_name="W1")
    bf16_job = Job(pythia_1_4b(), family=NEOX, seq=2048, global_batch=8,
                   kernels=resolve_kernels("auto", "cuda"))
    bf16 = plan(bf16_job, Cluster(H100), Pinned(compile=True))
    assert "fp8" not in describe(bf16, model_name="W1")
    assert compiled.best.time.total < bf16.best.time.total
