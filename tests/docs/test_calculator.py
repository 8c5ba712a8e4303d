"""The memory model page's calculator in headless Chromium against the Python
model (`labml_zero/planner/memory_budget.py`): its `computeBudget` on a grid of
inputs in one page load, exactly; then the real page through its URL fragment
and its form controls, the rounded figures within 0.1%."""

from __future__ import annotations

import html
import json
import re
from docsite.calculator import (budget_json, inputs_json, plan_json, step_time_json,
                                total)
from labml_zero.neox import config as neox_config
from labml_zero.planner.memory_budget import budget
from docsite.calculator import LLAMA_PRESETS, PRESETS
from tests.docs.calculator_grid import (GPU_NAMES, cluster_of, grid_inputs,
                                        llama_inputs, searched_inputs)
from tests.docs.calculator_grid import neox_inputs as BudgetInputs
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
    """Integers exactly; floats to a few units in the last place of a double
    (the port runs the Python's operations in its order, so only a
    different rounding of one operation could move them)."""
    assert set(got) == set(expected), where
    for key, value in expected.items():
        if isinstance(value, float):
            assert abs(got[key] - value) <= 4 * 2**-52 * max(abs(value), 1e-300), (
                f"{where}: {key} {got[key]} != {value}")
        else:
            assert got[key] == value, f"{where}: {key} {got[key]} != {value}"


def test_the_script_computes_the_python_budget_on_the_grid(built_site, tmp_path):
    cases = grid_inputs() + searched_inputs() + llama_inputs()
    assert len(cases) >= 200
    # the grid's spread: every preset of both families, N from 1 to 1,024,
    # every dtype pair, fine-tuner, offload mode, with and without
    # checkpointing and accumulation
    assert len({c.model for c in cases}) == len(PRESETS) + len(LLAMA_PRESETS)
    llama = [c for c in cases if c.family.name == "llama"]
    assert {c.finetune for c in llama} == {"all", "lora"}
    assert {c.kernels.loss for c in llama} == {True, False}
    assert {c.chunk_numel is None for c in llama} == {True, False}
    assert {1, 1024} <= {c.world_size for c in cases}
    assert {(c.param_dtype, c.reduce_dtype) for c in cases} >= {
        ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp32")}
    assert {c.finetune for c in cases} == {"all", "biases", "ffn", "lora"}
    assert {c.offload_fraction for c in cases} >= {0.0, 1.0, None}
    assert {c.checkpointing for c in cases} == {True, False}
    assert {c.micro_batches > 1 for c in cases} == {True, False}
    assert {c.update_during_backward for c in cases} == {True, False}
    expected = [budget_json(budget(c)) for c in cases]
    clusters = [cluster_of(i, c) for i, c in enumerate(cases)]
    times = [step_time_json(c, **k) for c, k in zip(cases, clusters)]
    # the step time's spread: every GPU, one node and several, compiled or
    # not, with exposed collectives and an exposed host link among them
    assert {k["gpu"] for k in clusters} == set(GPU_NAMES)
    assert {k["nodes"] > 1 for k in clusters} == {True, False}
    assert {k["compile"] for k in clusters} == {True, False}
    assert sum(t["comm_exposed"] > 0 for t in times) >= 20
    assert sum(t["host_exposed"] > 0 for t in times) >= 5
    # the planner's search on a slice of the grid (each plan is tens of
    # budgets): choices with and without offload, recomputation, accumulation
    planned = [(c, {"gpu": k["gpu"], "nodes": k["nodes"]})
               for c, k in zip(cases[::16], clusters[::16])]
    expected_plans = [plan_json(c, **k) for c, k in planned]
    chosen = [p["setting"] for p in expected_plans if p is not None]
    assert len(chosen) >= 8
    assert {s["offload_fraction"] > 0 for s in chosen} == {True, False}
    assert {s["micro_batches"] > 1 for s in chosen} == {True, False}
    assert {s["checkpointing"] for s in chosen} == {True, False}
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
    const cases = {json.dumps([{**inputs_json(c), **k}
                               for c, k in zip(cases, clusters)])};
    const out = cases.map(c => {{
      try {{
        const budget = computeBudget(c, data);
        return [budget, computeStepTime(c, budget, data)];
      }} catch (e) {{ return [{{error: e.message}}, null]; }}
    }});
    const planned = {json.dumps([{**inputs_json(c), **k} for c, k in planned])};
    document.getElementById("out").textContent = JSON.stringify(
      {{out, plans: planned.map(c => computePlan(c, data))}});
    """
    got = run_harness(tmp_path, body, script)
    plans, got = got["plans"], got["out"]
    for (case, cluster), want, have in zip(planned, expected_plans, plans):
        where = f"plan of {case!r} on {cluster}"
        assert (want is None) == (have is None), where
        if want is not None:
            assert have["flags"] == want["flags"], where
            assert_same(want["setting"], have["setting"], where)
            assert_same(want["budget"], have["budget"], where)
            # the script's step time also carries tokens/s and MFU
            assert_same(want["time"], {k: have["time"][k] for k in want["time"]},
                        where)
            assert_same({k: want[k] for k in ("tokens_per_s", "mfu", "tried", "fitting")},
                        {k: have[k] for k in ("tokens_per_s", "mfu", "tried", "fitting")},
                        where)
    assert len(got) == len(cases)
    for case, want, time, (have, have_time) in zip(cases, expected, times, got):
        assert_same(want, have, repr(case))
        assert_same(time, have_time, f"step time of {case!r}")


def shown(row: dict) -> dict:
    """The table's text of one row as numbers: GiB and bytes."""
    return {k: v.replace(",", "") for k, v in row.items()}


def check_time(shown_time: dict, expected: dict, where: str) -> None:
    """The step-time rows as shown: seconds to 4 digits, tokens/s to the
    token, MFU to 0.1%."""
    assert set(shown_time) == {"total", "compute", "update", "comm_exposed",
                               "host_exposed", "tokens_per_s", "mfu"}, where
    for key, text in shown_time.items():
        value = expected[key]
        if text.endswith(" s"):
            assert abs(float(text[:-2]) - value) <= 5e-4 * value, f"{where}: {key}"
        elif text.endswith("%"):
            assert abs(float(text[:-1]) / 100 - value) <= 1e-3, f"{where}: {key}"
        else:
            assert abs(int(text.replace(",", "")) - value) <= 0.5, f"{where}: {key}"


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
  const time = {};
  for (const row of doc.querySelectorAll("#calculator tr[data-time-key]"))
    time[row.dataset.timeKey] = row.querySelectorAll("td")[1].textContent;
  const controls = [...doc.querySelectorAll(
    "#calculator form input, #calculator form select")];
  return {table, time, plan: doc.querySelector(".calc-plan").textContent, hash: frame.contentWindow.location.hash,
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
      set("gpu", "h100");
      const gpuMemory = form.elements.namedItem("device_gib").value;
      set("device_gib", "80"); set("nodes", "2"); set("compile", true);
      document.getElementById("out").textContent = JSON.stringify({
        linked: read(document.getElementById("linked")), driven: read(frame),
        gpuMemory});
    });
    """
    got = run_harness(tmp_path, body, script)
    clusters = {"linked": {}, "driven": {"gpu": "h100", "nodes": 2, "compile": True}}
    for name, inputs in (("linked", linked), ("driven", driven)):
        frame = got[name]
        # the status line is for the reader: whether it fits, and the step's time
        result = budget(inputs)
        assert frame["status"].startswith("Fits" if result.fits else "Does not fit"), (
            frame["status"])
        assert "a step takes" in frame["status"] and frame["status"].endswith(
            "Updated as you type."), frame["status"]
        assert "Python" not in frame["status"]
        check_time(frame["time"], step_time_json(inputs, **clusters[name]), name)
        # the planner's choice for the same job, from the same search
        cluster = {k: v for k, v in clusters[name].items() if k != "compile"}
        chosen = plan_json(inputs, **cluster)
        assert (chosen["flags"] if chosen else "no setting fits") in frame["plan"], (
            frame["plan"])
        assert not frame["unlabelled"], frame["unlabelled"]
        # keyboard: every control is in the tab order, in the page's order (no
        # tabindex), but the fraction while the device is to be fitted
        assert set(frame["untabbable"]) <= {"offload_fraction"}, frame["untabbable"]
        check_table(frame["table"], budget_json(budget(inputs)), name)
    assert got["linked"]["hash"] == fragment
    # the form wrote its inputs into the fragment, so the result can be linked
    assert "preset=gpt_neox_20b" in got["driven"]["hash"]
    assert "offload=fit" in got["driven"]["hash"]
    assert "gpu=h100&nodes=2&compile=1" in got["driven"]["hash"]
    # choosing a GPU brings its memory into the device's field
    from labml_zero.planner.devices import GPUS
    assert abs(float(got["gpuMemory"]) * 2**30 - GPUS["h100"].memory_bytes) <= 0.01 * 2**30
    assert got["driven"]["hash"].count("finetune=biases") == 1


def test_a_llama_preset_through_the_fragment(built_site, tmp_path):
    """A Llama-family preset, linked: its own projections are the ones shown
    and read, and the table is the Python budget of the same job."""
    from labml_zero.llama import config as llama_config
    from labml_zero.llama.family import LLAMA
    from labml_zero.planner.memory_budget import BudgetInputs as Inputs

    page = (built_site / PAGE).resolve().as_uri()
    linked = Inputs(llama_config.qwen2_5_0_5b(), family=LLAMA, world_size=4,
                    finetune="lora", lora_rank=16, lora_targets=("q_proj", "v_proj"),
                    chunk_numel=3_000_000, micro_batches=2, seq=1024,
                    checkpointing=True, device_bytes=round(80 * 2**30))
    model = linked.model
    fragment = (f"#preset=qwen2_5_0_5b&n_layers={model.n_layers}&d_model="
                f"{model.d_model}&n_heads={model.n_heads}&n_vocab={model.n_vocab}"
                "&world_size=4&shard_group_size=&param_dtype=bf16&reduce_dtype=fp32"
                "&finetune=lora&lora_rank=16&lora_targets=q_proj,v_proj"
                "&chunk_numel=3000000&prefetch_depth=1&checkpointing=1&batch=1"
                "&seq=1024&micro_batches=2&update_during_backward=0"
                "&offload=fraction&offload_fraction=0&device_gib=80")
    body = (f'<iframe id="linked" width="1400" height="900" '
            f'src="{html.escape(page + fragment)}"></iframe>')
    script = READ + r"""
    window.addEventListener("load", () => {
      const frame = document.getElementById("linked"), doc = frame.contentDocument;
      const shown = [...doc.querySelectorAll(".calc-targets")]
        .filter(s => !s.hidden).map(s => s.dataset.family);
      document.getElementById("out").textContent = JSON.stringify({
        linked: read(frame), shown});
    });
    """
    got = run_harness(tmp_path, body, script)
    assert got["shown"] == ["llama"]
    frame = got["linked"]
    assert frame["status"].endswith("Updated as you type."), frame["status"]
    check_table(frame["table"], budget_json(budget(linked)), "qwen2.5-0.5b")
    check_time(frame["time"], step_time_json(linked), "qwen2.5-0.5b")


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
      const errorsOf = () => [...doc.querySelectorAll(".calc-field-error")].map(e => [
        e.textContent, e.previousElementSibling.querySelector("input").name]);
      const errors = errorsOf(), heads = read(frame);
      c.value = "16";
      c.dispatchEvent(new Event("change", {bubbles: true}));
      const nodes = form.elements.namedItem("nodes");
      nodes.value = "3";
      nodes.dispatchEvent(new Event("change", {bubbles: true}));
      document.getElementById("out").textContent = JSON.stringify({
        got: heads, errors, nodes: read(frame), nodeErrors: errorsOf()});
    });
    """
    got = run_harness(tmp_path, body, script)
    assert got["got"]["status"].startswith('No results: "heads'), got["got"]["status"]
    assert [name for _, name in got["errors"]] == ["n_heads"]
    assert "must divide by the heads" in got["errors"][0][0]
    assert all(cells == ["—", ""] for cells in got["got"]["table"].values())
    assert set(got["got"]["time"].values()) == {"—"}
    assert got["got"]["plan"] == "—"
    # nodes that do not divide the GPUs: the step time has no cluster
    assert got["nodes"]["status"].startswith('No results: "nodes'), got["nodes"]["status"]
    assert [name for _, name in got["nodeErrors"]] == ["nodes"]
    assert "must divide the 8 GPUs" in got["nodeErrors"][0][0]
    assert set(got["nodes"]["time"].values()) == {"—"}


def test_the_table_totals_the_model_states_and_names_presets_as_the_cli(
        built_site):
    # the calculator's presets are the CLI's of each family
    from labml_zero.neox.family import NEOX

    text = (built_site / PAGE).read_text(encoding="utf-8")
    example = budget_json(budget(BudgetInputs()))
    row = re.search(r'<tr class="calc-total" data-key="model_states".*?</tr>', text)
    total = example["params"] + example["grad_shards"] + example["optimizer_device"]
    assert row and f"{total:,}" in row.group(0)
    shown = re.findall(r'<option value="[^"]*"[^>]*>([^<]*)</option>', text)
    assert set(NEOX.presets) <= set(shown)
    # and the Llama family's, Llama-3.2-1B, Llama-3.1-8B and Qwen2.5-7B among them
    from labml_zero.llama.family import LLAMA
    assert set(LLAMA.presets) <= set(shown)
    assert {"llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b"} <= set(shown)
    assert "per rank</th>" not in text
    # every column says what it holds
    heads = re.findall(r'<th scope="col">([^<]*)', text)
    assert "symbol" in heads and "GiB" in heads and "value" in heads
    # the symbols of the rows and labels that the page's text does not define
    # are defined in the legend beside the table
    legend = re.search(r'<p class="calc-legend">(.*?)</p>', text, re.S).group(1)
    for words in ("the bytes of an element in the parameters", "the optimizer state",
                  "dense bf16 peak from its data sheet", "the model FLOPs of a token",
                  "the sequences of a step"):
        assert words in legend, words


def test_the_page_shows_the_step_time_without_scripts(built_site):
    """The time table as built: `step_time` of the worked example on one H200."""
    from docsite.calculator import _time_text

    text = (built_site / PAGE).read_text(encoding="utf-8")
    time = step_time_json(BudgetInputs(), gpu="h200")
    for key in ("total", "tokens_per_s", "mfu"):
        row = re.search(rf'<tr data-time-key="{key}" data-unit="([^"]*)".*?</tr>',
                        text, re.S)
        assert row and _time_text(time[key], row.group(1)) in row.group(0), key
    assert 0 < time["mfu"] < 1
    chosen = plan_json(BudgetInputs())
    assert f'<code>{chosen["flags"]}</code>' in text
