"""The chunk-size search, on layouts small enough to score by hand."""

import time

import pytest

from labml_zero.zero3.chunk_layout import ParamSpec, plan_chunks
from labml_zero.zero3.chunk_search import ChunkSearchConfig, search_chunk_size
from labml_zero.zero3.memory_model import gathered_peak, zero3_step_comm

MEBI = 2**20


def config(*, search_range: int, **kwargs) -> ChunkSearchConfig:
    """A search over `search_range` elements, in steps of 1 element by default,
    scoring 1-byte elements so bytes read as elements."""
    base = dict(
        hidden_dim=1,
        search_range_m=search_range / MEBI,
        filter_exlarge_params=False,
        prefetch_depth=0,
        param_bytes=1,
    )
    return ChunkSearchConfig(**{**base, **kwargs})


def table(result):
    rows = result.candidates
    return [(r.chunk_numel, r.padding, r.peak_gathered_bytes) for r in rows]


def two_groups():
    # Group 0 holds 2 + 3 elements, group 1 a single element.
    return [
        ParamSpec("a", (2,), True, 0),
        ParamSpec("b", (3,), True, 0),
        ParamSpec("c", (1,), True, 1),
    ]


def test_padding_alone_picks_a_degenerate_size():
    # Candidates 3, 4, 5 (the largest parameter is 3):
    # * c = 3: [a|.] [b] | [c|..]   padding 1 + 0 + 2 = 3, group 0 gathers 6
    # * c = 4: [a|..] [b|.] | [c|...] padding 2 + 1 + 3 = 6, group 0 gathers 8
    # * c = 5: [a b] | [c|....]     padding 0 + 4 = 4, group 0 gathers 5
    expected = [(3, 3, 6), (4, 6, 8), (5, 4, 5)]
    padding_only = search_chunk_size(
        two_groups(), 1, config=config(search_range=2, memory_weight=0.0)
    )
    assert table(padding_only) == expected
    # Padding alone splits layer 0 into two chunks: one more collective each
    # way, and a larger peak (6 against 5).
    assert padding_only.chunk_numel == 3
    assert padding_only.collectives == 3 + 3 + 3

    # With lambda = 2: 3 + 2 * 6 = 15, 6 + 2 * 8 = 22, 4 + 2 * 5 = 14.
    weighted = search_chunk_size(
        two_groups(), 1, config=config(search_range=2, memory_weight=2.0)
    )
    assert [r.score for r in weighted.candidates] == [15, 22, 14]
    assert weighted.chunk_numel == 5
    assert (weighted.padding, weighted.peak_gathered_bytes) == (4, 5)
    assert weighted.collectives == 2 + 2 + 2


def test_ties_go_to_the_larger_chunk():
    # With lambda = 1: 3 + 6 = 9 and 4 + 5 = 9 tie; c = 5 needs fewer collectives.
    result = search_chunk_size(
        two_groups(), 1, config=config(search_range=2, memory_weight=1.0)
    )
    assert [r.score for r in result.candidates] == [9, 14, 9]
    assert result.chunk_numel == 5


def test_result_agrees_with_the_memory_model():
    # The search scores group shapes separately; the full layout must agree.
    params = [ParamSpec(f"l{g}.{k}", (n,), True, g)
              for g in range(4) for k, n in enumerate([5, 3, 2, 7])]
    cfg = config(search_range=12, prefetch_depth=1, param_bytes=2)
    result = search_chunk_size(params, 2, config=cfg)
    for row in result.candidates:
        layout = plan_chunks(params, row.chunk_numel, 2)
        assert row.padding == layout.padding()
        assert row.waste_bytes == 2 * layout.padding()
        assert row.chunks == len(layout.chunks)
        assert row.peak_gathered_bytes == gathered_peak(layout, 1, 2)
        assert row.collectives == zero3_step_comm(layout).collectives
    assert result.layout == plan_chunks(params, result.chunk_numel, 2)
    assert result.padding == result.layout.padding()


def test_oversized_parameters_are_left_out_of_the_range():
    # An embedding of 1000 and ten layers of [4, 4]. Sizes: mean 1080 / 21 =
    # 51.4, population std 212.1, so the limit is 687.8 and only the embedding
    # is above it.
    params = [ParamSpec("embed", (1000,), True, 0)] + [
        ParamSpec(f"l{g}.{k}", (4,), True, g) for g in range(1, 11) for k in range(2)
    ]
    cfg = config(search_range=8, hidden_dim=4, filter_exlarge_params=True)
    result = search_chunk_size(params, 1, config=cfg)
    assert result.excluded == ("embed",)
    # Candidates start at the largest kept parameter, 4:
    # * c = 4: every layer [4] [4], the embedding alone: no padding, peak 1000
    # * c = 8: every layer [4 4]: no padding, peak 1000
    # A tie, so c = 8, with 11 chunks instead of 21.
    # c = 12 is never scored: at c = 8 every layer fits one chunk already, so
    # larger sizes only add padding.
    assert table(result) == [(4, 0, 1000), (8, 0, 1000)]
    assert result.chunk_numel == 8
    assert [r.chunks for r in result.candidates] == [21, 11]
    # The embedding still has its own chunk, sized to fit.
    assert result.layout.chunks[0].chunk_numel == 1000

    # Without the filter the embedding sets the start and every layer is padded
    # to 1000.
    unfiltered = search_chunk_size(
        params, 1, config=config(search_range=8, hidden_dim=4)
    )
    assert unfiltered.excluded == ()
    assert unfiltered.candidates[0].chunk_numel == 1000
    assert unfiltered.padding == 10 * (1000 - 8)


def test_skipped_candidates_would_have_lost():
    # The case above: c = 12 is skipped as saturated; it would score worse.
    params = [ParamSpec("embed", (1000,), True, 0)] + [
        ParamSpec(f"l{g}.{k}", (4,), True, g) for g in range(1, 11) for k in range(2)
    ]
    skipped = plan_chunks(params, 12, 1)
    # Each layer [4 4|....]: padding 40, and the embedding still sets the peak.
    assert skipped.padding() == 40
    assert 40 + gathered_peak(skipped, 0, 1) > 0 + 1000


def test_start_is_raised_to_the_largest_parameter():
    params = [ParamSpec("w", (5,), True, 0), ParamSpec("v", (2,), True, 1)]
    # Steps of 3: 5 is raised to the next multiple, 6.
    result = search_chunk_size(params, 1, config=config(search_range=0, hidden_dim=3))
    assert [r.chunk_numel for r in result.candidates] == [6]
    # A floor above it (9 elements) moves the start to 9.
    floor = config(search_range=0, hidden_dim=3, min_chunk_size_m=9 / MEBI)
    result = search_chunk_size(params, 1, config=floor)
    assert result.chunk_numel == 9


def test_candidates_are_rounded_to_the_world_size():
    # Group 0 = [3, 3, 3], group 1 = [2], on 3 ranks, in steps of 2 from 4:
    # requested 4, 6, 8 become 6, 6, 9; the duplicate 6 is scored once.
    # * c = 6: [3 3] [3|...] | [2|....]  padding 3 + 4 = 7, peak 12
    # * c = 9: [3 3 3] | [2|.......]     padding 0 + 7 = 7, peak 9
    params = [ParamSpec(f"w{k}", (3,), True, 0) for k in range(3)]
    params.append(ParamSpec("b", (2,), True, 1))
    result = search_chunk_size(params, 3, config=config(search_range=4, hidden_dim=2))
    assert table(result) == [(6, 7, 12), (9, 7, 9)]
    assert result.candidates_in_range == 3
    assert result.chunk_numel == 9
    assert all(c.chunk_numel % 3 == 0 for c in result.layout.chunks)


def test_gpt_neox_20b_is_fast_and_packs_the_attention_into_one_chunk():
    h, vocab = 6144, 50432
    layer = [
        ("ln1.w", (h,)), ("ln1.b", (h,)), ("ln2.w", (h,)), ("ln2.b", (h,)),
        ("qkv.w", (3 * h, h)), ("qkv.b", (3 * h,)),
        ("dense.w", (h, h)), ("dense.b", (h,)),
        ("h_to_4h.w", (4 * h, h)), ("h_to_4h.b", (4 * h,)),
        ("4h_to_h.w", (h, 4 * h)), ("4h_to_h.b", (h,)),
    ]
    params = [ParamSpec("embed", (vocab, h), True, 0)]
    for i in range(44):
        params += [ParamSpec(f"l{i}.{n}", s, True, i + 1) for n, s in layer]
    params += [ParamSpec("ln_f.w", (h,), True, 45), ParamSpec("ln_f.b", (h,), True, 45)]
    params.append(ParamSpec("head", (vocab, h), True, 46))
    cfg = ChunkSearchConfig(hidden_dim=h, search_range_m=1.0, prefetch_depth=1)

    began = time.perf_counter()
    result = search_chunk_size(params, 2, config=cfg)
    elapsed = time.perf_counter() - began
    assert elapsed < 5.0, f"search took {elapsed:.1f} s"

    assert result.excluded == ("embed", "head")
    assert result.candidates_in_range == MEBI // h + 1
    # The start is the 4h x h projection. The best size is the smallest that
    # holds the layer norms, QKV and the attention output in one chunk: then the
    # MLP's two halves (with the biases) fill one chunk each almost exactly.
    numels = [params[1 + k].numel for k in range(len(layer))]
    assert result.candidates[0].chunk_numel == 4 * h * h
    assert result.chunk_numel == sum(numels[:7])
    assert len(result.layout.chunks_of_group(1)) == 3


@pytest.mark.parametrize(
    "knob, value",
    [
        ("hidden_dim", 0),
        ("min_chunk_size_m", -1.0),
        ("search_range_m", float("nan")),
        ("filter_exlarge_params", "yes"),
        ("prefetch_depth", -1),
        ("align", 0),
        ("param_bytes", 0),
        ("memory_weight", -0.5),
        ("max_candidates", 0),
    ],
)
def test_invalid_knobs_name_themselves(knob, value):
    with pytest.raises(ValueError, match=knob) as info:
        ChunkSearchConfig(**{knob: value})
    assert "\n" not in str(info.value)


def test_too_many_candidates():
    with pytest.raises(ValueError, match="max_candidates"):
        ChunkSearchConfig(hidden_dim=1, search_range_m=32.0)


def test_bad_parameter_lists():
    with pytest.raises(ValueError, match="params is empty"):
        search_chunk_size([], 1, config=ChunkSearchConfig())
    out_of_order = [ParamSpec("a", (4,), True, 1), ParamSpec("b", (4,), True, 0)]
    with pytest.raises(ValueError, match="execution order"):
        search_chunk_size(out_of_order, 1, config=ChunkSearchConfig())
    with pytest.raises(ValueError, match="world_size"):
        search_chunk_size(two_groups(), 0, config=ChunkSearchConfig())
