"""The packing rules of the chunk layout page, one test each, on layouts small
enough to draw by hand (sizes in elements)."""

import pytest

from labml_zero.zero3.chunk_layout import ParamSpec, plan_chunks


def kinds(layout):
    """(group, trainable, chunk size, padding, parameter names) of each chunk."""
    return [
        (c.group, c.trainable, c.chunk_numel, c.padding,
         [layout.params[s.param_index].name for s in c.slots])
        for c in layout.chunks
    ]


def test_shards_are_equal_slices():
    # S = C / N_d: a chunk of 8 on 4 ranks has shards of 2.
    layout = plan_chunks([ParamSpec("w", (8,), True, 0)], 8, 4)
    (chunk,) = layout.chunks
    assert layout.shard_numel(chunk) == 8 // 4 == 2


def test_chunks_never_span_groups_or_kinds():
    params = [
        ParamSpec("a", (3,), True, 0), ParamSpec("f", (2,), False, 0),
        ParamSpec("b", (1,), True, 0), ParamSpec("c", (2,), True, 1),
    ]
    layout = plan_chunks(params, 8, 1)
    # a and b share group 0's trainable chunk (trimmed to 4); f is alone in the
    # frozen one; c is group 1's. Chunks sort by their first parameter.
    assert kinds(layout) == [
        (0, True, 4, 0, ["a", "b"]),
        (0, False, 2, 0, ["f"]),
        (1, True, 2, 0, ["c"]),
    ]


def test_a_parameter_that_does_not_fit_closes_the_chunk():
    params = [ParamSpec("a", (5,), True, 0), ParamSpec("b", (4,), True, 0)]
    layout = plan_chunks(params, 8, 1)
    # a's chunk is closed at the full size (3 padding); b's is the last, trimmed.
    assert kinds(layout) == [(0, True, 8, 3, ["a"]), (0, True, 4, 0, ["b"])]


def test_oversized_parameters_get_a_chunk_of_their_own():
    params = [ParamSpec("embed", (20,), True, 0), ParamSpec("x", (3,), True, 0)]
    layout = plan_chunks(params, 8, 2)
    # 20 rounds to the granule 2; x stays in the open chunk, trimmed to 4.
    assert kinds(layout) == [(0, True, 20, 0, ["embed"]), (0, True, 4, 1, ["x"])]


def test_offsets_are_aligned_and_sizes_are_granules():
    params = [ParamSpec("a", (3,), True, 0), ParamSpec("b", (3,), True, 0)]
    layout = plan_chunks(params, 10, 2, align=4)
    # Granule 2 * 4 = 8: the chunk size 10 becomes 16; b starts at 4.
    assert layout.chunk_numel == 16
    (chunk,) = layout.chunks
    assert [s.offset for s in chunk.slots] == [0, 4]
    assert chunk.chunk_numel == 8 and chunk.padding == 2


def test_out_of_order_groups_are_refused():
    params = [ParamSpec("a", (1,), True, 1), ParamSpec("b", (1,), True, 0)]
    with pytest.raises(ValueError, match="execution order"):
        plan_chunks(params, 4, 1)
