r"""
---
title: Drawing the quality runs
summary: The results page's section on the precision choices' quality:
  one figure of loss curves per model and a table of final validation losses,
  read from the quality runs' result files.
---

# Drawing the quality runs

[`bench/quality.py`](../bench/quality.html) writes one JSON line per
precision choice (a state layout, or fp8 products), each with `"kind": "quality"`. For each model,
device and set of choices the latest file's lines are drawn as an SVG figure (validation loss against step,
one line per choice) and a table of final validation losses with
$\delta = (L_\text{choice} - L_\text{fp32}) / L_\text{fp32}$. With no such file
the section says so, and draws nothing.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from bench.quality import QUALITY_GOAL, choice_of

__all__ = ["load_quality", "curves_svg", "quality_markdown"]

RESULTS_DIR = "bench/results"
# One colour per choice, in the order of the file's lines (the baseline first).
COLOURS = ("#222222", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
WIDTH, HEIGHT, MARGIN = 640, 320, 48


def load_quality(root: Path) -> dict[tuple, tuple[str, list[dict]]]:
    """`{(model, device, choices): (file name, lines)}` from the latest quality
    file of each model, device and set of choices (files sort by their date
    prefix, so the last one read wins): a run of some choices on another
    device stands beside the earlier runs, not instead of them."""
    found: dict[tuple, tuple[str, list[dict]]] = {}
    folder = root / RESULTS_DIR
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.jsonl")):
        lines = [json.loads(t) for t in path.read_text(encoding="utf-8").splitlines()
                 if t.strip()]
        lines = [l for l in lines if l.get("kind") == "quality"]
        if lines:
            key = (lines[0]["model"], lines[0]["device"],
                   tuple(choice_of(l) for l in lines))
            found[key] = (path.name, lines)
    return dict(sorted(found.items()))


def curves_svg(lines: list[dict], series: str = "valid_loss") -> str:
    """
    ### One polyline per choice over shared axes

    The axes span every line's steps and losses, so the curves are comparable
    by eye; a line's legend entry is its choice's name in its colour.
    """
    points = [p for l in lines for p in l[series]]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    dx, dy = (x1 - x0) or 1, (y1 - y0) or 1

    def at(step: float, loss: float) -> str:
        x = MARGIN + (step - x0) / dx * (WIDTH - 2 * MARGIN)
        y = HEIGHT - MARGIN - (loss - y0) / dy * (HEIGHT - 2 * MARGIN)
        return f"{x:.1f},{y:.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
           f'role="img" aria-label="{escape(series)} against step">',
           f'<text x="{MARGIN}" y="{HEIGHT - 12}" font-size="12">step {x0:g} to '
           f'{x1:g}; loss {y0:.3f} to {y1:.3f}</text>']
    for i, line in enumerate(lines):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(at(s, v) for s, v in line[series])
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                   f'points="{path}"/>')
        out.append(f'<text x="{WIDTH - MARGIN - 130}" y="{MARGIN + 14 * i}" '
                   f'font-size="12" fill="{colour}">'
                   f'{escape(choice_of(line))}</text>')
    return "\n".join(out + ["</svg>"])


def quality_markdown(root: Path) -> str:
    """The results page's section on the precision choices' quality."""
    out = ["", "## Quality of the precision choices", "",
           "Each choice of optimizer states, and fp8 products with fp32 states, "
           "trains the same model on the same data "
           "and seed (`python -m bench.quality`); the figure draws the validation "
           "loss against the step, and the table gives the final validation loss "
           "and its relative difference $\\delta$ to the fp32 states with bf16 "
           "products. A choice "
           f"meets the goal when $\\lvert\\delta\\rvert \\le$ {QUALITY_GOAL:.1%}. The runs "
           "start from the preset's random weights, so the losses are those of "
           "a model trained from scratch for these steps.", ""]
    runs = load_quality(root)
    if not runs:
        return "\n".join(out + ["No quality run is recorded in `bench/results/` yet.",
                                ""])
    for (model, _, _), (name, lines) in runs.items():
        first = lines[0]
        # the choices in the heading: one model may have several runs
        out += [f"### {model}, {', '.join(choice_of(l) for l in lines)}: "
                f"{first['steps']} steps on {first['device']}", "",
                '<figure class="data">', curves_svg(lines), "</figure>", "",
                '<figure class="data">', "",
                "| choice | final validation loss | δ against fp32 | goal |",
                "| --- | --- | --- | --- |"]
        for line in lines:
            delta = line["valid_loss_rel_diff"]
            out.append(f"| {choice_of(line)} | "
                       f"{line['final_valid_loss']:.4f} | {delta:+.2%} | "
                       f"{'met' if abs(delta) <= QUALITY_GOAL else 'missed'} |")
        choices = ",".join(choice_of(l) for l in lines)
        command = " ".join(["python -m bench.quality --model", model, "--choices",
                            choices, "--steps", str(first["steps"]), "--valid-every",
                            str(first["valid_every"]), "--", *first["job_args"]])
        out += ["", "</figure>", "", f"From `{name}`, measured by `{command}`.", ""]
    return "\n".join(out)
