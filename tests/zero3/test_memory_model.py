"""Analytic bytes, checked against numbers worked out by hand."""

import dataclasses

import pytest

from labml_zero.zero3.chunk_layout import ParamSpec, plan_chunks
from labml_zero.zero3.config import ZeroConfig
from labml_zero.planner.grad_buffers import held_grads, largest_grad_buffer
from labml_zero.planner.memory_model import (
    BACKWARD,
    BACKWARD_EXTRA_UNITS,
    FORWARD,
    PARAM_BYTES,
    REDUCE_BYTES,
    Traffic,
    ddp_step_comm,
    gathered_peak,
    gathered_units,
    layout_model_states,
    peak_window_numel,
    ring_wire_bytes,
    root_unit_bytes,
    zero3_step_comm,
    zero_model_states,
)


def mixed_layout():
    """
    Chunk size 8 on 2 ranks (a granule of 2); `w` (6) and `v` (3) trainable in
    group 0, `f` (5) frozen in group 0, `b` (3) trainable in group 1:

    * chunk 0, group 0, trainable: `w` (6) + 2 padding (`v` does not fit: 9 > 8)
    * chunk 1, group 0, frozen: `f` (5) + 1, the frozen tail, trimmed to 6
    * chunk 2, group 0, trainable: `v` (3) + 1, the trainable tail, trimmed to 4
    * chunk 3, group 1, trainable: `b` (3) + 1, trimmed to 4
    """
    params = [
        ParamSpec("w", (2, 3), True, 0),
        ParamSpec("f", (5,), False, 0),
        ParamSpec("v", (3,), True, 0),
        ParamSpec("b", (3,), True, 1),
    ]
    layout = plan_chunks(params, 8, 2)
    assert [
        (c.group, c.trainable, c.chunk_numel, c.padding) for c in layout.chunks
    ] == [(0, True, 8, 2), (0, False, 6, 1), (0, True, 4, 1), (1, True, 4, 1)]
    return layout


# ZeRO paper formula


def test_zero_model_states_is_the_paper_formula():
    # (2 + 2 + 12) * 1000 bytes on one rank: DDP's replicated model states.
    # The paper's 16-bit gradients (g = 2); the engine's default is fp32 (g = 4).
    assert zero_model_states(1000, 0, 1, grad_bytes=2) == 16_000
    # Sharded over 4 ranks: 16 * 250.
    assert zero_model_states(1000, 0, 4, grad_bytes=2) == 4_000
    # Frozen parameters add only their 2-byte shard: 2 * 600 / 4 = 300.
    assert zero_model_states(1000, 600, 4, grad_bytes=2) == 4_300
    # fp32 gradients (g = 4): (2 + 4 + 12) * 250.
    assert zero_model_states(1000, 0, 4, grad_bytes=4) == 4_500


def test_zero_model_states_rounds_shards_up():
    # 10 elements on 4 ranks: the largest shard holds 3, so 3 * 16.
    assert zero_model_states(10, 0, 4, grad_bytes=2) == 48


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(psi_trainable=-1, psi_frozen=0, world_size=1), "psi_trainable"),
        (dict(psi_trainable=1, psi_frozen=0, world_size=0), "world_size"),
        (
            dict(psi_trainable=1, psi_frozen=0, world_size=1, param_bytes=0),
            "param_bytes",
        ),
    ],
)
def test_zero_model_states_rejects_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        zero_model_states(**kwargs)


# Exact bytes of a layout


def test_layout_model_states_counts_padding():
    layout = mixed_layout()
    # Shards of 4, 3, 2, 2: trainable 4 + 2 + 2 = 8 elements at 2 + 2 + 12,
    # frozen 3 at 2.
    assert layout_model_states(layout, grad_bytes=2) == 8 * 16 + 3 * 2
    # fp32 parameters and gradients, separate master: 4 + 4 + 12 per element.
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=12)
    assert layout_model_states(layout, **fp32) == 8 * 20 + 3 * 4
    # The parameter shard is the master: only the two moments remain, 4 + 4 + 8.
    assert (
        layout_model_states(layout, **fp32, master_aliases_param=True)
        == 8 * 16 + 3 * 4
    )


def test_a_trimmed_trainable_tail_costs_what_it_holds():
    # Bias-only in miniature: a frozen weight of 16 and a trainable bias of 4,
    # chunk size 16 on 2 ranks. The bias chunk is trimmed to 4, so the layout
    # costs the formula: 16 * 4 / 2 + 2 * 16 / 2 = 32 + 16 = 48. A whole chunk
    # of 16 for the bias would cost 16 * 16 / 2 + 16 = 144, three times as much.
    params = [ParamSpec("w", (4, 4), False, 0), ParamSpec("bias", (4,), True, 0)]
    layout = plan_chunks(params, 16, 2)
    assert [c.chunk_numel for c in layout.chunks] == [16, 4]
    assert (layout_model_states(layout, grad_bytes=2)
            == zero_model_states(4, 16, 2, grad_bytes=2) == 48)


def test_layout_without_padding_matches_the_paper():
    # Two parameters of 4 fill a chunk of 8 exactly: no padding, so the layout
    # costs what the formula says.
    params = [ParamSpec("a", (4,), True, 0), ParamSpec("b", (4,), True, 0)]
    layout = plan_chunks(params, 8, 2)
    assert layout.padding() == 0
    assert (layout_model_states(layout, grad_bytes=2)
            == zero_model_states(8, 0, 2, grad_bytes=2) == 64)


def test_master_alias_needs_fp32():
    with pytest.raises(ValueError, match="master_aliases_param"):
        layout_model_states(mixed_layout(), master_aliases_param=True)


# Gathered peak


def test_gathered_peak_over_prefetch_windows():
    # Chunk size 1 makes every parameter oversized: one chunk per group, of
    # exactly its size. Group sizes 4, 8, 2, 6.
    params = [ParamSpec(f"p{g}", (n,), True, g) for g, n in enumerate([4, 8, 2, 6])]
    layout = plan_chunks(params, 1, 1)
    assert [layout.group_numel(g) for g in range(4)] == [4, 8, 2, 6]
    # d = 0: the largest group; d = 1: 4 + 8; d = 2: 8 + 2 + 6; d >= 3: all.
    assert gathered_peak(layout, 0, 1) == 8
    assert gathered_peak(layout, 1, 1) == 12
    assert gathered_peak(layout, 2, 1) == 16
    assert gathered_peak(layout, 9, 1) == 20
    # In bf16, twice the elements.
    assert gathered_peak(layout, 1, 2) == 24
    assert peak_window_numel([4, 8, 2, 6], 1) == 12


def test_a_held_group_adds_to_every_window():
    """A group gathered for the whole step (a tied embedding's owner) is not
    one of the window's $n$: it adds its size to the widest window of the
    others."""
    params = [ParamSpec(f"p{g}", (n,), True, g) for g, n in enumerate([4, 8, 2, 6])]
    layout = dataclasses.replace(plan_chunks(params, 1, 1), held=frozenset({0}))
    # d = 0: 4 + 8; d = 1: 4 + (8 + 2); d >= 2: all
    assert gathered_peak(layout, 0, 1) == 12
    assert gathered_peak(layout, 1, 1) == 14
    assert gathered_peak(layout, 2, 1) == 20
    assert gathered_peak(layout, 1, 1, phase=BACKWARD) == 14


def test_gathered_peak_rejects_negative_depth():
    with pytest.raises(ValueError, match="prefetch_depth"):
        gathered_peak(mixed_layout(), -1, 2)


# Gradient buffer


def test_largest_grad_buffer_is_the_largest_trainable_chunk():
    layout = mixed_layout()
    # Trainable chunks of 8, 4 and 4 (the frozen 6 has no gradient): its bf16
    # gradients held, 2 * 8 bytes, beside its fp32 buffer, 4 * 8 bytes.
    assert held_grads(layout, 2) == 16
    assert largest_grad_buffer(layout, 4, 2) == 16 + 32
    # Nothing trains: nothing held, no buffer.
    frozen = plan_chunks([ParamSpec("f", (5,), False, 0)], 8, 1)
    assert largest_grad_buffer(frozen, 4, 2) == held_grads(frozen, 2) == 0
    with pytest.raises(ValueError, match="grad_bytes"):
        largest_grad_buffer(layout, 0, 2)
    with pytest.raises(ValueError, match="param_bytes"):
        largest_grad_buffer(layout, 4, 0)


# Communication


def test_zero3_step_comm_by_hand():
    layout = mixed_layout()
    comm = zero3_step_comm(layout, param_bytes=2, grad_bytes=4)
    # Forward and backward gather all 4 chunks, 8 + 6 + 4 + 4 = 22, in bf16.
    assert comm.forward_all_gather == Traffic(4, 22, 44)
    assert comm.backward_all_gather == Traffic(4, 22, 44)
    # The three trainable chunks, 8 + 4 + 4 = 16, are reduce-scattered in fp32.
    assert comm.reduce_scatter == Traffic(3, 16, 64)
    assert (comm.collectives, comm.numel, comm.nbytes) == (11, 60, 152)
    # Backward that re-gathers only group 1 (its one trainable chunk of 4).
    partial = zero3_step_comm(layout, backward_groups=[1])
    assert partial.backward_all_gather == Traffic(1, 4, 8)


def test_zero3_is_three_psi_and_ddp_two_psi():
    # Without padding, ZeRO-3 moves 3 * psi elements per step and DDP 2 * psi.
    params = [ParamSpec(f"p{g}", (16,), True, g) for g in range(3)]
    layout = plan_chunks(params, 16, 4)
    psi = 48
    assert layout.padding() == 0
    zero = zero3_step_comm(layout, param_bytes=2, grad_bytes=2)
    ddp = ddp_step_comm(psi, grad_bytes=2)
    assert zero.numel == 3 * psi
    assert ddp == Traffic(1, 2 * psi, 4 * psi)
    # with a bf16 reduce: 6 * psi bytes against 4 * psi, 1.5x in bytes too
    assert zero.nbytes == 6 * psi and zero.nbytes / ddp.nbytes == 1.5
    # On the wire each rank sends (N - 1) / N of it: 3/4 on 4 ranks.
    assert ring_wire_bytes(zero.nbytes, 4) == 3 * psi * 2 * 3 // 4 == 216
    assert ring_wire_bytes(ddp.nbytes, 4) == 144
    assert ring_wire_bytes(ddp.nbytes, 1) == 0


def test_default_step_bytes_match_ddp():
    # The defaults are the engine's: bf16 gathers, an fp32 reduce (ZeroConfig's
    # reduce_dtype); DDP's all-reduce compared in the same fp32. Both then move
    # 8 * psi bytes per step.
    assert PARAM_BYTES == ZeroConfig().dtype.itemsize == 2
    assert REDUCE_BYTES == ZeroConfig().reduce_dtype.itemsize == 4
    params = [ParamSpec(f"p{g}", (16,), True, g) for g in range(3)]
    layout = plan_chunks(params, 16, 4)
    psi = 48
    zero, ddp = zero3_step_comm(layout), ddp_step_comm(psi)
    assert zero.numel == 3 * psi and ddp.numel == 2 * psi
    assert zero.nbytes == ddp.nbytes == 8 * psi


def test_backward_groups_must_exist():
    with pytest.raises(ValueError, match="backward_groups names group 7"):
        zero3_step_comm(mixed_layout(), backward_groups=[7])


# Units gathered at once


def test_gathered_units_by_phase():
    # Forward holds the running unit and d prefetched; backward the same, no
    # extra unit (see Note: backward holds no extra unit).
    beta = BACKWARD_EXTRA_UNITS
    for d in (0, 1, 2):
        assert gathered_units(d, FORWARD) == 1 + d
        assert gathered_units(d, BACKWARD) == 1 + d + beta
    with pytest.raises(ValueError, match="phase"):
        gathered_units(1, "sideways")
    with pytest.raises(ValueError, match="prefetch_depth"):
        gathered_units(-1, FORWARD)


def test_backward_peak_is_as_wide_as_forward():
    # Group sizes 4, 8, 2, 6: backward's window is gathered_units wide, the
    # same as forward's (no extra unit).
    params = [ParamSpec(f"p{g}", (n,), True, g) for g, n in enumerate([4, 8, 2, 6])]
    layout = plan_chunks(params, 1, 1)
    sizes = [4, 8, 2, 6]
    for d in (0, 1, 2):
        width = gathered_units(d, BACKWARD)
        expected = max(sum(sizes[i : i + width]) for i in range(len(sizes)))
        assert gathered_peak(layout, d, 1, phase=BACKWARD) == expected
        assert peak_window_numel(sizes, d, phase=BACKWARD) == expected
    # The forward default is unchanged: d = 0 is the largest group.
    assert gathered_peak(layout, 0, 1, phase=FORWARD) == 8


def test_root_unit_bytes_is_group_zero_gathered():
    layout = mixed_layout()
    # group 0's chunks, 8 + 6 + 4 elements, gathered in bf16
    assert root_unit_bytes(layout) == (8 + 6 + 4) * 2
    assert root_unit_bytes(layout, param_bytes=4) == (8 + 6 + 4) * 4
    with pytest.raises(ValueError, match="param_bytes"):
        root_unit_bytes(layout, param_bytes=0)


def test_figures_in_the_memory_notes():
    """GPT-NeoX-20B: about 370 GB per rank unsharded at 18 bytes a parameter
    (2 + 4 + 12), 46 GB per rank with ZeRO-3 over 8 ranks (memory model, and the
    GPT-NeoX chapter's index)."""
    from labml_zero.neox.model import build_layers, gpt_neox_20b

    psi = sum(p.numel() for layer in build_layers(gpt_neox_20b(), device="meta")
              for p in layer.parameters())
    assert round(psi / 1e9, 1) == 20.6
    # The GPT-NeoX chapter's figures: 20.55e9 parameters, 41 GB of 16-bit weights.
    assert round(psi / 1e9, 2) == 20.55
    assert round(2 * psi / 1e9) == 41
    assert 2 + 4 + 12 == 18
    assert round(zero_model_states(psi, 0, 1, grad_bytes=4) / 1e9, -1) == 370
    assert round(zero_model_states(psi, 0, 8, grad_bytes=4) / 1e9) == 46
