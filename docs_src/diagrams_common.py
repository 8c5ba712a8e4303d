"""
Shared parts of the site's figures (`docs_src/diagrams.py` and
`docs_src/diagrams_engine.py` load this file by its path): SVG text and frames,
number formats, the GPT-NeoX parameter shapes the figures draw, and loading a
module of the tree being built from its file.
"""

from __future__ import annotations

import html
import importlib.util
import sys
from pathlib import Path

FONT = "font-family:DejaVu Sans,Helvetica,Arial,sans-serif"
WIDTH = 1300  # viewBox width of the figures: drawn full width, fonts >= 12 px


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _f(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _text(x, y, text, *, size=13, anchor="start", weight="normal", fill="#222"):
    return (
        f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}" '
        f'style="{FONT};font-size:{size}px;font-weight:{weight};fill:{fill}">'
        f"{_esc(text)}</text>"
    )


def _svg(width: float, height: float, body: list[str], defs: str = "") -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_f(width)}" '
        f'height="{_f(height)}" viewBox="0 0 {_f(width)} {_f(height)}">\n'
        + (f"<defs>{defs}</defs>\n" if defs else "")
        + '<rect width="100%" height="100%" fill="#fff"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def _load_module(root: Path, rel: str, name: str):
    """A module of `root` loaded from its file, so a figure shows that tree's code."""
    spec = importlib.util.spec_from_file_location(name, root / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses need the module registered
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def _load_chunk_layout(root: Path):
    return _load_module(root, "labml_zero/zero3/chunk_layout.py",
                        "_labml_zero_chunk_layout_for_docs")


def pythia_160m_shapes(
    *, n_layers: int = 12, d_model: int = 768, vocab: int = 50432
) -> list[tuple[str, tuple[int, ...], int]]:
    """
    (name, shape, group) of a GPT-NeoX model shaped like Pythia-160M, in execution
    order: group 0 is the embedding, groups 1..L the layers, L+1 the final norm and
    the untied readout (no bias). Inside a layer, the attention input norm, fused
    QKV, attention output, MLP input norm and the MLP, as the forward uses them.
    """
    d = d_model
    shapes = [("embed_in.weight", (vocab, d), 0)]
    for layer in range(n_layers):
        g = layer + 1
        p = f"layers.{layer}."
        shapes += [
            # the order `TransformerLayer` registers them in (both norms
            # first), which is the chunks' order; a test holds it to the model
            (p + "input_layernorm.weight", (d,), g),
            (p + "input_layernorm.bias", (d,), g),
            (p + "post_attention_layernorm.weight", (d,), g),
            (p + "post_attention_layernorm.bias", (d,), g),
            (p + "attention.query_key_value.weight", (3 * d, d), g),
            (p + "attention.query_key_value.bias", (3 * d,), g),
            (p + "attention.dense.weight", (d, d), g),
            (p + "attention.dense.bias", (d,), g),
            (p + "mlp.dense_h_to_4h.weight", (4 * d, d), g),
            (p + "mlp.dense_h_to_4h.bias", (4 * d,), g),
            (p + "mlp.dense_4h_to_h.weight", (d, 4 * d), g),
            (p + "mlp.dense_4h_to_h.bias", (d,), g),
        ]
    g = n_layers + 1
    shapes += [
        ("final_layer_norm.weight", (d,), g),
        ("final_layer_norm.bias", (d,), g),
        ("embed_out.weight", (vocab, d), g),
    ]
    return shapes


def model_layer_shapes(d_model: int) -> list[tuple[str, tuple[int, ...], int]]:
    """
    (name, shape, 1) of one GPT-NeoX layer of width `d_model`, built by the
    model's own `build_layers` on the meta device: the names and the order in
    which the layer registers its parameters, which is the order the engine
    packs them into chunks.
    """
    from labml_zero.neox import config as neox_config
    from labml_zero.neox import model as neox_model

    config = neox_config.NeoXConfig(n_vocab=1, d_model=d_model, n_heads=1,
                                    n_layers=1, d_ff=4 * d_model, rotary_pct=0.5)
    layer = neox_model.build_layers(config, device="meta")[1]
    return [(name, tuple(p.shape), 1) for name, p in layer.named_parameters()]


def neox_group_shapes(*, n_layers: int, d_model: int, vocab: int):
    """GPT-NeoX parameter shapes with the final norm and the readout in groups of
    their own, as `build_layers` makes them (one unit each)."""
    shapes = pythia_160m_shapes(n_layers=n_layers, d_model=d_model, vocab=vocab)
    head = n_layers + 1
    return [(n, s, g + 1 if g == head and "embed_out" in n else g)
            for n, s, g in shapes]
