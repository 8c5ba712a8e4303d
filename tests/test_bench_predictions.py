"""`bench/predictions.py`: the planner's peak and step beside every measured
one-GPU line, and what the lines say about the peak's parts."""

import pytest

from bench.predictions import (MEASURED_FILES, MEMORY_GOAL, RESULTS, STEP_GOAL,
                               engine_lines, job_setting, gpu_of, predictions,
                               prediction_markdown)
from labml_zero.planner.setting import budget_of

GIB = 2 ** 30
# What a CUDA process allocates beside the tensors the budget counts (the
# library's workspaces): the most seen on any line below, rounded up.
BESIDE_THE_COUNT_GIB = 0.15


@pytest.fixture(scope="module")
def rows():
    return predictions()


def test_every_file_has_lines_and_every_line_a_row(rows):
    for name in MEASURED_FILES:
        assert engine_lines(RESULTS / name), name
        assert any(p.file == name for p in rows), name
    table = prediction_markdown()
    body = [r for r in table.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert len(body) == len(rows)


@pytest.mark.parametrize("goal_of, error_of", [
    (lambda: MEMORY_GOAL, lambda p: p.memory_error),
    (lambda: STEP_GOAL, lambda p: p.step_error)])
def test_a_row_says_missed_exactly_where_the_goal_is_missed(rows, goal_of, error_of):
    table = [r for r in prediction_markdown().splitlines()
             if r.startswith("| ") and "---" not in r][1:]
    for p, row in zip(rows, table):
        text = f"{error_of(p):+.1%}"
        assert text in row
        marked = text + " (missed)" in row
        assert marked == (abs(error_of(p)) > goal_of()), row


def test_one_ranks_peak_is_the_states_and_activations_alone(rows):
    # W1, W3, W4, L1 and L2 on one GPU, eager or compiled with the fused
    # kernels: the measured peak is the parameters, the optimizer's states and
    # the counted activations, and nothing of the gradients (the held chunk's
    # and the queued early updates', which the budget adds: what puts L1's
    # prediction 3.4% over)
    checked = 0
    for p in rows:
        line = p.line
        if line["workload"] not in ("W1", "W3", "W4", "L1", "L2"):
            continue
        if line["kernels"] == "none":
            continue  # a compiled plain layer saves less than the eager count
        job, setting = job_setting(line)
        b = budget_of(job, setting, world_size=1, device_bytes=gpu_of(line).memory_bytes)
        counted = (b.params + b.optimizer_device + b.activations) / GIB
        beside = line["peak_mem_gib"] - counted
        assert 0 <= beside <= BESIDE_THE_COUNT_GIB, (line["workload"], beside)
        # and, where every weight trains, the gradients the budget adds would
        # not fit in that margin
        if job.finetune == "all":
            assert (b.grad_buffer + b.early_grads) / GIB > BESIDE_THE_COUNT_GIB
        checked += 1
    assert checked >= 10


def test_gpt_neox_recomputed_holds_more_than_the_count(rows):
    # W2-1 and W6: the measured peak exceeds the budget (the gap the next
    # probe on the GPU must split into a per-layer and a fixed part), and the
    # gap shrinks as the batch grows: not a per-token term the count misses
    gaps = {}
    for p in rows:
        line = p.line
        if line["workload"] in ("W2-1", "W6"):
            assert p.memory_error < -0.02, line["workload"]
        if line["workload"] == "W2-1":
            gaps[line["batch_per_gpu"]] = line["peak_mem_gib"] - p.memory_gib
    assert gaps[8] > gaps[12] > gaps[16] > 0
