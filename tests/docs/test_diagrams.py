"""`docs_src/diagrams.py`: every figure is drawn from the code or the measured
trace, readable at full width, with a hover title on its marks."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "docs_src" / "figures" / "step_timeline.json"


def load_diagrams():
    name = "_diagrams_under_test"
    path = REPO / "docs_src" / "diagrams.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def diagrams():
    return load_diagrams()


@pytest.fixture(scope="module")
def figures(diagrams):
    return diagrams.figures(REPO, json.loads(TRACE.read_text()))


def test_every_figure_is_drawn(figures):
    assert sorted(figures) == [
        "figures/chunk_layout.svg", "figures/placement.svg",
        "figures/shard_collectives.svg", "figures/step_timeline.svg",
    ]


def test_figures_are_full_width_with_readable_labels(figures):
    # 1300 units wide: shown at the width of a 1400 px page, 12 px stays >= 11.
    for name, svg in figures.items():
        width = float(re.search(r'viewBox="0 0 ([0-9.]+) ', svg).group(1))
        assert width >= 1300, name
        sizes = [float(s) for s in re.findall(r"font-size:([0-9.]+)px", svg)]
        assert sizes and min(sizes) >= 12, (name, min(sizes))
        assert "<title>" in svg, name


def test_shards_follow_plan_chunks(diagrams, figures):
    layout_mod = diagrams._load_chunk_layout(REPO)
    svg = figures["figures/shard_collectives.svg"]
    shapes = diagrams.model_layer_shapes(4)
    specs = [layout_mod.ParamSpec(n, s, True, 0) for n, s, _ in shapes]
    numel = sum(spec.numel for spec in specs)
    for n in (2, 3, 4):
        layout = layout_mod.plan_chunks(specs, numel, n)
        (chunk,) = layout.chunks
        shard = layout.shard_numel(chunk)
        assert (f"N_d = {n}: chunk of {chunk.chunk_numel} elements "
                f"({chunk.padding} padding), shards of S = {shard}") in svg
        # one hover per rank for its shard, and one per (rank, owner) in the full
        # buffer
        for rank in range(n):
            assert f"rank {rank} keeps elements [{rank * shard}, " in svg
    # 3 ranks do not divide 244: the chunk is padded to 246.
    assert "chunk of 246 elements (2 padding)" in svg


def test_placement_follows_placement_py(diagrams, figures):
    placement = diagrams._load_module(REPO, "labml_zero/planner/placement.py",
                                      "_placement_under_test")
    layout_mod = diagrams._load_chunk_layout(REPO)
    shapes = diagrams.neox_group_shapes(n_layers=44, d_model=6144, vocab=50432)
    specs = [layout_mod.ParamSpec(n, s, True, g) for n, s, g in shapes]
    assert len({g for _, _, g in shapes}) == 47  # embed, 44 layers, norm, readout
    largest = 12 * 6144**2 + 13 * 6144  # one chunk per layer
    layout = layout_mod.plan_chunks(specs, largest, 2, align=64)
    shards = [placement.ShardSpec(layout.shard_numel(c), c.trainable)
              for c in layout.chunks]
    chosen = placement.StaticPlacement(optimizer_cpu_fraction=0.4).place(shards)
    split = placement.resident_bytes(chosen, shards)
    svg = figures["figures/placement.svg"]
    assert (f"device {split.device / 1e9:.0f} GB, host "
            f"{split.host / 1e9:.0f} GB per rank") in svg
    host = svg.count("master, m, v on the host")
    assert host == len(chosen.optimizer_on_host) + len(layout.chunks)  # 2nd: all


def test_timeline_source_says_what_was_measured(diagrams):
    trace = json.loads(TRACE.read_text())
    assert diagrams.validate_trace(trace, "step_timeline.json")
    event = {"name": "a", "stream": "gather", "start": 0, "end": 1}
    for source in ("run16 on 2xH200", "results/run-peer.jsonl"):
        with pytest.raises(ValueError, match="names a run or a result file"):
            diagrams.validate_trace({"source": source, "events": [event]})


def _visible(svg: str) -> str:
    """The figure's text a reader sees without hovering (no <title>)."""
    svg = re.sub(r"<title>.*?</title>", " ", svg, flags=re.S)
    return " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", svg))


def test_what_a_figure_shows_on_hover_is_also_written_in_it(diagrams, figures):
    # Chunk layout: every parameter of a layer and of the last group, norms
    # and biases included, with its elements and offset in the chunk.
    text = _visible(figures["figures/chunk_layout.svg"])
    for name, shape, group in diagrams.pythia_160m_shapes():
        if group in (1, 13):
            short = name.split(".", 2)[-1] if name.startswith("layers.") else name
            assert short in text, short
    assert "input_layernorm.bias 768 768 768" in text  # shape, elements, offset
    # Shard collectives: each rank's slice and what it holds.
    text = _visible(figures["figures/shard_collectives.svg"])
    for n in (2, 3, 4):
        assert text.count(f"rank {n - 1} keeps [") >= 1
    assert "rank 0 keeps [0, 122): ln1.w, ln1.b" in text
    # Placement: which chunks are on the host, for each placement.
    text = _visible(figures["figures/placement.svg"])
    assert text.count("optimizer state on the host:") == 2
    assert "parameter shards on the host: none" in text


def test_the_shards_figure_lists_parameters_in_the_models_order(diagrams, figures):
    """Each rank's hover names the parameters the real model puts in its shard:
    the figure follows `TransformerLayer`'s registration order, and the
    hand-written shapes of the other figures follow it too."""
    from labml_zero.neox import config as neox_config
    from labml_zero.neox import model as neox_model

    config = neox_config.NeoXConfig(n_vocab=1, d_model=4, n_heads=1, n_layers=1,
                                    d_ff=16, rotary_pct=0.5)
    layer = neox_model.build_layers(config, device="meta")[1]
    real = [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
    assert [(n, s) for n, s, _ in diagrams.model_layer_shapes(4)] == real
    hand = [(n.split(".", 2)[2], s) for n, s, g in
            diagrams.pythia_160m_shapes(n_layers=1, d_model=4, vocab=1) if g == 1]
    assert hand == real
    # rank 0's shard on 4 ranks starts with the layer's first parameter
    svg = figures["figures/shard_collectives.svg"]
    first = re.search(r"rank 0 keeps elements \[0, \d+\) of the chunk: ([^<]*)<",
                      svg)
    assert first and first.group(1).split(", ")[0] == real[0][0]
