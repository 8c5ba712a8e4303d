"""`bench/predictions.py`: the planner's peak and step beside every measured
one-GPU line, and what the lines say about the peak's parts."""

import pytest

from bench.predictions import (MEASURED_FILES, MEMORY_GOAL, RESULTS, STEP_GOAL,
                               engine_lines, job_setting, gpu_of, predictions,
                               prediction_markdown)
from bench.workloads import workloads
from labml_zero.planner.memory_budget import LINK_QUEUE_CHUNKS
from labml_zero.planner.memory_model import GRAD_BYTES
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


def test_the_readme_counts_the_peaks_within_the_goal(rows):
    """The README's count of peaks within `MEMORY_GOAL` is the table's."""
    readme = " ".join((RESULTS.parent.parent / "README.md").read_text().split())
    within = sum(abs(p.memory_error) <= MEMORY_GOAL for p in rows)
    assert (f"The peak is within {MEMORY_GOAL:.0%} on {within} of the "
            f"{len(rows)} lines") in readme


def test_one_ranks_peak_is_the_states_and_activations_alone(rows):
    # W1, W3, W4, L1 and L2 on one GPU, eager or compiled with the fused
    # kernels and nothing recomputed: the measured peak is the parameters, the
    # optimizer's states and the counted activations, and nothing of the
    # gradients (the held chunk's and the queued early updates', which the
    # budget adds: what puts L1's prediction 3.4% over). Recomputed, W1's
    # peak comes within the goal but not within this margin (W1 at 16
    # sequences eager: 0.9 GiB beside the count)
    checked = 0
    for p in rows:
        line = p.line
        if line["workload"] not in ("W1", "W3", "W4", "L1", "L2"):
            continue
        if line.get("activation_checkpointing"):
            continue
        if line["kernels"] == "none":
            continue  # a compiled plain layer saves less than the eager count
        job, setting = job_setting(line, p.file)
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


def full_depth(line: dict) -> bool:
    return line["model"]["n_layers"] == workloads()[line["workload"]].model.n_layers


def fp32_states(line: dict) -> bool:
    return line.get("optimizer_states", "fp32") == "fp32"


def test_gpt_neox_recomputed_at_full_depth_held_more_than_the_count(rows):
    # W2-1 at its full depth with fp32 states on an H200. With the engine and
    # kernels of 12-03/04 (loss, rotary, norms: the MLP's bias and GELU not
    # fused) the measured peak exceeds the budget by more than the goal, and
    # the gap shrinks as the batch grows: not a per-token term the count
    # misses. With today's engine and kernels (`bias_gelu` fused) the same
    # setting is within the goal, as is W6, of the older lease
    gaps, today = {}, 0
    for p in rows:
        line = p.line
        if (line["workload"] not in ("W2-1", "W6") or not full_depth(line)
                or not fp32_states(line)):
            continue
        if line["workload"] == "W6" or "bias_gelu" in line["kernels"]:
            assert abs(p.memory_error) <= MEMORY_GOAL
            today += line["workload"] == "W2-1"
            continue
        assert p.memory_error < -0.02
        gaps[line["batch_per_gpu"]] = line["peak_mem_gib"] - p.memory_gib
    assert gaps[8] > gaps[12] > gaps[16] > 0
    assert today >= 1


# What a line of W2-1's model at a lesser depth held beyond the count, eager:
# the same at every depth and batch size of a kind (the library's workspaces)
BESIDE_A_RECOMPUTED_COUNT_GIB = 0.2


def test_gpt_neox_recomputed_at_lesser_depths_is_counted_per_layer(rows):
    # W2-1's model at 4, 8, 16, 20 and 24 layers (`--layers`) on an H100 with
    # the kernels `auto` gives now, eager: each within the goal and under by
    # the same bytes at every depth, so the per-layer terms are exact and
    # what is left is fixed; at one, two and four sequences (their peak the
    # loss's, before any gradient) by less than at eight (later, beside the
    # gradients)
    lesser = [p for p in rows if p.line["workload"] == "W2-1"
              and not full_depth(p.line) and not p.line["compiled"]
              and fp32_states(p.line)]
    by_batch = {}
    for p in lesser:
        assert abs(p.memory_error) <= MEMORY_GOAL
        under = p.line["peak_mem_gib"] - p.memory_gib
        assert 0 < under < BESIDE_A_RECOMPUTED_COUNT_GIB
        by_batch.setdefault(p.line["batch_per_gpu"] == 8, []).append(under)
    assert {p.line["model"]["n_layers"] for p in lesser} == {4, 8, 16, 20, 24}
    for unders in by_batch.values():
        assert max(unders) - min(unders) < 0.02, unders
    assert min(by_batch[True]) > max(by_batch[False])


def test_gpt_neox_recomputed_at_full_depth_with_bf16_moments_is_counted(rows):
    # W2-1 at its full depth with bf16 moments, with or without a master
    # (their update moves fewer bytes than fp32 states'), measured on an
    # H100 at 4 and 8 sequences: within the goal, as at lesser depths
    narrow = [p for p in rows if p.line["workload"] == "W2-1"
              and full_depth(p.line) and not fp32_states(p.line)]
    assert {p.line["optimizer_states"] for p in narrow} == {
        "bf16-moments", "bf16-stochastic", "bf16-kahan"}
    assert all(abs(p.memory_error) <= MEMORY_GOAL for p in narrow)


def test_an_offloaded_run_holds_gradients_on_the_link(rows):
    # Pythia-6.9B recomputed with a part of its optimizer state on the host
    # (W2-1O, one H100): the peak without the gradients queued for the link
    # is under every measured one, and the measured excess is, on average,
    # LINK_QUEUE_CHUNKS of the largest chunk's gradients; without
    # recomputation too the peak is within the goal
    recomputed = [p for p in rows if p.line["workload"] == "W2-1O"
                  and p.line["activation_checkpointing"]]
    assert len(recomputed) >= 6
    excess = []
    for p in recomputed:
        b = p.budget
        # one rank: the largest shard is a whole chunk, at least the chunk size
        # (a group wider than it stretches its chunk)
        queued = LINK_QUEUE_CHUNKS * GRAD_BYTES
        assert b.link_grads % queued == 0
        assert b.link_grads >= queued * b.chunk_numel
        chunk = b.link_grads / LINK_QUEUE_CHUNKS / GIB
        without = (b.peak - b.link_grads) / GIB
        assert without < p.line["peak_mem_gib"]
        assert abs(p.memory_error) <= MEMORY_GOAL
        excess.append((p.line["peak_mem_gib"] - without) / chunk)
    assert round(sum(excess) / len(excess)) == LINK_QUEUE_CHUNKS
    plain = [p for p in rows if p.line["workload"] == "W2-1O"
             and not p.line["activation_checkpointing"]]
    assert plain
    assert all(abs(p.memory_error) <= MEMORY_GOAL for p in plain)
