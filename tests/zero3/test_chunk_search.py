"""The chunk-size search, on layouts small enough to score by hand.

Sizes in the comments are in elements; `[2.]` is a chunk holding a parameter of 2
and one element of padding. The last chunk of each kind in a group is trimmed to
what it holds (rounded up to the granule N_d * align).
"""

import math
import random
import time

import pytest

from labml_zero.zero3.chunk_layout import ParamSpec, plan_chunks, round_up
from labml_zero.planner.chunk_search import (
    ChunkSearchConfig,
    excluded_params,
    score_candidate,
    search_chunk_size,
    start_size,
)
from labml_zero.planner.chunk_search_shortcuts import group_shapes
from labml_zero.planner.grad_buffers import largest_grad_buffer
from labml_zero.planner.memory_model import (
    gathered_peak,
    layout_model_states,
    zero3_step_comm,
    zero_model_states,
)

MEBI = 2**20


def config(*, search_range: int, **kwargs) -> ChunkSearchConfig:
    """A search over `search_range` elements, in steps of 1 element by default,
    scoring 1-byte parameters and gradients so bytes read as elements."""
    base = dict(
        hidden_dim=1,
        search_range_m=search_range / MEBI,
        filter_exlarge_params=False,
        prefetch_depth=0,
        param_bytes=1,
        # the hand-computed cases score bytes only; the collective term has its
        # own test
        collective_bytes=0,
        grad_bytes=1,
    )
    return ChunkSearchConfig(**{**base, **kwargs})


def table(rows):
    """(c, padding, peak gathered, gradient buffer) of each row."""
    return [(r.chunk_numel, r.padding, r.peak_gathered_bytes, r.grad_buffer_bytes)
            for r in rows]


def every_row(params, world_size, cfg):
    """Every candidate of the range scored, none skipped: the rows the notes'
    tables show. The search scores only those where the packing changes."""
    shapes, shape_of_group = group_shapes(params)
    return [score_candidate(shapes, shape_of_group, c, world_size, cfg)[0]
            for c in candidate_sizes(params, world_size, cfg)]


def candidate_sizes(params, world_size, cfg):
    """Every size of the range, rounded to the granule, each once."""
    start = start_size(params, excluded_params(params), cfg)
    sizes = range(start, start + cfg.search_range + 1, cfg.hidden_dim)
    return sorted({round_up(size, world_size * cfg.align) for size in sizes})


def two_groups():
    # Group 0 holds 2 + 3 elements, group 1 a single element.
    return [
        ParamSpec("a", (2,), True, 0),
        ParamSpec("b", (3,), True, 0),
        ParamSpec("c", (1,), True, 1),
    ]


# Candidates 3, 4, 5 (the largest parameter is 3), on one rank:
# * c = 3: [a|.] [b] | [c]     padding 1, group 0 gathers 6, largest chunk 3
# * c = 4: [a|..] [b] | [c]    padding 2, group 0 gathers 7, largest chunk 4
# * c = 5: [a b] | [c]         padding 0, group 0 gathers 5, largest chunk 5
# ([b] and [c] are their group's last chunks, so trimmed to 3 and 1.) The
# gradient buffer term is the largest chunk's held gradients (p = 1) and its
# buffer (g = 1): twice its size.
TWO_GROUPS_TABLE = [(3, 1, 6, 2 * 3), (4, 2, 7, 2 * 4), (5, 0, 5, 2 * 5)]


def test_padding_alone_picks_the_giant_chunk():
    cfg = config(search_range=2, memory_weight=0.0)
    padding_only = search_chunk_size(two_groups(), 1, config=cfg)
    assert table(every_row(two_groups(), 1, cfg)) == TWO_GROUPS_TABLE
    # Padding alone: 1, 2, 0. The trim leaves one chunk per group unpadded.
    assert [r.score for r in every_row(two_groups(), 1, cfg)] == [1, 2, 0]
    # c = 4 packs as c = 3 did ([a|..] [b]: b fits beside a only from 2 + 3 =
    # 5), with more padding, so the search scores 3 and 5 only.
    assert table(padding_only.candidates) == [TWO_GROUPS_TABLE[0], TWO_GROUPS_TABLE[2]]
    assert padding_only.chunk_numel == 5
    assert [len(padding_only.layout.chunks_of_group(g)) for g in (0, 1)] == [1, 1]


def test_the_gradient_buffer_picks_a_smaller_chunk():
    # bf16 parameters (p = 2), fp32 gradients (g = 4), lambda = 1:
    # waste 2 * padding + (2 * peak + (2 + 4) * largest trainable chunk), the
    # chunk's held bf16 gradients beside its fp32 buffer
    # * c = 3: 2 * 1 + (2 * 6 + 6 * 3) = 2 + 12 + 18 = 32
    # * c = 4: 2 * 2 + (2 * 7 + 6 * 4) = 4 + 14 + 24 = 42
    # * c = 5: 2 * 0 + (2 * 5 + 6 * 5) = 0 + 10 + 30 = 40
    cfg = config(search_range=2, param_bytes=2, grad_bytes=4, memory_weight=1.0)
    result = search_chunk_size(two_groups(), 1, config=cfg)
    assert [r.score for r in every_row(two_groups(), 1, cfg)] == [32, 42, 40]
    assert [r.score for r in result.candidates] == [32, 40]
    assert result.chunk_numel == 3
    assert (result.waste_bytes, result.peak_gathered_bytes) == (2, 12)
    assert result.grad_buffer_bytes == 18
    # Layer 0 is split: its gradient is reduced in two pieces, at one more
    # collective each way (3 chunks, all trainable: 3 + 3 + 3).
    assert result.collectives == 3 + 3 + 3
    # grad_bytes = 4 is the default, for the engine's fp32 reduce.
    assert ChunkSearchConfig().grad_bytes == 4


def test_ties_go_to_the_larger_chunk():
    # p = 2, g = 1, lambda = 1/2: 2 + (12 + 9) / 2 = 12.5, 4 + (14 + 12) / 2 = 17,
    # 0 + (10 + 15) / 2 = 12.5. c = 3 and c = 5 tie; c = 5 needs 2 + 2 + 2
    # collectives against 3 + 3 + 3.
    cfg = config(search_range=2, param_bytes=2, grad_bytes=1, memory_weight=0.5)
    result = search_chunk_size(two_groups(), 1, config=cfg)
    assert [r.score for r in every_row(two_groups(), 1, cfg)] == [12.5, 17, 12.5]
    assert result.chunk_numel == 5
    assert result.collectives == 2 + 2 + 2


def layer_model():
    # An embedding of 1000 and ten layers of [4, 4], all trainable.
    return [ParamSpec("embed", (1000,), True, 0)] + [
        ParamSpec(f"l{g}.{k}", (4,), True, g) for g in range(1, 11) for k in range(2)
    ]


def test_oversized_parameters_are_left_out_of_the_range():
    # Sizes: mean 1080 / 21 = 51.4, population std 212.1, so the limit is 687.8
    # and only the embedding is above it.
    params = layer_model()
    cfg = config(search_range=8, hidden_dim=4, filter_exlarge_params=True)
    result = search_chunk_size(params, 1, config=cfg)
    assert result.excluded == ("embed",)
    # Candidates start at the largest kept parameter, 4:
    # * c = 4: every layer [4] [4], the embedding alone: no padding, peak 1000,
    #   and the embedding's chunk is the largest gradient buffer, 1000 held
    #   and 1000 in the buffer
    # * c = 8: every layer [4 4]: the same terms, 0 + (1000 + 2000)
    # A tie between two layouts, so c = 8, with 11 chunks instead of 21.
    # c = 12 is never scored: at c = 8 every layer is one chunk already, so a
    # larger size packs the same chunks (see the next test).
    assert table(result.candidates) == [(4, 0, 1000, 2000), (8, 0, 1000, 2000)]
    assert result.chunk_numel == 8
    assert [r.chunks for r in result.candidates] == [21, 11]
    # The embedding still has its own chunk, sized to fit.
    assert result.layout.chunks[0].chunk_numel == 1000

    # Without the filter the embedding sets the start, 1000: every layer is one
    # trimmed chunk of 8 there, the range can no longer split a layer, and the
    # first candidate's packing can change at no larger size: one row.
    unfiltered = search_chunk_size(
        params, 1, config=config(search_range=8, hidden_dim=4)
    )
    assert unfiltered.excluded == ()
    assert [r.chunk_numel for r in unfiltered.candidates] == [1000]
    assert [c.chunk_numel for c in unfiltered.layout.chunks] == [1000] + [8] * 10


def test_skipped_candidates_pack_the_same_chunks():
    # The case above: c = 12 is skipped, no decision of the packer flipping
    # between 8 and it. With the trim it packs
    # exactly the chunks of c = 8 (each layer [4 4], trimmed to 8), so it scores
    # the same, and the same layout keeps its first size.
    params = layer_model()
    assert plan_chunks(params, 12, 1).chunks == plan_chunks(params, 8, 1).chunks


def exhaustive(params, world_size, cfg):
    """Score every candidate on the full layout, with the search's tie rule:
    a tie goes to the larger size unless it packs the same chunks."""
    best = None
    for c in candidate_sizes(params, world_size, cfg):
        layout = plan_chunks(params, c, world_size, align=cfg.align)
        score = cfg.param_bytes * layout.padding() + cfg.memory_weight * (
            gathered_peak(layout, cfg.prefetch_depth, cfg.param_bytes)
            + largest_grad_buffer(layout, cfg.grad_bytes, cfg.param_bytes)
        )
        if best is None or score < best[0] or (
            score == best[0] and layout.chunks != best[1].chunks
        ):
            best = (score, layout)
    return best


def random_model(rng: random.Random) -> list[ParamSpec]:
    """2 to 5 groups of small parameters of mixed kinds, and often one large
    one (an embedding) that stays oversized over part of the range."""
    sizes = [
        [rng.choice([1, 2, 3, 5, 8]) for _ in range(rng.randint(2, 4))]
        for _ in range(rng.randint(2, 5))
    ]
    if rng.random() < 0.7:
        rng.choice(sizes).insert(0, rng.randint(14, 40))
    return [
        ParamSpec(f"p{g}.{k}", (n,), rng.random() < 0.7, g)
        for g, group in enumerate(sizes)
        for k, n in enumerate(group)
    ]


def test_the_skip_is_exact():
    # The search (shapes packed once, sizes that pack alike skipped) must pick what
    # scoring every candidate picks, on random models.
    rng = random.Random(0)
    skipped = 0
    for trial in range(400):
        params = random_model(rng)
        world_size, align = rng.choice([(1, 1), (2, 1), (2, 2), (3, 1)])
        cfg = config(
            search_range=40,
            filter_exlarge_params=True,
            prefetch_depth=rng.randint(0, 2),
            align=align,
            param_bytes=2,
            grad_bytes=rng.choice([2, 4]),
            memory_weight=rng.choice([0.0, 0.5, 1.0]),
        )
        result = search_chunk_size(params, world_size, config=cfg)
        score, layout = exhaustive(params, world_size, cfg)
        assert (result.score, result.layout.chunks) == (score, layout.chunks), trial
        assert result.chunk_numel == layout.chunk_numel, trial
        skipped += len(result.candidates) < len(candidate_sizes(params, world_size, cfg))
    # The skip really ran in most trials.
    assert skipped > 200


def test_result_agrees_with_the_memory_model():
    # The search scores group shapes separately; the full layout must agree.
    params = [
        ParamSpec(f"l{g}.{k}", (n,), k != 1, g)
        for g in range(4)
        for k, n in enumerate([5, 3, 2, 7])
    ]
    cfg = config(search_range=12, prefetch_depth=1, align=2, param_bytes=2)
    result = search_chunk_size(params, 2, config=cfg)
    for row in result.candidates:
        layout = plan_chunks(params, row.chunk_numel, 2, align=2)
        assert row.padding == layout.padding()
        assert row.waste_bytes == 2 * layout.padding()
        assert row.chunks == len(layout.chunks)
        assert row.peak_gathered_bytes == gathered_peak(layout, 1, 2)
        assert row.grad_buffer_bytes == largest_grad_buffer(layout, 1, 2)
        assert row.collectives == zero3_step_comm(layout).collectives
    assert result.layout == plan_chunks(params, result.chunk_numel, 2, align=2)
    assert result.padding == result.layout.padding()


def test_start_is_raised_to_the_largest_parameter():
    params = [ParamSpec("w", (5,), True, 0), ParamSpec("v", (2,), True, 1)]
    # Steps of 3: 5 is raised to the next multiple, 6.
    result = search_chunk_size(params, 1, config=config(search_range=0, hidden_dim=3))
    assert [r.chunk_numel for r in result.candidates] == [6]
    # A floor above it (9 elements) moves the start to 9.
    floor = config(search_range=0, hidden_dim=3, min_chunk_size_m=9 / MEBI)
    result = search_chunk_size(params, 1, config=floor)
    assert result.chunk_numel == 9


def test_candidates_are_rounded_to_the_granule():
    # Group 0 = [3, 3, 3], group 1 = [2], on 2 ranks with align 2: the granule
    # is 2 * 2 = 4. In steps of 2 from 4, requested 4, 6, 8 become 4, 8, 8 (6
    # would split over 2 ranks, but into shards of 3, not aligned); the
    # duplicate 8 is scored once. Offsets are even, so a 3 skips one element:
    # * c = 4: [3.] [3.] [3.] | [2..]   padding 3 + 2 = 5, peak 12, buffer 2 * 4
    # * c = 8: [3. 3.] [3.] | [2..]     padding 3 + 2 = 5, peak 12, buffer 2 * 8
    # ([3.] and [2..] are trimmed tails: 3 and 2 rounded up to 4.)
    # Scores, p = g = 1: 5 + (12 + 8) = 25 and 5 + (12 + 16) = 33.
    params = [ParamSpec(f"w{k}", (3,), True, 0) for k in range(3)]
    params.append(ParamSpec("b", (2,), True, 1))
    cfg = config(search_range=4, hidden_dim=2, align=2)
    result = search_chunk_size(params, 2, config=cfg)
    assert table(result.candidates) == [(4, 5, 12, 8), (8, 5, 12, 16)]
    assert [r.score for r in result.candidates] == [25, 33]
    assert result.candidates_in_range == 3
    assert result.chunk_numel == 4
    assert all(c.chunk_numel % 4 == 0 for c in result.layout.chunks)


H, VOCAB = 6144, 50432
NEOX_LAYER = [
    ("ln1.w", (H,)), ("ln1.b", (H,)), ("ln2.w", (H,)), ("ln2.b", (H,)),
    ("qkv.w", (3 * H, H)), ("qkv.b", (3 * H,)),
    ("dense.w", (H, H)), ("dense.b", (H,)),
    ("h_to_4h.w", (4 * H, H)), ("h_to_4h.b", (4 * H,)),
    ("4h_to_h.w", (H, 4 * H)), ("4h_to_h.b", (H,)),
]


def neox_20b(trainable) -> list[ParamSpec]:
    """GPT-NeoX-20B's parameter shapes; `trainable(name)` picks the kind."""
    def spec(name, shape, group):
        return ParamSpec(name, shape, trainable(name.split(".", 1)[-1]), group)

    params = [spec("embed", (VOCAB, H), 0)]
    for i in range(44):
        params += [spec(f"l{i}.{n}", s, i + 1) for n, s in NEOX_LAYER]
    params += [spec("ln_f.w", (H,), 45), spec("ln_f.b", (H,), 45)]
    params.append(spec("head", (VOCAB, H), 46))
    return params


def numel(name: str) -> int:
    return math.prod(dict(NEOX_LAYER)[name])


def neox_config() -> ChunkSearchConfig:
    # The engine's align (64) on 2 ranks: a granule of 128, which divides h.
    return ChunkSearchConfig(
        hidden_dim=H, search_range_m=1.0, prefetch_depth=1, align=64
    )


def test_gpt_neox_20b_is_fast_and_packs_a_layer_into_three_chunks():
    params = neox_20b(lambda name: True)
    began = time.perf_counter()
    result = search_chunk_size(params, 2, config=neox_config())
    elapsed = time.perf_counter() - began
    assert elapsed < 5.0, f"search took {elapsed:.1f} s"

    assert result.excluded == ("embed", "head")
    assert result.candidates_in_range == MEBI // H + 1
    # The start is the 4h x h projection; the range (2^20 < h^2) never reaches
    # a layer. The best size is the smallest that holds the layer norms, QKV
    # and the attention output weight in one chunk; the attention output bias
    # and the first MLP half then fit the second chunk, and the second MLP half
    # is the trimmed third.
    first = ["ln1.w", "ln1.b", "ln2.w", "ln2.b", "qkv.w", "qkv.b", "dense.w"]
    second = ["dense.b", "h_to_4h.w", "h_to_4h.b"]
    third = ["4h_to_h.w", "4h_to_h.b"]
    assert result.candidates[0].chunk_numel == numel("h_to_4h.w")
    c = sum(map(numel, first))
    assert result.chunk_numel == c
    chunks = result.layout.chunks_of_group(1)
    assert [x.chunk_numel for x in chunks] == [c, c, sum(map(numel, third))]
    # Padding: only the second chunk's tail, c - (dense.b + the first MLP half).
    per_layer = c - sum(map(numel, second))
    assert per_layer == 2 * H
    # The final layer norm's group is one trimmed chunk with no padding.
    assert result.padding == 44 * per_layer
    # The largest gradient buffer is the trainable embedding's, in fp32, beside
    # its held bf16 gradients.
    assert result.grad_buffer_bytes == (4 + 2) * VOCAB * H


def test_gpt_neox_20b_bias_only_has_no_trainable_padding():
    # The project's bias-only fine-tune trains three biases per layer.
    biases = ("qkv.b", "dense.b", "h_to_4h.b")
    params = neox_20b(lambda name: name in biases)
    result = search_chunk_size(params, 2, config=neox_config())
    # The frozen part decides: layer norms, QKV and attention output weights
    # fill the first frozen chunk, the MLP weights one each (the second one
    # trimmed, with the last bias); the biases share one trimmed chunk.
    c = sum(map(numel, ["ln1.w", "ln1.b", "ln2.w", "ln2.b", "qkv.w", "dense.w"]))
    assert result.chunk_numel == c
    trainable = [x for x in result.layout.chunks_of_group(1) if x.trainable]
    assert [x.chunk_numel for x in trainable] == [sum(map(numel, biases))]
    assert result.layout.padding(trainable=True) == 0
    # So the layout costs ZeRO's formula, with the frozen padding counted as
    # frozen elements.
    psi_t = sum(p.numel for p in params if p.trainable)
    psi_f = sum(p.numel for p in params if not p.trainable)
    frozen_padding = result.layout.padding(trainable=False)
    assert layout_model_states(result.layout) == zero_model_states(
        psi_t, psi_f + frozen_padding, 2
    )


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
        ("grad_bytes", 0),
        ("grad_bytes", 2.5),
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


def test_collective_cost_favours_fewer_chunks():
    # The notes' example (p = 2, g = 4, lambda = 1) scores 32, 42, 40 and picks
    # c = 3 (three chunks: 9 collectives a step) over c = 5 (two: 6). A fixed
    # cost of mu = 3 bytes per collective adds 27, 27, 18: 59, 69, 58, so c = 5.
    base = dict(param_bytes=2, grad_bytes=4, memory_weight=1.0)
    free_cfg = config(search_range=2, **base)
    free = search_chunk_size(two_groups(), 1, config=free_cfg)
    assert [r.collectives for r in every_row(two_groups(), 1, free_cfg)] == [9, 9, 6]
    assert free.chunk_numel == 3
    priced_cfg = config(search_range=2, collective_bytes=3, **base)
    priced = search_chunk_size(two_groups(), 1, config=priced_cfg)
    assert [r.score for r in every_row(two_groups(), 1, priced_cfg)] == [59, 69, 58]
    assert priced.chunk_numel == 5
    with pytest.raises(ValueError, match="collective_bytes"):
        ChunkSearchConfig(collective_bytes=-1)


def test_engine_defaults_give_gpt_neox_20b_one_chunk_per_layer():
    # The notes' claim: with the range stretched to a layer and 32 MiB per
    # collective, a 20B layer (12h² + 13h elements) is one chunk, unpadded.
    from labml_zero.neox.model import build_layers, gpt_neox_20b
    from labml_zero.zero3 import ZeroConfig
    from labml_zero.planner.sharding import choose_chunk_numel
    from labml_zero.zero3.unit_chunks import param_specs

    config = gpt_neox_20b()
    h = config.d_model
    layers = build_layers(config, device="meta")
    specs, _ = param_specs([layer.named_parameters() for layer in layers])
    chunk = choose_chunk_numel(specs, 2, ZeroConfig())
    assert chunk == 12 * h * h + 13 * h
    layout = plan_chunks(specs, chunk, 2, align=64)
    assert len(layout.chunks_of_group(1)) == 1
    assert layout.chunks_of_group(1)[0].padding == 0


def test_figures_in_the_search_notes():
    """Note: GPT-NeoX-20B's numbers: 47 groups and 5462 candidates for the default
    range; at c_0 = 4h^2 six chunks per layer, 40% of them padding; the 6 extra
    collectives per layer of three chunks cost 192 MiB at mu = 32 MiB, against a
    gradient buffer and held gradients 8h^2 * (4 + 2) bytes (1.8 GB) smaller."""

    params = neox_20b(lambda name: True)
    _, shape_of_group = group_shapes(params)
    assert len(shape_of_group) == 47
    assert ChunkSearchConfig(hidden_dim=H).num_candidates == 5462
    layer = [p for p in params if p.group == 1]
    assert sum(p.numel for p in layer) == 12 * H * H + 13 * H
    at_start = plan_chunks(layer, 4 * H * H, 2, align=64)
    assert len(at_start.chunks) == 6
    assert round(100 * at_start.padding() / at_start.total_numel()) == 40
    three, one = plan_chunks(layer, 4 * H * H + 7 * H, 2, align=64), plan_chunks(
        layer, 12 * H * H + 13 * H, 2, align=64)
    extra = (zero3_step_comm(three).collectives - zero3_step_comm(one).collectives)
    assert extra == 3 * 3 - 3 == 6
    mu = ChunkSearchConfig().collective_bytes
    assert extra * mu == 192 * MEBI
    assert round(8 * H * H * (4 + 2) / 1e9, 1) == 1.8
    assert (largest_grad_buffer(one, 4, 2) - largest_grad_buffer(three, 4, 2)
            == (2 + 4) * (12 * H * H + 13 * H - (4 * H * H + 7 * H)))


def test_sizes_in_m_are_mebi_elements():
    # The knobs ending in `_m` count ColossalAI's "m": 2^20 elements.
    from labml_zero.planner.chunk_search import MEBI as SEARCH_MEBI

    assert SEARCH_MEBI == 2**20
    knobs = ChunkSearchConfig(hidden_dim=64, min_chunk_size_m=1.5, search_range_m=2.0)
    assert knobs.min_chunk_size == 3 * 2**19
    assert knobs.search_range == 2 * 2**20


def test_20b_without_mu_packs_three_chunks():
    # Note: GPT-NeoX-20B, without the collective term: a range of R = 2^20 is less
    # than h^2, so one chunk per layer is out of reach, and c_0 + 7h packs a
    # layer into three chunks with 2h of padding.
    params = neox_20b(lambda name: True)
    knobs = ChunkSearchConfig(hidden_dim=H, search_range_m=1.0, align=64,
                              collective_bytes=0)
    assert knobs.search_range == 2**20 < H * H
    result = search_chunk_size(params, 2, config=knobs)
    assert result.candidates[0].chunk_numel == 4 * H * H
    assert result.chunk_numel == 4 * H * H + 7 * H
    chunks = result.layout.chunks_of_group(1)
    assert len(chunks) == 3
    assert sum(c.padding for c in chunks) == 2 * H
