/* The calculator's form, table and chart on the memory model's page: reads the
   controls (named after the fields of memory_budget.BudgetInputs), calls
   computeBudget (calculator.js) and keeps the inputs in the URL fragment. */
(function () {
  "use strict";
  // ---------------------------------------------------------------------
  // The form: every control is named after a field of BudgetInputs; the URL
  // fragment holds the same names, so a result can be linked.
  const GIB = 2 ** 30;
  const FIELDS = ["preset", "n_layers", "d_model", "n_heads", "n_vocab", "world_size",
                  "shard_group_size", "param_dtype", "reduce_dtype", "states", "finetune", "lora_rank",
                  "lora_targets", "chunk_numel", "prefetch_depth", "checkpointing", "batch",
                  "seq", "micro_batches", "update_during_backward", "offload", "offload_fraction", "device_gib",
                  "gpu", "nodes", "compile"];

  const CHECKBOXES = ["checkpointing", "update_during_backward", "compile"];

  function control(form, name) { return form.elements.namedItem(name); }
  function readForm(form, data) {
    const value = name => control(form, name).value.trim();
    const integer = (name, blank) => value(name) === "" ? blank : Number(value(name));
    // a custom shape is GPT-NeoX's: the default preset's, with the form's sizes
    const preset = data.presets[value("preset")] || data.presets[data.default_preset];
    const model = { ...preset, n_layers: integer("n_layers"), d_model: integer("d_model"),
                    n_heads: integer("n_heads"), n_vocab: integer("n_vocab") };
    // the projections of the model's family
    const targets = [...form.querySelectorAll('input[name="lora_targets"]:checked')]
      .filter(box => box.dataset.family === model.family).map(box => box.value);
    const fit = form.querySelector('input[name="offload"]:checked').value === "fit";
    return {
      model, world_size: integer("world_size"), shard_group_size: integer("shard_group_size", null),
      param_dtype: value("param_dtype"), reduce_dtype: value("reduce_dtype"),
      states: value("states"),
      finetune: value("finetune"), lora_rank: integer("lora_rank"), lora_targets: targets,
      chunk_numel: integer("chunk_numel", null), prefetch_depth: integer("prefetch_depth"),
      checkpointing: control(form, "checkpointing").checked, batch: integer("batch"),
      update_during_backward: control(form, "update_during_backward").checked,
      seq: integer("seq"), micro_batches: integer("micro_batches"),
      offload_fraction: fit ? null : Number(value("offload_fraction")),
      device_bytes: Math.round(Number(value("device_gib")) * GIB),
      gpu: value("gpu"), nodes: integer("nodes"), compile: control(form, "compile").checked,
    };
  }
  function fragmentOf(form) {
    const params = new URLSearchParams();
    for (const name of FIELDS) {
      if (name === "lora_targets") {
        params.set(name, [...form.querySelectorAll('input[name="lora_targets"]:checked')]
          .map(box => box.value).join(","));
      } else if (name === "offload") {
        params.set(name, form.querySelector('input[name="offload"]:checked').value);
      } else if (CHECKBOXES.includes(name)) {
        params.set(name, control(form, name).checked ? "1" : "0");
      } else params.set(name, control(form, name).value.trim());
    }
    return "#" + params.toString();
  }
  function applyFragment(form, fragment) {
    const params = new URLSearchParams(fragment.replace(/^#/, ""));
    if (!params.has("world_size")) return false;
    if (params.has("preset")) control(form, "preset").value = params.get("preset");
    for (const [name, text] of params) {
      if (name === "preset" || !FIELDS.includes(name)) continue;
      if (name === "lora_targets") {
        const on = text.split(",");
        form.querySelectorAll('input[name="lora_targets"]')
          .forEach(box => { box.checked = on.includes(box.value); });
      } else if (name === "offload") {
        form.querySelectorAll('input[name="offload"]')
          .forEach(radio => { radio.checked = radio.value === text; });
      } else if (CHECKBOXES.includes(name)) {
        control(form, name).checked = text === "1";
      }
      else control(form, name).value = text;
    }
    return true;
  }
  function fillPreset(form, data) {
    const preset = data.presets[control(form, "preset").value];
    if (!preset) return;
    for (const name of ["n_layers", "d_model", "n_heads", "n_vocab"])
      control(form, name).value = preset[name];
  }
  function matchPreset(form, data) {
    // a shape edited by hand is a custom one
    const select = control(form, "preset"), preset = data.presets[select.value];
    if (!preset) return;
    for (const name of ["n_layers", "d_model", "n_heads", "n_vocab"]) {
      if (String(preset[name]) !== control(form, name).value.trim()) { select.value = "custom"; return; }
    }
  }

  function gib(bytes) {
    return bytes === 0 ? "0" : (bytes / GIB).toPrecision(4);
  }
  // The rows the page derives from the budget's: the model states' total.
  function withTotals(result) {
    return { ...result,
             model_states: result.params + result.grad_shards + result.optimizer_device };
  }
  // An invalid input: no numbers at all (they would be another input's), and
  // the reason beside the field.
  function clearResults(root) {
    for (const row of root.querySelectorAll("[data-key]")) {
      const cells = row.querySelectorAll("td");
      cells[1].textContent = "—";
      cells[2].textContent = "";
      row.classList.remove("calc-bad");
    }
    for (const row of root.querySelectorAll("[data-time-key]"))
      row.querySelectorAll("td")[1].textContent = "—";
    root.querySelector(".calc-plan").textContent = "—";
    const chart = root.querySelector(".calc-chart");
    chart.querySelector("svg").innerHTML = "";
    chart.querySelector("ol").innerHTML = "";
  }
  function clearFieldErrors(form) {
    form.querySelectorAll(".calc-field-error").forEach(e => e.remove());
    form.querySelectorAll("[aria-invalid]").forEach(c => c.removeAttribute("aria-invalid"));
  }
  function markField(form, name, message) {
    const c = name && control(form, name);
    const field = c && (c.length !== undefined && !c.tagName ? c[0] : c);
    if (!field) return "";
    field.setAttribute("aria-invalid", "true");
    const note = document.createElement("span");
    note.className = "calc-field-error";
    note.textContent = message;
    (field.closest("label") || field).after(note);
    const label = field.closest("label");
    return label ? label.querySelector("span").textContent : name;
  }
  // A step-time row's figure, as docsite/calculator.py's _time_text writes it.
  function timeText(value, unit) {
    if (unit === "s") return Number(value.toPrecision(4)) + " s";
    if (unit === "fraction") return (100 * value).toFixed(1) + "%";
    return Math.round(value).toLocaleString("en-US");
  }
  function showTime(root, time) {
    for (const row of root.querySelectorAll("[data-time-key]"))
      row.querySelectorAll("td")[1].textContent =
        timeText(time[row.dataset.timeKey], row.dataset.unit);
  }
  // The planner's choice, as docsite/calculator.py's _plan_text writes it.
  function showPlan(root, chosen) {
    const box = root.querySelector(".calc-plan");
    box.replaceChildren("The planner's choice for these sequences a step, on this GPU's " +
                        "memory (host memory not checked): ");
    if (chosen === null) { box.append("no setting fits."); return; }
    const code = document.createElement("code");
    code.textContent = chosen.flags;
    box.append(code, `, ${timeText(chosen.time.total, "s")} a step, ` +
      `${timeText(chosen.tokens_per_s, "tokens/s")} tokens/s, MFU ` +
      `${timeText(chosen.mfu, "fraction")}; ${chosen.fitting} of ${chosen.tried} settings fit.`);
  }
  function show(root, result, inputs) {
    result = withTotals(result);
    for (const row of root.querySelectorAll("[data-key]")) {
      const key = row.dataset.key, value = result[key];
      const cells = row.querySelectorAll("td");
      if (key === "fits") {
        cells[1].textContent = value ? "yes" : "no";
        row.classList.toggle("calc-bad", !value);
        continue;
      }
      if (row.dataset.unit === "bytes") {
        cells[1].textContent = gib(value);
        cells[2].textContent = value === null ? "" : value.toLocaleString("en-US");
      } else if (row.dataset.unit === "fraction") {
        cells[1].textContent = (100 * value).toFixed(1) + "%";
      } else {
        cells[1].textContent = "";
        cells[2].textContent = value.toLocaleString("en-US");
      }
    }
    drawChart(root.querySelector(".calc-chart"), result, inputs);
  }
  function peakParts(r, inputs) {
    const buffers = Math.max(r.grad_buffer, r.accumulation);
    const backward = r.params + r.optimizer_device + r.gathered + (r.activations || 0) + buffers
      + r.early_grads;
    if (inputs.update_during_backward || backward >= r.params + r.grad_shards + r.optimizer_device) {
      const parts = [["params", r.params], ["optimizer_device", r.optimizer_device],
                     ["gathered", r.gathered], ["activations", r.activations || 0],
                     [r.accumulation > r.grad_buffer ? "accumulation" : "grad_buffer", buffers]];
      return r.early_grads ? [...parts, ["early_grads", r.early_grads]] : parts;
    }
    return [["params", r.params], ["grad_shards", r.grad_shards],
            ["optimizer_device", r.optimizer_device]];
  }
  function drawChart(box, r, inputs) {
    const parts = peakParts(r, inputs), scale = Math.max(r.peak, inputs.device_bytes);
    const svg = box.querySelector("svg"), legend = box.querySelector("ol");
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren(); legend.replaceChildren();
    let x = 0;
    parts.forEach(([key, bytes], i) => {
      const rect = document.createElementNS(ns, "rect");
      const w = 1000 * bytes / scale;
      rect.setAttribute("x", x); rect.setAttribute("y", 4);
      rect.setAttribute("width", w); rect.setAttribute("height", 32);
      rect.setAttribute("class", "calc-part-" + i);
      const title = document.createElementNS(ns, "title");
      title.textContent = `${box.dataset["label_" + key] || key}: ${gib(bytes)} GiB`;
      rect.appendChild(title); svg.appendChild(rect);
      x += w;
      const item = document.createElement("li");
      item.className = "calc-part-" + i;
      item.textContent = `${box.dataset["label_" + key] || key}: ${gib(bytes)} GiB`;
      legend.appendChild(item);
    });
    const line = document.createElementNS(ns, "line");
    const at = 1000 * inputs.device_bytes / scale;
    line.setAttribute("x1", at); line.setAttribute("x2", at);
    line.setAttribute("y1", 0); line.setAttribute("y2", 40);
    line.setAttribute("class", "calc-device");
    svg.appendChild(line);
    svg.setAttribute("aria-label", `peak ${gib(r.peak)} GiB of ${gib(inputs.device_bytes)} GiB`);
  }

  function start() {
    const root = document.getElementById("calculator");
    const dataBlock = document.getElementById("calc-data");
    if (!root || !dataBlock) return;
    const data = window.CALC_DATA = JSON.parse(dataBlock.textContent);
    const form = root.querySelector("form"), status = root.querySelector(".calc-status");
    root.classList.add("calc-live");
    form.querySelectorAll("[disabled]").forEach(c => { c.disabled = false; });
    // The build-time check: the page's script against the Python numbers
    // written into the page for the worked example.
    const mine = window.computeBudget(data.reference.inputs, data);
    const wrong = Object.keys(data.reference.budget)
      .filter(k => mine[k] !== data.reference.budget[k]);
    const myTime = window.computeStepTime(data.reference.inputs, mine, data);
    const wrongTime = Object.keys(data.reference.step_time)
      .filter(k => Math.abs(myTime[k] - data.reference.step_time[k])
                   > 1e-12 * Math.abs(data.reference.step_time[k]));
    wrong.push(...wrongTime);
    const agreement = wrong.length
      ? `Careful: this browser's figures differ from the library's on the ` +
        `worked example (${wrong.join(", ")}); trust the command line's.`
      : "Updated as you type.";
    function update(writeFragment) {
      form.querySelector(".calc-lora").hidden = control(form, "finetune").value !== "lora";
      const preset = data.presets[control(form, "preset").value]
        || data.presets[data.default_preset];
      form.querySelectorAll(".calc-targets")
        .forEach(span => { span.hidden = span.dataset.family !== preset.family; });
      const fit = form.querySelector('input[name="offload"]:checked').value === "fit";
      control(form, "offload_fraction").disabled = fit;
      clearFieldErrors(form);
      try {
        const inputs = readForm(form, data);
        const result = window.computeBudget(inputs, data);
        const time = window.computeStepTime(inputs, result, data);
        show(root, result, inputs);
        showTime(root, time);
        showPlan(root, window.computePlan(inputs, data));
        status.textContent = (result.fits
          ? `Fits: a rank's peak is ${gib(result.peak)} GiB of the device's ` +
            `${gib(inputs.device_bytes)} GiB`
          : `Does not fit: a rank's peak is ${gib(result.peak)} GiB, more than the ` +
            `device's ${gib(inputs.device_bytes)} GiB`) +
          `; a step takes ${timeText(time.total, "s")}. ` + agreement;
        status.classList.toggle("calc-bad", wrong.length > 0);
      } catch (error) {
        clearResults(root);
        const label = markField(form, error.field, error.message);
        status.textContent = label
          ? `No results: "${label}" ${error.message}.`
          : `No results: ${error.message}.`;
        status.classList.add("calc-bad");
      }
      if (writeFragment) history.replaceState(null, "", fragmentOf(form));
    }
    if (applyFragment(form, location.hash)) matchPreset(form, data);
    form.addEventListener("change", event => {
      if (event.target.name === "preset") fillPreset(form, data);
      else if (event.target.name === "gpu") {
        // a GPU brings its memory, which the reader may still change
        const gpu = data.gpus[event.target.value];
        if (gpu) control(form, "device_gib").value = Math.round(gpu.memory_bytes / GIB * 100) / 100;
      }
      else matchPreset(form, data);
      update(true);
    });
    form.addEventListener("submit", event => { event.preventDefault(); update(true); });
    window.addEventListener("hashchange", () => {
      if (applyFragment(form, location.hash)) { matchPreset(form, data); update(false); }
    });
    update(false);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
