"""
Build-time SVG figures for the notes site (loaded by `build_docs.py`).

`figures(root, trace)` returns every figure by its path under `site/`; a page
shows one with `![alt](figures/NAME.svg)`. Each is drawn from the code of the
tree at `root` (its files loaded by path, so the figure always shows the current
code) or from measured data:

* `chunk_layout.svg` (`chunk_layout_svg`): the layout that `plan_chunks`
  computes for a Pythia-160M-shaped GPT-NeoX, at two chunk sizes, with every
  chunk's parameters and padding. Page: `zero3/chunk_layout`.
* `shard_collectives.svg` (`shard_collectives_svg`): one chunk on 2, 3 and 4
  ranks: each rank's shard, the all-gather into the full buffer, the
  reduce-scatter back to a gradient shard. Pages: `zero3/index` (A step, in one
  picture) and `zero3/communication`.
* `placement.svg` (`placement_svg`): where each chunk's parameter shard,
  gradient and optimizer state live for GPT-NeoX-20B's shape under two static
  placements, from `placement.py`'s own functions. Page: `planner/placement`.
* `step_timeline.svg` (`timeline_svg(trace)`): one measured training step as
  lanes of streams, from `docs_src/figures/step_timeline.json`
  (`{"source": str, "events": [{"name", "stream", "start", "end"}, ...]}`,
  times in seconds; streams `gather`, `compute`, `reduce`; other fields, such as
  the GPU and the commit, stay in the data file). Pages: `zero3/index` and
  `zero3/hooks`.

The engine's figures (`shard_collectives_svg`, `placement_svg`) live in
`diagrams_engine.py` and the parts all figures share in `diagrams_common.py`;
this file loads both by their paths and re-exports what the builder and the tests
use. Figures are drawn 1300 units wide with labels of at least 12 px, for a full-width
place on the page; every mark has a `<title>`, shown on hover when the SVG is
inline, and what only a hover would tell is also written in the figure: the
chunk layout's table of every parameter of a layer and of the last group (the
norms and biases are too thin to see at scale), each rank's slice and what it
holds under the shard figure, the chunks each placement puts on the host.
Output is a pure function of the inputs: fixed number formats, no timestamps.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path


def _load_sibling(stem: str):
    """`docs_src/<stem>.py`, loaded by its path (the builder loads this file so)."""
    name = f"_labml_zero_{stem}"
    path = Path(__file__).resolve().parent / f"{stem}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_c = _load_sibling("diagrams_common")
_engine = _load_sibling("diagrams_engine")
FONT, WIDTH, _esc, _f, _numel = _c.FONT, _c.WIDTH, _c._esc, _c._f, _c._numel
_text, _svg, _load_module = _c._text, _c._svg, _c._load_module
_load_chunk_layout, pythia_160m_shapes = _c._load_chunk_layout, _c.pythia_160m_shapes
neox_group_shapes, model_layer_shapes = _c.neox_group_shapes, _c.model_layer_shapes
shard_collectives_svg = _engine.shard_collectives_svg
placement_svg = _engine.placement_svg
STREAMS = ("gather", "compute", "reduce")


# ---------------------------------------------------------------- chunk layout

def _kind(name: str) -> tuple[str, str, str]:
    """(legend label, short label, colour) of a parameter."""
    if "embed_in" in name:
        return "embedding", "embed", "#8e6cc4"
    if "embed_out" in name:
        return "readout", "readout", "#c45c8e"
    if "layernorm" in name or "layer_norm" in name:
        return "layer norm", "ln", "#2e9c6a"
    if "query_key_value" in name:
        return "attention QKV", "qkv", "#3d7cc9"
    if "attention.dense" in name:
        return "attention out", "out", "#7fb3e6"
    if "h_to_4h" in name:
        return "MLP up", "up", "#e69a3d"
    return "MLP down", "down", "#f0c27a"

def _group_label(group: int, n_layers: int) -> str:
    if group == 0:
        return "embedding"
    if group == n_layers + 1:
        return "final norm + readout"
    return f"layer {group - 1}"


def _chunk_panel(layout_mod, shapes, chunk_numel, world_size, y0, width):
    """SVG elements of one layout, starting at height `y0`; returns (parts, height)."""
    specs = [
        layout_mod.ParamSpec(name, shape, True, group) for name, shape, group in shapes
    ]
    layout = layout_mod.plan_chunks(specs, chunk_numel, world_size)
    n_layers = max(g for _, _, g in shapes) - 1
    label_w, row_h, gap = 140, 22, 6
    unit = 180.0 / layout.chunk_numel  # px per element: a regular chunk is 180 px
    broken_w = 260.0  # an oversized chunk is drawn with a break, not to scale
    total, used = layout.total_numel(), layout.used_numel()
    parts = [
        f'<text x="0" y="{y0 + 14}" style="{FONT};font-size:14px;font-weight:bold">'
        f"chunk_numel = {layout.chunk_numel:,} ({layout.chunk_numel * 2 / 2**20:.0f}"
        f" MiB in bf16), N_d = {world_size}:</text>",
        f'<text x="0" y="{y0 + 32}" style="{FONT};font-size:14px">'
        f"{len(layout.chunks)} chunks, padding "
        f"{total - used:,} elements ({100 * (total - used) / total:.1f}%)</text>",
    ]
    y = y0 + 44
    groups = sorted({c.group for c in layout.chunks})
    for group in groups:
        parts.append(
            f'<text x="0" y="{_f(y + 15)}" style="{FONT};font-size:13px">'
            f"{_esc(_group_label(group, n_layers))}</text>"
        )
        x = float(label_w)
        for chunk in layout.chunks_of_group(group):
            oversized = chunk.chunk_numel > layout.chunk_numel
            w = broken_w if oversized else chunk.chunk_numel * unit
            scale = w / chunk.chunk_numel
            parts.append(f'<g><title>chunk {chunk.index}: {chunk.chunk_numel:,} '
                         f"elements, {chunk.padding:,} padding</title>")
            for slot in chunk.slots:
                name = shapes[slot.param_index][0]
                _, short, colour = _kind(name)
                sx, sw = x + slot.offset * scale, slot.numel * scale
                parts.append(
                    f'<rect x="{_f(sx)}" y="{_f(y)}" width="{max(sw, 0.6):.2f}" '
                    f'height="{row_h}" fill="{colour}"><title>{_esc(name)} '
                    f"{list(shapes[slot.param_index][1])}: {slot.numel:,} elements, "
                    f"offset {slot.offset:,}</title></rect>"
                )
                if sw > 34:
                    label = short
                    if oversized:
                        label += f" {slot.numel / 1e6:.1f}M, not to scale"
                        sw *= 0.8  # keep the label left of the break
                    parts.append(
                        f'<text x="{_f(sx + sw / 2)}" y="{_f(y + 15)}" '
                        f'text-anchor="middle" style="{FONT};font-size:12px;'
                        f'fill:#fff">{_esc(label)}</text>'
                    )
            if chunk.padding:
                px = x + chunk.used_numel * scale
                pw = chunk.padding * scale
                parts.append(
                    f'<rect x="{_f(px)}" y="{_f(y)}" width="{max(pw, 0.6):.2f}" '
                    f'height="{row_h}" fill="url(#pad)"><title>padding: '
                    f"{chunk.padding:,} elements</title></rect>"
                )
            parts.append(
                f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" height="{row_h}" '
                f'fill="none" stroke="#222" stroke-width="1"/>'
            )
            if oversized:
                bx = x + w * 0.88
                parts.append(
                    f'<path d="M{_f(bx)} {_f(y - 2)} l4 6 l-6 6 l6 6 l-4 6" '
                    f'fill="none" stroke="#fff" stroke-width="3"/>'
                )
            parts.append("</g>")
            x += w + gap
        width[0] = max(width[0], x)
        y += row_h + 5
    return parts, y - y0


def _parameter_table(layout_mod, shapes, chunk_numel, world_size, groups, x0, y0):
    """
    The chunks of `groups` at one chunk size as a table of visible text, one row
    per parameter (what the drawing's thinnest boxes, norms and biases, cannot
    show): its chunk, name, shape, elements and offset in the chunk.
    """
    specs = [
        layout_mod.ParamSpec(name, shape, True, group) for name, shape, group in shapes
    ]
    layout = layout_mod.plan_chunks(specs, chunk_numel, world_size)
    n_layers = max(g for _, _, g in shapes) - 1
    columns = (("chunk", 0, "start"), ("parameter", 58, "start"),
               ("shape", 340, "start"), ("elements", 530, "end"),
               ("offset", 610, "end"))
    parts, y = [], y0
    for group in groups:
        parts.append(_text(x0, y + 14, f"{_group_label(group, n_layers)}, "
                           f"chunk_numel = {layout.chunk_numel:,}:", size=13,
                           weight="bold"))
        y += 20
        for title, dx, anchor in columns:
            parts.append(_text(x0 + dx, y + 13, title, size=12, anchor=anchor,
                               fill="#555"))
        y += 18
        for chunk in layout.chunks_of_group(group):
            rows = [(shapes[s.param_index][0], shapes[s.param_index][1], s.numel,
                     s.offset) for s in chunk.slots]
            if chunk.padding:
                rows.append(("padding", (), chunk.padding, chunk.used_numel))
            for name, shape, numel, offset in rows:
                colour = "url(#pad)" if name == "padding" else _kind(name)[2]
                short = name.split(".", 2)[-1] if name.startswith("layers.") else name
                parts.append(
                    f'<rect x="{_f(x0 + 40)}" y="{_f(y + 2)}" width="12" '
                    f'height="12" fill="{colour}" stroke="#222" stroke-width="0.5"/>')
                for text, (_, dx, anchor) in zip(
                        (str(chunk.index), short,
                         " × ".join(str(d) for d in shape), f"{numel:,}",
                         f"{offset:,}"), columns):
                    parts.append(_text(x0 + dx, y + 13, text, size=12,
                                       anchor=anchor))
                y += 17
        y += 10
    return parts, y - y0


def chunk_layout_svg(
    root: Path, *, chunk_sizes: tuple[int, ...] = (2**22, 2**23), world_size: int = 2
) -> str:
    layout_mod = _load_chunk_layout(root)
    shapes = pythia_160m_shapes()
    n_params = sum(_numel(s) for _, s, _ in shapes)
    body, y, width = [], 0.0, [700.0]
    body.append(
        f'<text x="0" y="18" style="{FONT};font-size:16px;font-weight:bold">'
        f"Chunk layout of a Pythia-160M-shaped GPT-NeoX ({n_params:,} parameters), "
        f"from plan_chunks</text>"
    )
    y, x0, tallest = 34.0, 0.0, 0.0
    # Panels side by side while they fit the figure's width, else below.
    for size in chunk_sizes:
        panel_width = [0.0]
        parts, h = _chunk_panel(layout_mod, shapes, size, world_size, y, panel_width)
        if x0 and x0 + panel_width[0] > WIDTH:
            y, x0, tallest = y + tallest + 18, 0.0, 0.0
            panel_width = [0.0]
            parts, h = _chunk_panel(layout_mod, shapes, size, world_size, y,
                                    panel_width)
        body.append(f'<g transform="translate({_f(x0)} 0)">')
        body += parts
        body.append("</g>")
        width[0] = max(width[0], x0 + panel_width[0])
        x0 += panel_width[0] + 40
        tallest = max(tallest, h)
    y += tallest + 18
    # Legend
    seen = []
    for name, _, _ in shapes:
        kind = _kind(name)
        if kind[0] not in [k[0] for k in seen]:
            seen.append(kind)
    x = 0.0
    for label, _, colour in seen + [("padding", "", "url(#pad)")]:
        body.append(
            f'<rect x="{_f(x)}" y="{_f(y)}" width="14" height="14" fill="{colour}" '
            f'stroke="#222" stroke-width="0.5"/><text x="{_f(x + 19)}" '
            f'y="{_f(y + 12)}" style="{FONT};font-size:13px">{_esc(label)}</text>'
        )
        x += 30 + 7.8 * len(label)
    y += 24
    for line in (
        "Rows are gather/release groups; boxes are chunks drawn to scale, except "
        "broken boxes (a parameter larger than the",
        "chunk size, alone in its chunk). Norms and biases are too thin to see at "
        "scale: the table below lists every parameter of",
        f"layer 0 and of the last group at chunk_numel = {chunk_sizes[0]:,}, in "
        "chunk order (every layer is laid out as layer 0).",
    ):
        body.append(_text(0, y + 12, line, size=13, fill="#555"))
        y += 18
    y += 10
    n_layers = max(g for _, _, g in shapes) - 1
    heights = []
    for x0, group in ((0.0, 1), (WIDTH - 640, n_layers + 1)):
        parts, h = _parameter_table(layout_mod, shapes, chunk_sizes[0], world_size,
                                    (group,), x0, y)
        body += parts
        heights.append(h)
    y += max(heights)
    w, h = max(width[0], WIDTH), y + 8
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_f(w)}" height="{_f(h)}" '
        f'viewBox="0 0 {_f(w)} {_f(h)}">\n'
        '<defs><pattern id="pad" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eee"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="2"/>'
        "</pattern></defs>\n"
        f'<rect width="100%" height="100%" fill="#fff"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


# ---------------------------------------------------------------- step timeline


def _event_colour(name: str) -> str:
    lower = name.lower()
    for key, colour in (
        ("reduce", "#e69a3d"),
        ("gather", "#3d7cc9"),
        ("release", "#9a9a9a"),
        ("backward", "#2e7d4f"),
        ("bwd", "#2e7d4f"),
        ("forward", "#5cb87a"),
        ("fwd", "#5cb87a"),
        ("optim", "#8e6cc4"),
        ("step", "#8e6cc4"),
    ):
        if key in lower:
            return colour
    return "#4aa3a3"


def validate_trace(trace: object, where: str = "trace") -> list[dict]:
    """The events of a trace, or a ValueError naming what is wrong."""
    if not isinstance(trace, dict) or not isinstance(trace.get("events"), list):
        raise ValueError(f"{where}: expected an object with an 'events' list")
    if not isinstance(trace.get("source"), str) or not trace["source"].strip():
        raise ValueError(f"{where}: 'source' must say what the trace measured")
    # The source is drawn on the page: it says what was measured, not which lab
    # run (the run's details may sit in other fields of the data file).
    if re.search(r"\brun ?\d+|\.jsonl?\b", trace["source"]):
        raise ValueError(f"{where}: 'source' names a run or a result file; say what "
                         "was measured instead")
    events = trace["events"]
    if not events:
        raise ValueError(f"{where}: 'events' is empty")
    for i, event in enumerate(events):
        if not isinstance(event, dict):
            raise ValueError(f"{where}: event {i} is not an object")
        if event.get("stream") not in STREAMS:
            raise ValueError(
                f"{where}: event {i} has stream {event.get('stream')!r}, "
                f"expected one of {', '.join(STREAMS)}"
            )
        start, end = event.get("start"), event.get("end")
        if not all(isinstance(v, (int, float)) for v in (start, end)) or end < start:
            raise ValueError(
                f"{where}: event {i} ({event.get('name')!r}) needs numbers "
                f"start <= end, got {start!r}, {end!r}"
            )
        if not isinstance(event.get("name"), str):
            raise ValueError(f"{where}: event {i} needs a string 'name'")
    return events


def _tick_step(span_ms: float) -> float:
    """The smallest of 1, 2, 5 x 10^k ms that gives at most about 10 ticks."""
    raw, power = span_ms / 10, 1e-4
    while True:
        for m in (1, 2, 5):
            if m * power >= raw:
                return m * power
        power *= 10


def timeline_svg(trace: dict, *, where: str = "trace") -> str:
    events = validate_trace(trace, where)
    t0 = min(e["start"] for e in events)
    t1 = max(e["end"] for e in events)
    span = max(t1 - t0, 1e-9)
    label_w, lane_h, top = 90, 34, 46
    plot_w = WIDTH - label_w - 10
    scale = plot_w / span
    placeholder = "placeholder" in trace["source"].lower()
    parts = [
        f'<text x="0" y="18" style="{FONT};font-size:16px;font-weight:bold">'
        f"One training step: streams over time ({span * 1e3:.3g} ms)</text>"
    ]
    if placeholder:
        parts.append(
            f'<text x="{label_w + plot_w}" y="18" text-anchor="end" '
            f'style="{FONT};font-size:14px;font-weight:bold;fill:#c0392b">'
            "PLACEHOLDER: not a measured trace</text>"
        )
    for lane, stream in enumerate(STREAMS):
        y = top + lane * lane_h
        parts.append(
            f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{lane_h - 6}" '
            f'fill="#f5f5f5"/><text x="0" y="{y + 18}" style="{FONT};font-size:14px">'
            f"{stream}</text>"
        )
    for event in sorted(events, key=lambda e: (STREAMS.index(e["stream"]), e["start"])):
        lane = STREAMS.index(event["stream"])
        x = label_w + (event["start"] - t0) * scale
        w = max((event["end"] - event["start"]) * scale, 1.0)
        y = top + lane * lane_h + 2
        ms = (event["end"] - event["start"]) * 1e3
        parts.append(
            f'<g><title>{_esc(event["name"])} ({event["stream"]}): {ms:.3g} ms'
            f'</title><rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{lane_h - 10}" '
            f'rx="2" fill="{_event_colour(event["name"])}" stroke="#fff" '
            f'stroke-width="0.5"/>'
        )
        if w > 6.2 * len(event["name"]) + 6:
            parts.append(
                f'<text x="{x + w / 2:.2f}" y="{y + 16}" text-anchor="middle" '
                f'style="{FONT};font-size:12px;fill:#fff">{_esc(event["name"])}</text>'
            )
        parts.append("</g>")
    axis_y = top + len(STREAMS) * lane_h + 4
    parts.append(
        f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" '
        'stroke="#444"/>'
    )
    step = _tick_step(span * 1e3)
    k = 0
    while k * step <= span * 1e3 + 1e-9:
        x = label_w + k * step / 1e3 * scale
        parts.append(
            f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 5}" '
            f'stroke="#444"/><text x="{x:.2f}" y="{axis_y + 18}" text-anchor="middle" '
            f'style="{FONT};font-size:12px">{k * step:.4g}</text>'
        )
        k += 1
    parts.append(
        f'<text x="{label_w + plot_w}" y="{axis_y + 34}" text-anchor="end" '
        f'style="{FONT};font-size:12px">ms since the first event</text>'
        f'<text x="0" y="{axis_y + 52}" style="{FONT};font-size:12px;fill:#555">'
        f"source: {_esc(trace['source'])}</text>"
    )
    w, h = label_w + plot_w + 10, axis_y + 62
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}">\n<rect width="100%" height="100%" fill="#fff"/>\n'
        + "\n".join(parts)
        + "\n</svg>\n"
    )


# ------------------------------------------------------------------ all figures


def figures(
    root: Path, trace: dict | None = None, *, where: str = "trace"
) -> dict[str, str]:
    """
    Every figure of the site, by path under `site/`: the builder writes each one,
    and a page shows it with `![alt](figures/NAME.svg)`. `where` names the trace
    file in its error messages.
    """
    out = {
        "figures/chunk_layout.svg": chunk_layout_svg(root),
        "figures/shard_collectives.svg": shard_collectives_svg(root),
    }
    # drawn from placement.py's own functions: a tree without it (the builder's
    # tests build small ones) has no placement figure
    if (root / "labml_zero" / "planner" / "placement.py").exists():
        out["figures/placement.svg"] = placement_svg(root)
    if trace is not None:
        out["figures/step_timeline.svg"] = timeline_svg(trace, where=where)
    return out
