"""
Figures of the engine's mechanism, drawn from the code of the tree being built
(loaded by `docs_src/diagrams.py`):

* `shard_collectives_svg`: one chunk on 2, 3 and 4 ranks, from `plan_chunks`;
* `placement_svg`: where each chunk's states live under two placements of
  GPT-NeoX-20B's shape, from `placement.py`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _load_common():
    name = "_labml_zero_diagrams_common"
    path = Path(__file__).resolve().parent / "diagrams_common.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_c = _load_common()
FONT, WIDTH, _esc, _f, _numel = _c.FONT, _c.WIDTH, _c._esc, _c._f, _c._numel
_text, _svg, _load_module = _c._text, _c._svg, _c._load_module
_load_chunk_layout, pythia_160m_shapes = _c._load_chunk_layout, _c.pythia_160m_shapes
neox_group_shapes, model_layer_shapes = _c.neox_group_shapes, _c.model_layer_shapes


RANK_COLOURS = ("#3d7cc9", "#e69a3d", "#2e9c6a", "#c45c8e")
SHORT = (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2"),
         ("attention.query_key_value", "qkv"), ("attention.dense", "attn_out"),
         ("mlp.dense_h_to_4h", "mlp_up"), ("mlp.dense_4h_to_h", "mlp_down"))


def _short(name: str) -> str:
    """`layers.0.attention.dense.bias` -> `attn_out.b`: a label that fits."""
    for long, short in SHORT:
        if long in name:
            return short + (".b" if name.endswith(".bias") else ".w")
    return name


def _slice_text(shapes, lo: int, hi: int, chunk) -> str:
    """What elements [lo, hi) of a chunk hold, as visible text: each parameter
    with the elements of it the slice holds (whole or part)."""
    held = []
    for s in chunk.slots:
        a, b = max(s.offset, lo), min(s.end, hi)
        if a < b:
            part = "" if (a, b) == (s.offset, s.end) else f" ({b - a} of {s.numel})"
            held.append(_short(shapes[s.param_index][0]) + part)
    if chunk.padding and chunk.used_numel < hi:
        held.append(f"padding ({hi - max(lo, chunk.used_numel)})")
    return f"[{lo}, {hi}): " + ", ".join(held)


def _names_in(layout, shapes, lo: int, hi: int, chunk) -> str:
    """Names of the parameters of `chunk` that elements [lo, hi) hold parts of."""
    names = [
        shapes[s.param_index][0] for s in chunk.slots if s.offset < hi and s.end > lo
    ]
    if chunk.padding and chunk.used_numel < hi:
        names.append("padding")
    return ", ".join(names)


def shard_collectives_svg(
    root: Path, *, world_sizes: tuple[int, ...] = (2, 3, 4), d_model: int = 4
) -> str:
    """
    One GPT-NeoX layer of width `d_model`, its parameters as the model registers
    them (`model_layer_shapes`), packed into one chunk by `plan_chunks`,
    for each world size: what each rank keeps (its shard), the all-gather that
    fills every rank's full buffer, and the reduce-scatter that sums the ranks'
    full gradients and leaves each rank its own slice.
    """
    layout_mod = _load_chunk_layout(root)
    shapes = model_layer_shapes(d_model)
    numel = sum(_numel(s) for _, s, _ in shapes)
    specs = [layout_mod.ParamSpec(n, s, True, 0) for n, s, _ in shapes]
    label_w, gap, bar_h = 70, 120, 20
    # the widest panel is the first world size: its shard + full + shard
    widest = max(
        layout_mod.plan_chunks(specs, numel, n).chunks[0].chunk_numel * (1 + 2 / n)
        for n in world_sizes
    )
    scale = (WIDTH - label_w - 2 * gap - 10) / widest
    body = [
        _text(0, 20, f"Shards, all-gather and reduce-scatter of one chunk "
              f"({numel} elements: one GPT-NeoX layer of width {d_model}, "
              "from plan_chunks)", size=16, weight="bold"),
    ]
    y = 44.0
    for n in world_sizes:
        layout = layout_mod.plan_chunks(specs, numel, n)
        (chunk,) = layout.chunks
        size, shard = chunk.chunk_numel, layout.shard_numel(chunk)
        x_shard, x_full = label_w, label_w + shard * scale + gap
        x_red = x_full + size * scale + gap
        body.append(_text(0, y + 16, f"N_d = {n}: chunk of {size} elements "
                          f"({chunk.padding} padding), shards of S = {shard}",
                          size=14, weight="bold"))
        y += 28
        for x, title in ((x_shard, "1. shard, kept"),
                         (x_full, "2. full buffer, after the all-gather"),
                         (x_red, "3. gradient shard, after the reduce-scatter")):
            body.append(_text(x, y + 10, title, size=12, fill="#444"))
        y += 18
        for rank in range(n):
            lo, hi = rank * shard, (rank + 1) * shard
            colour = RANK_COLOURS[rank % len(RANK_COLOURS)]
            body.append(_text(0, y + 15, f"rank {rank}", size=13))
            body.append(
                f'<g><title>rank {rank} keeps elements [{lo}, {hi}) of the chunk: '
                f"{_esc(_names_in(layout, shapes, lo, hi, chunk))}</title>"
                f'<rect x="{_f(x_shard)}" y="{_f(y)}" width="{_f(shard * scale)}" '
                f'height="{bar_h}" fill="{colour}"/></g>'
            )
            for owner in range(n):
                olo, ohi = owner * shard, (owner + 1) * shard
                fill = RANK_COLOURS[owner % len(RANK_COLOURS)]
                how = "its own shard" if owner == rank else f"from rank {owner}"
                body.append(
                    f'<g><title>rank {rank}, elements [{olo}, {ohi}): {how}'
                    f"</title><rect x=\"{_f(x_full + olo * scale)}\" y=\"{_f(y)}\" "
                    f'width="{_f(shard * scale)}" height="{bar_h}" fill="{fill}" '
                    f'opacity="{1.0 if owner == rank else 0.55}"/></g>'
                )
            for slot in chunk.slots:
                px = x_full + slot.offset * scale
                body.append(
                    f'<line x1="{_f(px)}" y1="{_f(y)}" x2="{_f(px)}" '
                    f'y2="{_f(y + bar_h)}" stroke="#fff" stroke-width="1"/>'
                )
            if chunk.padding:
                px = x_full + chunk.used_numel * scale
                body.append(
                    f'<g><title>padding: {chunk.padding} elements</title>'
                    f'<rect x="{_f(px)}" y="{_f(y)}" '
                    f'width="{_f(chunk.padding * scale)}" height="{bar_h}" '
                    f'fill="url(#pad)"/></g>'
                )
            body.append(
                f'<g><title>rank {rank}: the sum over all {n} ranks of elements '
                f"[{lo}, {hi}) of their full gradients, divided by {n}</title>"
                f'<rect x="{_f(x_red)}" y="{_f(y)}" width="{_f(shard * scale)}" '
                f'height="{bar_h}" fill="{colour}" stroke="#222" '
                f'stroke-dasharray="4 2"/></g>'
            )
            y += bar_h + 6
        # arrows between the columns
        mid = y - n * (bar_h + 6) / 2
        # what each rank's slice holds, readable without hovering
        for rank in range(n):
            lo, hi = rank * shard, (rank + 1) * shard
            body.append(_text(label_w, y + 14, f"rank {rank} keeps "
                              + _slice_text(shapes, lo, hi, chunk), size=12,
                              fill="#333"))
            y += 17
        for x0, x1, label in ((x_shard + shard * scale, x_full, "all-gather"),
                              (x_full + size * scale, x_red, "reduce-scatter")):
            body.append(
                f'<line x1="{_f(x0 + 6)}" y1="{_f(mid)}" x2="{_f(x1 - 8)}" '
                f'y2="{_f(mid)}" stroke="#444" stroke-width="2" '
                f'marker-end="url(#arrow)"/>'
            )
            body.append(_text((x0 + x1) / 2, mid - 6, label, size=12,
                              anchor="middle", fill="#444"))
        y += 18
    body.append(_text(0, y + 4, "White lines are parameter boundaries: a shard cuts "
                      "across parameters, so a rank's shard is not whole tensors "
                      "(the lines under each panel: what each slice holds).",
                      size=12, fill="#555"))
    defs = (
        '<pattern id="pad" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eee"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="2"/>'
        '</pattern><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" '
        'markerWidth="7" markerHeight="7" orient="auto"><path d="M0 0 L10 5 '
        'L0 10 z" fill="#444"/></marker>'
    )
    return _svg(WIDTH, y + 16, body, defs)


# ------------------------------------------------------------------ placement

DEVICE, HOST = "#3d7cc9", "#e69a3d"

def _chunk_name(group: int, n_layers: int) -> str:
    if group == 0:
        return "embed"
    if group == n_layers + 1:
        return "norm"
    if group == n_layers + 2:
        return "readout"
    return f"L{group - 1}"


def _runs(indices: list[int], names: list[str]) -> str:
    """Chunk indices as runs of names: `L26–readout (21 chunks)`, or `none`."""
    if not indices:
        return "none"
    runs, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            runs.append(names[start] if start == a else f"{names[start]}–{names[a]}")
            start = b
    return f"{', '.join(runs)} ({len(indices)} of {len(names)} chunks)"


def placement_svg(
    root: Path,
    *,
    n_layers: int = 44,
    d_model: int = 6144,
    vocab: int = 50432,
    world_size: int = 2,
    optimizer_fraction: float = 0.4,
    param_fraction: float = 0.5,
) -> str:
    """
    Where each chunk's states live for GPT-NeoX-20B's shape (one chunk per layer,
    the engine's default layout, align 64) on `world_size` ranks, under two static
    placements computed by `placement.py` itself: part of the optimizer state on
    the host, and all of it with part of the parameter shards. Per placement, the
    bytes per rank on device and host (`resident_bytes`) and over the host link
    (`offload_traffic`).
    """
    layout_mod = _load_chunk_layout(root)
    placement = _load_module(root, "labml_zero/planner/placement.py",
                             "_labml_zero_placement_for_docs")
    shapes = neox_group_shapes(n_layers=n_layers, d_model=d_model, vocab=vocab)
    specs = [layout_mod.ParamSpec(n, s, True, g) for n, s, g in shapes]
    largest = max(sum(_numel(s) for _, s, g in shapes if g == group)
                  for group in {g for _, _, g in shapes})
    layout = layout_mod.plan_chunks(specs, largest, world_size, align=64)
    shards = [placement.ShardSpec(layout.shard_numel(c), c.trainable)
              for c in layout.chunks]
    cases = [
        (f"optimizer_cpu_fraction = {optimizer_fraction}",
         placement.StaticPlacement(optimizer_cpu_fraction=optimizer_fraction)),
        (f"optimizer_cpu_fraction = 1, param_cpu_fraction = {param_fraction}",
         placement.StaticPlacement(optimizer_cpu_fraction=1.0,
                                   param_cpu_fraction=param_fraction)),
    ]
    label_w, cell_h = 150, 22
    cell_w = (WIDTH - label_w - 10) / len(layout.chunks)
    rows = (("16-bit shard", "param"), ("fp32 gradient", "grad"),
            ("master, m, v", "optim"))
    n_params = sum(_numel(s) for _, s, _ in shapes)
    body = [_text(0, 20, f"Where each chunk lives: GPT-NeoX-20B's shape "
                  f"({n_params / 1e9:.2f}B parameters, {len(layout.chunks)} chunks "
                  f"in execution order), per rank of N_d = {world_size}, "
                  "from placement.py", size=16, weight="bold")]
    y = 40.0
    for title, policy in cases:
        chosen = policy.place(shards)
        split = placement.resident_bytes(chosen, shards)
        traffic = placement.offload_traffic(chosen, shards)
        body.append(_text(0, y + 16, f"StaticPlacement({title})", size=14,
                          weight="bold"))
        body.append(_text(WIDTH - 10, y + 16,
                          f"device {split.device / 1e9:.0f} GB, host "
                          f"{split.host / 1e9:.0f} GB per rank; per step "
                          f"{traffic.down / 1e9:.1f} GB down, "
                          f"{traffic.up / 1e9:.1f} GB up", size=13, anchor="end"))
        y += 26
        for label, kind in rows:
            body.append(_text(0, y + 16, label, size=13))
            for i, chunk in enumerate(layout.chunks):
                name = _chunk_name(chunk.group, n_layers)
                if kind == "param":
                    host = i in chosen.param_on_host
                elif kind == "grad":
                    host = False
                else:
                    host = i in chosen.optimizer_on_host
                where = "host" if host else "device"
                body.append(
                    f'<g><title>{_esc(name)} (chunk {i}, shard of '
                    f"{shards[i].numel:,} elements): {label} on the {where}"
                    f'</title><rect x="{_f(label_w + i * cell_w)}" y="{_f(y)}" '
                    f'width="{_f(cell_w - 1)}" height="{cell_h}" '
                    f'fill="{HOST if host else DEVICE}"/></g>'
                )
            y += cell_h + 3
        names = [_chunk_name(c.group, n_layers) for c in layout.chunks]
        for label, on_host in (("optimizer state", chosen.optimizer_on_host),
                               ("parameter shards", chosen.param_on_host)):
            body.append(_text(WIDTH - 10, y + 30, f"{label} on the host: "
                              f"{_runs(sorted(on_host), names)}", size=12,
                              anchor="end", fill="#333")
                        if label == "parameter shards" else
                        _text(0, y + 30, f"{label} on the host: "
                              f"{_runs(sorted(on_host), names)}", size=12,
                              fill="#333"))
        for i, chunk in enumerate(layout.chunks):
            name = _chunk_name(chunk.group, n_layers)
            last = i == len(layout.chunks) - 1
            if i == 0 or last or (chunk.group > 1 and (chunk.group - 1) % 4 == 0
                                  and chunk.group <= n_layers - 2):
                x = label_w + (i + 1) * cell_w if last else label_w + (i + 0.5) * cell_w
                body.append(_text(x, y + 14, name, size=12, fill="#444",
                                  anchor="end" if last else "middle"))
        y += 50
    x = 0.0
    for label, colour in (("on the device", DEVICE), ("in host memory", HOST)):
        body.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="14" height="14" '
                    f'fill="{colour}"/>')
        body.append(_text(x + 20, y + 12, label, size=13))
        x += 170
    y += 24
    body.append(_text(0, y + 12, "Chunks go to the host from the output end: their "
                      "gradients are final first in backward, and their parameters "
                      "are needed last in the next forward.",
                      size=12, fill="#555"))
    return _svg(WIDTH, y + 22, body)
