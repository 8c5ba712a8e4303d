"""The memory model page's calculator in headless Chromium against the Python
model (`labml_zero/neox/memory_budget.py`): its `computeBudget` on a grid of
inputs in one page load, exactly; then the real page through its URL fragment
and its form controls, the rounded figures within 0.1%."""

from __future__ import annotations

import html
import json
import re
from docsite.calculator import budget_json, inputs_json, total
from labml_zero.neox import config as neox_config
from labml_zero.neox.memory_budget import BudgetInputs, budget
from tests.docs.calculator_grid import grid_inputs, searched_inputs
from tests.docs.test_browser import chromium

PAGE = "labml_zero/planner/memory_model.html"
COUNTS = {"psi_trainable", "psi_frozen", "chunk_numel", "chunks", "padding"}


def run_harness(tmp_path, body: str, script: str) -> object:
    """One Chromium load of `body` + `script`; the script writes JSON into #out."""
    harness = tmp_path / "harness.html"
    harness.write_text(f'<!DOCTYPE html><html><body>{body}<pre id="out"></pre>'
                       f"<script>{script}</script></body></html>", encoding="utf-8")
    proc = chromium(harness.as_uri(), tmp_path / "profile", "--dump-dom",
                    "--allow-file-access-from-files", "--virtual-time-budget=60000",
                    timeout=300)
    match = re.search(r'<pre id="out">(.*?)</pre>', proc.stdout, re.S)
    assert match and match.group(1), proc.stderr[-2000:]
    return json.loads(html.unescape(match.group(1)))


def page_data(site) -> str:
    """The JSON the built page carries: what its script computes with."""
    text = (site / PAGE).read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="calc-data">(.*?)</script>',
                      text, re.S)
    assert match, "the memory model page has no calculator"
    return match.group(1)


def assert_same(expected: dict, got: dict, where: str) -> None:
    assert set(got) == set(expected), where
    for key, value in expected.items():
        if isinstance(value, float):
            assert abs(got[key] - value) <= 1e-12, f"{where}: {key}"
        else:
            assert got[key] == value, f"{where}: {key} {got[key]} != {value}"


def test_the_script_computes_the_python_budget_on_the_grid(built_site, tmp_path):
    cases = grid_inputs() + searched_inputs()
    assert len(cases) >= 200
    # the grid's spread: every preset, N from 1 to 1,024, every dtype pair,
    # fine-tuner, offload mode, with and without checkpointing and accumulation
    assert len({c.model for c in cases}) == 10
    assert {1, 1024} <= {c.world_size for c in cases}
    assert {(c.param_dtype, c.reduce_dtype) for c in cases} >= {
        ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp32")}
    assert {c.finetune for c in cases} == {"all", "biases", "ffn", "lora"}
    assert {c.offload_fraction for c in cases} >= {0.0, 1.0, None}
    assert {c.checkpointing for c in cases} == {True, False}
    assert {c.micro_batches > 1 for c in cases} == {True, False}
    assert {c.update_during_backward for c in cases} == {True, False}
    expected = [budget_json(budget(c)) for c in cases]
    # LoRA's activations are counted (its rows of the activation model), so they
    # are compared like every other part
    lora = [e for c, e in zip(cases, expected) if c.finetune == "lora"]
    assert len(lora) >= 50 and all(e["activations"] > 0 for e in lora)
    assert len({(c.lora_rank, c.lora_targets) for c in cases
                if c.finetune == "lora"}) >= 6
    static = (built_site / "static" / "calculator.js").resolve().as_uri()
    body = (f'<script type="application/json" id="calc-data">{page_data(built_site)}'
            f'</script><script src="{static}"></script>')
    script = f"""
    const data = JSON.parse(document.getElementById("calc-data").textContent);
    const cases = {json.dumps([inputs_json(c) for c in cases])};
    const out = cases.map(c => {{
      try {{ return computeBudget(c, data); }}
      catch (e) {{ return {{error: e.message}}; }}
    }});
    document.getElementById("out").textContent = JSON.stringify(out);
    """
    got = run_harness(tmp_path, body, script)
    assert len(got) == len(cases)
    for case, want, have in zip(cases, expected, got):
        assert_same(want, have, repr(case))


def shown(row: dict) -> dict:
    """The table's text of one row as numbers: GiB and bytes."""
    return {k: v.replace(",", "") for k, v in row.items()}


def check_table(table: dict, expected: dict, where: str) -> None:
    for key, (gib_text, bytes_text) in table.items():
        value = total(expected, key)  # the budget's, or the page's total
        if key == "fits":
            assert gib_text == ("yes" if value else "no"), where
        elif bytes_text:
            # exact: bytes, and counts (elements, chunks) with no GiB
            assert int(bytes_text.replace(",", "")) == value, f"{where}: {key}"
            if gib_text not in ("", "0"):
                assert abs(float(gib_text) * 2**30 - value) <= 1e-3 * value, where
            assert gib_text != "" or key in COUNTS, f"{where}: {key}"
        elif gib_text.endswith("%"):
            assert abs(float(gib_text[:-1]) / 100 - value) <= 1e-3, f"{where}: {key}"
        else:
            assert gib_text == "0" and value == 0, f"{where}: {key}"


# Read a frame's table, its status line, its fragment and its controls' labels.
READ = r"""
function read(frame) {
  const doc = frame.contentDocument, table = {};
  for (const row of doc.querySelectorAll("#calculator tr[data-key]")) {
    const cells = row.querySelectorAll("td");
    table[row.dataset.key] = [cells[1].textContent, cells[2].textContent];
  }
  const controls = [...doc.querySelectorAll(
    "#calculator form input, #calculator form select")];
  return {table, hash: frame.contentWindow.location.hash,
          status: doc.querySelector(".calc-status").textContent,
          unlabelled: controls.filter(c => !c.labels.length).map(c => c.name),
          untabbable: controls.filter(c => c.tabIndex !== 0 || c.disabled)
            .map(c => c.name)};
}
"""


def test_the_page_through_its_fragment_and_its_form(built_site, tmp_path):
    page = (built_site / PAGE).resolve().as_uri()
    linked = BudgetInputs(model=neox_config.pythia_410m(), world_size=16,
                          shard_group_size=8, finetune="lora", lora_rank=16,
                          lora_targets=("dense", "dense_h_to_4h"),
                          chunk_numel=3_000_000,
                          micro_batches=4, offload_fraction=0.5, seq=1024,
                          device_bytes=round(139.8 * 2**30))
    fragment = ("#preset=pythia_410m&n_layers=24&d_model=1024&n_heads=16&n_vocab=50304"
                "&world_size=16&shard_group_size=8&param_dtype=bf16&reduce_dtype=fp32"
                "&finetune=lora&lora_rank=16&lora_targets=dense,dense_h_to_4h"
                "&chunk_numel=3000000&prefetch_depth=1&checkpointing=0&batch=1"
                "&seq=1024&micro_batches=4&update_during_backward=0"
                "&offload=fraction&offload_fraction=0.5&device_gib=139.8")
    # the form: GPT-NeoX-20B on 8 GPUs, biases only, checkpointed, fit an 80 GiB one
    driven = BudgetInputs(model=neox_config.gpt_neox_20b(), world_size=8,
                          finetune="biases", checkpointing=True, batch=4,
                          chunk_numel=None, offload_fraction=None,
                          device_bytes=round(80.0 * 2**30))
    linked_src = html.escape(page + fragment)
    body = (f'<iframe id="linked" width="1400" height="900" src="{linked_src}">'
            f'</iframe><iframe id="driven" width="420" height="900" src="{page}">'
            "</iframe>")
    script = READ + r"""
    window.addEventListener("load", () => {
      const frame = document.getElementById("driven"), doc = frame.contentDocument;
      const form = doc.querySelector("#calculator form");
      function set(name, value) {
        const c = form.elements.namedItem(name);
        if (c.type === "checkbox") c.checked = value; else c.value = value;
        c.dispatchEvent(new Event("change", {bubbles: true}));
      }
      set("preset", "gpt_neox_20b"); set("world_size", "8"); set("finetune", "biases");
      set("checkpointing", true); set("batch", "4");
      form.querySelector('input[name="offload"][value="fit"]').checked = true;
      set("device_gib", "80");
      document.getElementById("out").textContent = JSON.stringify({
        linked: read(document.getElementById("linked")), driven: read(frame)});
    });
    """
    got = run_harness(tmp_path, body, script)
    for name, inputs in (("linked", linked), ("driven", driven)):
        frame = got[name]
        assert "the same bytes on the worked example" in frame["status"], (
            frame["status"])
        assert not frame["unlabelled"], frame["unlabelled"]
        # keyboard: every control is in the tab order, in the page's order (no
        # tabindex), but the fraction while the device is to be fitted
        assert set(frame["untabbable"]) <= {"offload_fraction"}, frame["untabbable"]
        check_table(frame["table"], budget_json(budget(inputs)), name)
    assert got["linked"]["hash"] == fragment
    # the form wrote its inputs into the fragment, so the result can be linked
    assert "preset=gpt_neox_20b" in got["driven"]["hash"]
    assert "offload=fit" in got["driven"]["hash"]
    assert got["driven"]["hash"].count("finetune=biases") == 1


def test_the_worked_example_is_in_the_page_without_scripts(built_site):
    """The block as built (before any script runs) shows the example's outputs."""
    text = (built_site / PAGE).read_text(encoding="utf-8")
    block = text[text.index('<div class="calc" id="calculator">'):]
    result = budget_json(budget(BudgetInputs()))
    for key in ("params", "peak", "all_gather"):
        row = re.search(rf'<tr data-key="{key}".*?</tr>', block, re.S).group(0)
        assert f"{result[key]:,}" in row


def test_an_invalid_input_clears_the_results_and_names_its_field(built_site,
                                                                 tmp_path):
    """Heads that do not divide the width: no number is left from the last
    valid input, the reason sits beside the field, the status names it."""
    page = (built_site / PAGE).resolve().as_uri()
    body = f'<iframe id="f" width="1400" height="900" src="{page}"></iframe>'
    script = READ + r"""
    window.addEventListener("load", () => {
      const frame = document.getElementById("f"), doc = frame.contentDocument;
      const form = doc.querySelector("#calculator form");
      const c = form.elements.namedItem("n_heads");
      c.value = "7";
      c.dispatchEvent(new Event("change", {bubbles: true}));
      const errors = [...doc.querySelectorAll(".calc-field-error")].map(e => [
        e.textContent, e.previousElementSibling.querySelector("input").name]);
      document.getElementById("out").textContent = JSON.stringify({
        got: read(frame), errors});
    });
    """
    got = run_harness(tmp_path, body, script)
    assert got["got"]["status"].startswith('No results: "heads'), got["got"]["status"]
    assert [name for _, name in got["errors"]] == ["n_heads"]
    assert "must divide by the heads" in got["errors"][0][0]
    assert all(cells == ["—", ""] for cells in got["got"]["table"].values())


def test_the_table_totals_the_model_states_and_names_presets_as_the_cli(
        built_site):
    # the calculator sizes GPT-NeoX: its presets are the CLI's of that family
    from labml_zero.neox.family import NEOX

    text = (built_site / PAGE).read_text(encoding="utf-8")
    example = budget_json(budget(BudgetInputs()))
    row = re.search(r'<tr class="calc-total" data-key="model_states".*?</tr>', text)
    total = example["params"] + example["grad_shards"] + example["optimizer_device"]
    assert row and f"{total:,}" in row.group(0)
    shown = re.findall(r'<option value="[^"]*"[^>]*>([^<]*)</option>', text)
    assert set(NEOX.presets) <= set(shown)
    assert "per rank</th>" not in text
