/* The memory model page's calculator: labml_zero/planner/memory_budget.py in the
   browser. Each function below is the Python function of the same name (its
   module in the comment); the constants come from the Python at build time (the
   JSON block "calc-data" that docsite/calculator.py writes into the page), and
   tests/docs/test_calculator.py compares computeBudget with budget(), and
   computeStepTime with planner/step_time.py's step_time, on a grid of inputs
   in headless Chromium. No network, no library. */
(function () {
  "use strict";

  // ---------------------------------------------------------------------
  // Integer helpers (bytes stay below 2^53, so Numbers are exact)
  function roundUp(value, multiple) { return Math.ceil(value / multiple) * multiple; }
  function sum(xs) { let s = 0; for (const x of xs) s += x; return s; }
  // memory_model.pinned_bytes: a pinned block rounded up to a power of two
  function pinnedBytes(n) {
    let block = 1;
    while (block < n) block *= 2;
    return n > 0 ? block : 0;
  }
  // `field`: the form control the reader must change (the page shows the message
  // beside it)
  function fail(message, field) {
    const error = new Error(message);
    error.field = field;
    throw error;
  }

  // ---------------------------------------------------------------------
  // The model's family: GPT-NeoX's shapes are sized by the port below; another
  // family's preset carries its numbers from the Python (docsite/calculator.py's
  // model_json: its units' parameters, its activation count as a line in the
  // tokens, its FLOPs), so the script restates none of its formulas.
  const NEOX = "gpt-neox";
  function familyOf(m) { return m.family || NEOX; }

  // neox/config.py, neox/model.py, neox/finetuners.py, neox/lora.py:
  // the parameters of [Embedding, TransformerLayer x L, FinalNorm, Readout]
  function checkModel(m) {
    for (const name of ["n_vocab", "d_model", "n_heads", "n_layers", "max_position"]) {
      if (!(Number.isInteger(m[name]) && m[name] >= 1))
        fail(`must be a whole number of at least 1, got ${m[name]}`, name);
    }
    if (familyOf(m) !== NEOX) return;
    if (m.d_model % m.n_heads !== 0)
      fail(`the width ${m.d_model} must divide by the heads, ${m.n_heads}`, "n_heads");
    if (rotaryDim(m) % 2 !== 0)
      fail(`the head width's rotary part, ${rotaryDim(m)}, must be even`, "n_heads");
  }
  function ffDim(m) { return m.d_ff == null ? 4 * m.d_model : m.d_ff; }
  function rotaryDim(m) { return Math.trunc((m.d_model / m.n_heads) * m.rotary_pct); }

  function isTrainable(finetune, unit, name, data) {
    if (finetune === "all") return true;
    if (finetune === "lora") return /\.lora_[AB]$/.test(name);
    if (unit !== "layer") return false;
    if (finetune === "ffn") return name.startsWith("mlp.");
    return data.biases.includes(name);  // "biases"
  }

  // Another family's [Embedding, layer x L, FinalNorm, Readout] from its units'
  // parameters (unit.py's param_specs of one layer, in the engine's order);
  // LoRA's A [r, d_in] and B [d_out, r] follow each adapted module's own.
  function familySpecs(inputs, data) {
    const m = inputs.model, r = inputs.lora_rank;
    const paths = data.families[familyOf(m)].lora_targets;
    const targets = inputs.finetune === "lora" ? inputs.lora_targets.map(t => paths[t]) : [];
    const [embed, block, norm, readout] = m.units;
    const layer = [];
    block.forEach(([name, shape], i) => {
      layer.push([name, shape]);
      const path = name.slice(0, name.lastIndexOf("."));
      const next = block[i + 1];
      const last = !next || next[0].slice(0, next[0].lastIndexOf(".")) !== path;
      if (last && targets.includes(path)) {
        const [dOut, dIn] = block.find(([n]) => n === path + ".weight")[1];
        layer.push([path + ".lora_A", [r, dIn]], [path + ".lora_B", [dOut, r]]);
      }
    });
    const units = [["embed", embed]];
    for (let i = 0; i < m.n_layers; i++) units.push(["layer", layer]);
    units.push(["norm", norm], ["readout", readout]);
    const specs = [];
    units.forEach(([unit, params], group) => {
      for (const [name, shape] of params) {
        specs.push({ name, shape, numel: shape.reduce((a, b) => a * b, 1),
                     trainable: isTrainable(inputs.finetune, unit, name, data), group });
      }
    });
    return specs;
  }

  function paramSpecs(inputs, data) {
    if (familyOf(inputs.model) !== NEOX) return familySpecs(inputs, data);
    const m = inputs.model, d = m.d_model, ff = ffDim(m), V = m.n_vocab;
    const r = inputs.lora_rank;
    const lora = inputs.finetune === "lora";
    const paths = data.families[NEOX].lora_targets;
    const targets = lora ? inputs.lora_targets.map(t => paths[t]) : [];
    const layer = [
      ["input_layernorm.weight", [d]], ["input_layernorm.bias", [d]],
      ["post_attention_layernorm.weight", [d]], ["post_attention_layernorm.bias", [d]],
    ];
    const linears = [["attention.query_key_value", d, 3 * d], ["attention.dense", d, d],
                     ["mlp.dense_h_to_4h", d, ff], ["mlp.dense_4h_to_h", ff, d]];
    for (const [path, dIn, dOut] of linears) {
      layer.push([path + ".weight", [dOut, dIn]], [path + ".bias", [dOut]]);
      if (targets.includes(path))
        layer.push([path + ".lora_A", [r, dIn]], [path + ".lora_B", [dOut, r]]);
    }
    const units = [["embed", [["embed_in.weight", [V, d]]]]];
    for (let i = 0; i < m.n_layers; i++) units.push(["layer", layer]);
    units.push(["norm", [["final_layer_norm.weight", [d]], ["final_layer_norm.bias", [d]]]]);
    units.push(["readout", [["embed_out.weight", [V, d]]]]);
    const specs = [];
    units.forEach(([unit, params], group) => {
      for (const [name, shape] of params) {
        specs.push({ name, shape, numel: shape.reduce((a, b) => a * b, 1),
                     trainable: isTrainable(inputs.finetune, unit, name, data), group });
      }
    });
    return specs;
  }

  // ---------------------------------------------------------------------
  // zero3/chunk_layout.py: plan_chunks
  function planChunks(params, chunkNumel, worldSize, align) {
    const unit = worldSize * align;
    chunkNumel = roundUp(chunkNumel, unit);
    let chunks = [];
    function close(group, trainable, slots, size) {
      if (!slots.length) return;
      chunks.push({ group, trainable, slots, chunk_numel: size });
    }
    const open = { true: [], false: [] }, fill = { true: 0, false: 0 };
    let current = null;
    params.forEach((spec, index) => {
      if (spec.group !== current) {
        for (const kind of [true, false]) {
          close(current, kind, open[kind], roundUp(fill[kind], unit));
          open[kind] = []; fill[kind] = 0;
        }
        current = spec.group;
      }
      const kind = spec.trainable;
      if (spec.numel > chunkNumel) {
        close(spec.group, kind, [{ param_index: index, offset: 0, numel: spec.numel }],
              roundUp(spec.numel, unit));
        return;
      }
      let offset = roundUp(fill[kind], align);
      if (offset + spec.numel > chunkNumel) {
        close(spec.group, kind, open[kind], chunkNumel);
        open[kind] = []; offset = 0;
      }
      open[kind].push({ param_index: index, offset, numel: spec.numel });
      fill[kind] = offset + spec.numel;
    });
    for (const kind of [true, false]) close(current, kind, open[kind], roundUp(fill[kind], unit));
    chunks.sort((a, b) => a.group - b.group || a.slots[0].param_index - b.slots[0].param_index);
    const byGroup = new Map();
    chunks.forEach((c, i) => {
      c.index = i;
      if (!byGroup.has(c.group)) byGroup.set(c.group, []);
      byGroup.get(c.group).push(c);
    });
    return { chunk_numel: chunkNumel, world_size: worldSize, chunks, byGroup, params };
  }
  function totalNumel(layout, trainable) {
    return sum(layout.chunks.filter(c => trainable == null || c.trainable === trainable)
                 .map(c => c.chunk_numel));
  }
  function usedNumel(layout) {
    return sum(layout.chunks.map(c => sum(c.slots.map(s => s.numel))));
  }

  // ---------------------------------------------------------------------
  // planner/memory_model.py
  function gatheredUnits(depth, phase, data) {
    return 1 + depth + (phase === "backward" ? data.backward_extra_units : 0);
  }
  function peakWindowNumel(sizes, depth, phase, data) {
    const width = gatheredUnits(depth, phase, data);
    let window = sum(sizes.slice(0, width)), peak = window;
    for (let i = width; i < sizes.length; i++) {
      window += sizes[i] - sizes[i - width];
      peak = Math.max(peak, window);
    }
    return peak;
  }
  function groupNumels(layout) {
    return [...layout.byGroup.values()].map(cs => sum(cs.map(c => c.chunk_numel)));
  }
  function heldGrads(layout, paramBytes) {
    let largest = 0;
    for (const c of layout.chunks) if (c.trainable) largest = Math.max(largest, c.chunk_numel);
    return largest * paramBytes;
  }
  function largestGradBuffer(layout, gradBytes, paramBytes) {
    let largest = 0;
    for (const c of layout.chunks) if (c.trainable) largest = Math.max(largest, c.chunk_numel);
    return heldGrads(layout, paramBytes) + largest * gradBytes;
  }
  function ringWireBytes(nbytes, worldSize) {
    return Math.floor(nbytes * (worldSize - 1) / worldSize);
  }

  // ---------------------------------------------------------------------
  // planner/chunk_search.py and planner/sharding.choose_chunk_numel
  function hiddenSize(specs) {
    const counts = new Map();
    for (const s of specs) if (s.shape.length >= 2) {
      const d = s.shape[s.shape.length - 1];
      counts.set(d, (counts.get(d) || 0) + 1);
    }
    let best = null;
    for (const [d, n] of counts) {
      if (best === null || n > counts.get(best) || (n === counts.get(best) && d > best)) best = d;
    }
    return best === null ? 1024 : best;
  }
  function excludedParams(specs) {
    const sizes = specs.map(s => s.numel), n = sizes.length;
    const mean = sum(sizes) / n;
    const variance = sum(sizes.map(x => (x - mean) * (x - mean))) / n;
    const limit = mean + 3 * Math.sqrt(variance);
    return new Set(specs.filter(s => s.numel > limit));
  }
  function groupShapes(specs) {
    const runs = [];
    for (const s of specs) {
      if (runs.length && runs[runs.length - 1][0].group === s.group) runs[runs.length - 1].push(s);
      else runs.push([s]);
    }
    const indexOf = new Map(), shapes = [], shapeOfGroup = [];
    for (const run of runs) {
      const key = run.map(s => `${s.numel}:${s.trainable}`).join(",");
      if (!indexOf.has(key)) { indexOf.set(key, shapes.length); shapes.push({ params: run, count: 0 }); }
      const i = indexOf.get(key);
      shapes[i].count += 1;
      shapeOfGroup.push(i);
    }
    return [shapes, shapeOfGroup];
  }
  function isSaturated(plans) {
    for (const plan of plans) for (const kind of [true, false]) {
      let regular = 0;
      for (const c of plan.chunks) {
        const oversized = c.slots.length === 1 &&
          plan.params[c.slots[0].param_index].numel > plan.chunk_numel;
        if (c.trainable === kind && !oversized) regular += 1;
      }
      if (regular > 1) return false;
    }
    return true;
  }
  function plansKey(plans) {
    return plans.map(p => p.chunks.map(c => `${c.group}/${c.trainable}/${c.chunk_numel}/` +
      c.slots.map(s => `${s.param_index}@${s.offset}`).join(".")).join("|")).join("#");
  }
  function scoreCandidate(shapes, shapeOfGroup, chunkNumel, worldSize, search) {
    const plans = shapes.map(s => planChunks(s.params, chunkNumel, worldSize, search.align));
    let padding = 0, collectives = 0, gradBuffer = 0;
    plans.forEach((plan, i) => {
      const count = shapes[i].count;
      padding += (totalNumel(plan) - usedNumel(plan)) * count;
      const trainable = plan.chunks.filter(c => c.trainable).length;
      collectives += (2 * plan.chunks.length + trainable) * count;
      gradBuffer = Math.max(gradBuffer, largestGradBuffer(plan, search.grad_bytes,
        search.param_bytes));
    });
    const sizes = shapeOfGroup.map(i => totalNumel(plans[i]));
    const peak = peakWindowNumel(sizes, search.prefetch_depth, "forward", search.data)
      * search.param_bytes;
    const score = padding * search.param_bytes + search.memory_weight * (peak + gradBuffer)
      + search.collective_bytes * collectives;
    return [{ chunk_numel: chunkNumel, score }, plans];
  }
  function searchChunkSize(specs, worldSize, search) {
    const excluded = search.filter_exlarge_params ? excludedParams(specs) : new Set();
    let largest = 0;
    for (const s of specs) if (!excluded.has(s)) largest = Math.max(largest, s.numel);
    const start = roundUp(Math.max(search.min_chunk_size, largest, 1), search.hidden_dim);
    const [shapes, shapeOfGroup] = groupShapes(specs);
    const paramSizes = [...new Set(specs.map(s => s.numel))].sort((a, b) => a - b);
    const granule = worldSize * search.align;
    let best = null, bestPlans = null, bestKey = null, last = 0, skipBelow = 0;
    for (let requested = start; requested <= start + search.search_range;
         requested += search.hidden_dim) {
      const chunkNumel = roundUp(requested, granule);
      if (chunkNumel === last || chunkNumel < skipBelow) continue;
      last = chunkNumel;
      const [row, plans] = scoreCandidate(shapes, shapeOfGroup, chunkNumel, worldSize, search);
      let better = best === null || row.score < best.score;
      if (!better && row.score === best.score) {
        if (bestKey === null) bestKey = plansKey(bestPlans);
        const key = plansKey(plans);
        better = key !== bestKey;
        if (better) bestKey = key;
      } else if (better) bestKey = null;
      if (better) { best = row; bestPlans = plans; }
      if (isSaturated(plans)) {
        const i = paramSizes.findIndex(s => s > chunkNumel);
        if (i === -1) break;
        skipBelow = paramSizes[i];
      }
    }
    return best.chunk_numel;
  }
  // The search's answer depends on the parameters, the ranks, the prefetch
  // depth and the dtypes alone; the planner asks it again for every setting.
  const searched = new Map();
  function chooseChunkNumel(specs, worldSize, inputs, data) {
    if (inputs.chunk_numel != null) return inputs.chunk_numel;
    const key = JSON.stringify([specs.map(s => [s.numel, s.trainable, s.group]), worldSize,
      inputs.prefetch_depth, inputs.param_dtype, inputs.reduce_dtype]);
    if (!searched.has(key)) searched.set(key, chooseSearchedNumel(specs, worldSize, inputs, data));
    return searched.get(key);
  }
  function chooseSearchedNumel(specs, worldSize, inputs, data) {
    const s = data.search, hidden = hiddenSize(specs);
    const largestGroup = new Map();
    for (const spec of specs) largestGroup.set(spec.group, (largestGroup.get(spec.group) || 0) + spec.numel);
    const rangeM = Math.max(Math.min(s.search_range_m, hidden * s.range_steps / s.mebi),
                            Math.max(...largestGroup.values()) / s.mebi);
    // a group as large as a big vocabulary's embedding: the step grows by whole
    // multiples of d, to stay within the cap on candidates
    const range = Math.round(rangeM * s.mebi);
    const rowsPerStep = Math.ceil((Math.floor(range / hidden) + 1) / s.max_candidates);
    const search = {
      hidden_dim: hidden * rowsPerStep, search_range: range, align: data.align,
      prefetch_depth: inputs.prefetch_depth, param_bytes: data.dtype_bytes[inputs.param_dtype],
      grad_bytes: data.dtype_bytes[inputs.reduce_dtype], memory_weight: s.memory_weight,
      collective_bytes: s.collective_bytes, min_chunk_size: s.min_chunk_size,
      filter_exlarge_params: s.filter_exlarge_params, data,
    };
    const candidates = Math.floor(search.search_range / search.hidden_dim) + 1;
    if (candidates > s.max_candidates)
      fail(`the search would try ${candidates} sizes, more than ` +
           `${s.max_candidates}: give a chunk size`, "chunk_numel");
    return searchChunkSize(specs, worldSize, search);
  }

  // ---------------------------------------------------------------------
  // neox/activation_memory.py
  const FP32 = 4;
  function trainableNames(inputs, data) {
    const layer = [], others = [];
    for (const s of paramSpecs({ ...inputs, model: { ...inputs.model, n_layers: 1 } }, data)) {
      if (!s.trainable) continue;
      (s.group === 1 ? layer : others).push(s.name);
    }
    return [new Set(layer), new Set(others)];
  }
  function layerBytes(m, trains, batch, seq, inputRequiresGrad, dtypeBytes, loraRank,
                      fusedNorms) {
    const n = batch * seq, d = m.d_model, dff = ffDim(m), nd = n * d * dtypeBytes;
    const anyTrains = prefix => [...trains].some(name => name.startsWith(prefix));
    // W's gradient, or an adapter's A's, reads the linear's input
    const inputSaved = path => trains.has(path + ".weight") || trains.has(path + ".lora_A");
    const ln1 = inputRequiresGrad || anyTrains("input_layernorm.");
    const ln2 = inputRequiresGrad || anyTrains("post_attention_layernorm.");
    const attn = ln1 || anyTrains("attention.query_key_value.");
    const mlp = ln2 || anyTrains("mlp.dense_h_to_4h.");
    let total = 0;
    if (ln1 || ln2) total += nd;
    // fused norms: one mean and 1/σ for both
    if (fusedNorms && (ln1 || ln2)) total += 2 * n * FP32;
    else total += (Number(ln1) + Number(ln2)) * 2 * n * FP32;
    if (inputSaved("attention.query_key_value")) total += nd;
    if (attn) {
      total += 2 * nd + m.n_heads * n * FP32;
      // q, k rotated (the cos, sin tables are the model's, shared by its layers)
      if (rotaryDim(m) > 0) total += 2 * nd;
      else total += 3 * nd;
    }
    if (inputSaved("attention.dense") && (rotaryDim(m) > 0 || !attn)) total += nd;
    if (inputSaved("mlp.dense_h_to_4h")) total += nd;
    if (mlp) total += n * dff * dtypeBytes;
    if (inputSaved("mlp.dense_4h_to_h")) total += n * dff * dtypeBytes;
    // u = A x [n, r] of each adapter, read by B's gradient
    const adapters = [...trains].filter(name => name.endsWith(".lora_B")).length;
    return total + adapters * n * loraRank * dtypeBytes;
  }
  // llama/activation_memory.py: what a Llama layer, its final norm, readout
  // and loss keep, for the fine-tuner's trainable names and the kernels
  function llamaNormBytes(d, p, inputGrad, weightTrains, fused) {
    if (!(inputGrad || weightTrains)) return 0;
    if (fused) return p * d + FP32;
    return (inputGrad ? FP32 * d + FP32 : 0) + (weightTrains ? p * d : 0);
  }
  function llamaSwigluBytes(dff, p, gateGrad, upGrad, fused) {
    if (fused && gateGrad) return 2 * p * dff;
    return p * dff * (2 * Number(gateGrad) + Number(upGrad));
  }
  function llamaLayerBytes(m, trains, n, inputRequiresGrad, loraRank, k) {
    const p = 2, d = m.d_model, dff = m.d_ff, dh = m.head_width;
    const trainsAny = (...paths) => [...trains].some(
      name => paths.some(path => name.startsWith(path + ".")));
    const inputSaved = (...paths) => paths.some(
      path => trains.has(path + ".weight") || trains.has(path + ".lora_A"));
    const qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"];
    const norm1Grad = inputRequiresGrad || trainsAny("input_layernorm");
    const attentionGrad = norm1Grad || trainsAny(...qkv);
    const hGrad = attentionGrad || trainsAny("self_attn.o_proj");
    const norm2Grad = hGrad || trainsAny("post_attention_layernorm");
    let perToken = llamaNormBytes(d, p, inputRequiresGrad, trainsAny("input_layernorm"),
                                  k.rms_norm);
    if (inputSaved(...qkv)) perToken += p * d;
    if (attentionGrad) perToken += p * (2 * m.n_heads + 2 * m.n_kv_heads) * dh + FP32 * m.n_heads;
    else if (inputSaved("self_attn.o_proj")) perToken += p * m.n_heads * dh;
    perToken += llamaNormBytes(d, p, hGrad, trainsAny("post_attention_layernorm"), k.rms_norm);
    if (inputSaved("mlp.gate_proj", "mlp.up_proj")) perToken += p * d;
    perToken += llamaSwigluBytes(dff, p, norm2Grad || trainsAny("mlp.gate_proj"),
                                 norm2Grad || trainsAny("mlp.up_proj"), k.swiglu);
    if (inputSaved("mlp.down_proj")) perToken += p * dff;
    const adapters = [...trains].filter(name => name.endsWith(".lora_B")).length;
    return n * (perToken + adapters * p * loraRank);
  }
  function llamaReadoutLossPeak(m, others, n, checkpointing, k) {
    const p = 2, d = m.d_model, V = m.n_vocab, nd = n * p * d;
    const norm = checkpointing ? nd
      : n * llamaNormBytes(d, p, true, others.has("norm.weight"), k.rms_norm);
    if (k.loss) {
      const chunk = Math.min(k.loss_chunk_rows, n) * V * p, gradW = V * d * FP32;
      const saved = norm + nd + gradW;
      const work = Math.max(3 * chunk + gradW, 2 * chunk + 2 * gradW);
      return Math.max(norm + nd + nd + work, saved + nd + gradW + V * d * p);
    }
    // a tied readout's weight is the embedding's, trained with it
    const readoutTrains = others.has(m.tie_embeddings ? "embed_tokens.weight"
                                                      : "lm_head.weight");
    const readoutInput = readoutTrains ? nd : 0, nV = n * V;
    return Math.max(norm + nd + (p + 2 * FP32) * nV, norm + readoutInput + 3 * FP32 * nV);
  }
  function llamaActivationBytes(inputs, data) {
    const m = inputs.model, n = inputs.batch * inputs.seq, L = m.n_layers;
    const k = inputs.kernels || data.families[familyOf(m)].plain_kernels;
    const [block, others] = trainableNames(inputs, data);
    const loss = llamaReadoutLossPeak(m, others, n, inputs.checkpointing, k);
    const full = llamaLayerBytes(m, block, n, true, inputs.lora_rank, k);
    const first = llamaLayerBytes(m, block, n, others.has("embed_tokens.weight"),
                                  inputs.lora_rank, k);
    // total: the most alive at once; beside: alive while the layers'
    // gradients are made, after the loss's peak
    if (inputs.checkpointing) {
      const kept = n * m.d_model * 2;
      const recomputed = (L > 1 ? full : first) - (k.rms_norm ? kept : 0);
      return { total: L * kept + Math.max(loss, recomputed), beside: L * kept + recomputed };
    }
    const layers = first + (L - 1) * full;
    return { total: layers + loss, beside: layers };
  }
  function activationBytes(inputs, data) {
    const m = inputs.model, batch = inputs.batch, seq = inputs.seq;
    if (seq > m.max_position)
      fail(`longer than the model's ${m.max_position} positions`, "seq");
    if (familyOf(m) !== NEOX) return llamaActivationBytes(inputs, data);
    const [block, others] = trainableNames(inputs, data);
    const n = batch * seq, nd = n * m.d_model * 2;
    const k = inputs.kernels || {};
    const full = layerBytes(m, block, batch, seq, true, 2, inputs.lora_rank, k.norms);
    let saved = inputs.checkpointing ? 2 * nd
      : nd + 2 * n * FP32 + (others.has("embed_out.weight") ? nd : 0);
    let logits = n * m.n_vocab * 2, fp32 = n * m.n_vocab * FP32;
    let lossPeak = Math.max(saved + logits + 2 * fp32, saved + logits + 3 * fp32);
    if (k.loss) {
      // chunked_loss_bytes: no logits; dL/dx bf16 and dL/dW fp32 kept
      const chunk = Math.min(k.loss_chunk_rows, n) * m.n_vocab * 2;
      const gradW = m.n_vocab * m.d_model * FP32;
      const norm = inputs.checkpointing ? nd : nd + 2 * n * FP32;
      const work = Math.max(3 * chunk + gradW, 2 * chunk + 2 * gradW);
      const kept = norm + nd + gradW;
      logits = 0;
      lossPeak = Math.max(norm + 2 * nd + work,
                          kept + nd + gradW + m.n_vocab * m.d_model * 2);
    }
    const L = m.n_layers;
    if (inputs.checkpointing) {
      const perLayer = batch * seq * m.d_model * 2;
      const recomputed = full - perLayer;
      return { total: L * perLayer + Math.max(lossPeak, logits + recomputed),
               beside: L * perLayer + recomputed + logits };
    }
    const embeddingTrains = [...others].some(name => name.startsWith("embed_in."));
    const first = layerBytes(m, block, batch, seq, embeddingTrains, 2, inputs.lora_rank,
                             k.norms);
    const layers = first + (L - 1) * full;
    return { total: layers + lossPeak, beside: layers + logits };
  }

  // ---------------------------------------------------------------------
  // planner/placement.py
  function fromOutputEnd(numels, positions, fraction) {
    const target = fraction * sum(positions.map(i => numels[i]));
    const chosen = new Set();
    let moved = 0;
    for (let k = positions.length - 1; k >= 0; k--) {
      if (moved >= target) break;
      chosen.add(positions[k]); moved += numels[positions[k]];
    }
    return chosen;
  }
  function autoPlacement(shards, capacity, other, kDevice) {
    const saving = new Map();
    shards.forEach((s, i) => { if (s.trainable) saving.set(i, kDevice * s.numel); });
    let peak = other + sum(saving.values());
    const order = [...saving.keys()].sort((a, b) => saving.get(b) - saving.get(a) || b - a);
    const chosen = new Set();
    for (const i of order) {
      if (peak <= capacity) break;
      chosen.add(i); peak -= saving.get(i);
    }
    return chosen;
  }

  // ---------------------------------------------------------------------
  // planner/memory_budget.py: budget
  function checkInputs(inputs, data) {
    for (const name of ["param_dtype", "reduce_dtype"]) {
      if (!(inputs[name] in data.dtype_bytes))
        fail(`must be one of ${Object.keys(data.dtype_bytes).join(", ")}`, name);
    }
    for (const [name, least] of [["world_size", 1], ["prefetch_depth", 0], ["batch", 1],
                                 ["seq", 1], ["micro_batches", 1], ["lora_rank", 1]]) {
      if (!(Number.isInteger(inputs[name]) && inputs[name] >= least))
        fail(`must be a whole number of at least ${least}, got ${inputs[name]}`, name);
    }
    const f = inputs.offload_fraction;
    if (f != null && !(f >= 0 && f <= 1))
      fail(`must be between 0 and 1, got ${f}`, "offload_fraction");
    if (!(inputs.states in data.state_layouts))
      fail(`must be one of ${Object.keys(data.state_layouts).join(", ")}`, "states");
    if (!data.finetuners.includes(inputs.finetune))
      fail(`must be one of ${data.finetuners.join(", ")}`, "finetune");
    const family = data.families[familyOf(inputs.model)];
    if (!family.finetuners.includes(inputs.finetune))
      fail(`must be one of ${family.finetuners.join(", ")} for ${family.title}`, "finetune");
    if (inputs.finetune === "lora" && !inputs.lora_targets.length)
      fail("tick at least one projection to adapt", "lora_rank");
    for (const t of inputs.finetune === "lora" ? inputs.lora_targets : [])
      if (!(t in family.lora_targets))
        fail(`${t} is not a projection of ${family.title}`, "lora_rank");
    if (inputs.chunk_numel != null && !(Number.isInteger(inputs.chunk_numel) && inputs.chunk_numel >= 1))
      fail(`must be a whole number of at least 1, got ${inputs.chunk_numel}`,
           "chunk_numel");
    const group = inputs.shard_group_size || inputs.world_size;
    if (!(Number.isInteger(group) && group >= 1) || inputs.world_size % group)
      fail(`${group} must divide the GPUs, ${inputs.world_size}`, "shard_group_size");
    checkModel(inputs.model);
    if (inputs.seq > inputs.model.max_position)
      fail(`longer than the model's ${inputs.model.max_position} positions`, "seq");
  }

  function computeBudget(inputs, data) {
    data = data || window.CALC_DATA;
    checkInputs(inputs, data);
    const p = data.dtype_bytes[inputs.param_dtype], gR = data.dtype_bytes[inputs.reduce_dtype];
    const nD = inputs.shard_group_size || inputs.world_size;
    const replicas = inputs.world_size / nD;
    const specs = paramSpecs(inputs, data);
    const layout = planChunks(specs, chooseChunkNumel(specs, nD, inputs, data), nD, data.align);
    const shards = layout.chunks.map(c => ({ numel: c.chunk_numel / nD, trainable: c.trainable }));
    const trainable = sum(shards.filter(s => s.trainable).map(s => s.numel));
    const all = sum(shards.map(s => s.numel));
    // K of the optimizer's state layout; K_d less the master where the shard
    // (fp32, as many bytes as the master) is its own master
    const states = data.state_layouts[inputs.states];
    const kDevice = p === states.master_bytes ? states.bytes - states.master_bytes
      : states.bytes;
    const sizes = groupNumels(layout);
    // one rank: the full buffers are the shards, nothing is gathered
    const gathered = nD === 1 ? 0 :
      Math.max(peakWindowNumel(sizes, inputs.prefetch_depth, "forward", data),
               peakWindowNumel(sizes, inputs.prefetch_depth, "backward", data)) * p;
    const alone = nD === 1 && replicas === 1 && gR === 4;
    // the held gradients: beside their buffer, or alone while cast into the shard
    const held = heldGrads(layout, p);
    const gradBuffer = alone ? held : largestGradBuffer(layout, gR, p);
    const accumulation = inputs.micro_batches > 1 ? totalNumel(layout, true) * gR : 0;
    const counted = activationBytes(inputs, data);
    const activations = counted.total, besideGrads = counted.beside;
    // the freed gradients the queued early updates hold: the parameter
    // dtype's on one rank alone, else fp32
    const largestTrainable = Math.max(0, ...shards.filter(s => s.trainable).map(s => s.numel));
    const earlyGrads = inputs.update_during_backward
      ? data.early_updates_in_flight * (alone && inputs.micro_batches === 1 ? p : data.grad_bytes)
        * largestTrainable : 0;
    const grads = data.grad_bytes * trainable;
    const withoutOptimizer = p * all + grads;
    // no gradient at the loss's peak; the gradients beside the layers' activations
    const withGrads = besideGrads + Math.max(gradBuffer, accumulation + held) + earlyGrads;
    // with a chunk offloaded, the largest's gradients queued for the link beside those
    const queued = data.link_queue_chunks * data.grad_bytes * largestTrainable;
    const phase = q => {
      const b = withoutOptimizer - grads + gathered + Math.max(activations, withGrads + q);
      return inputs.update_during_backward ? b : Math.max(withoutOptimizer, b);
    };
    const other = phase(0), offloading = phase(queued);
    const trainablePositions = [];
    shards.forEach((s, i) => { if (s.trainable) trainablePositions.push(i); });
    let onHost;
    if (inputs.offload_fraction == null && offloading <= inputs.device_bytes) {
      onHost = autoPlacement(shards, inputs.device_bytes, offloading, kDevice);
    } else {
      const fraction = inputs.offload_fraction == null ? 1 : inputs.offload_fraction;
      onHost = fromOutputEnd(shards.map(s => s.numel), trainablePositions, fraction);
    }
    const offloaded = sum([...onHost].map(i => shards[i].numel));
    const linkGrads = offloaded ? queued : 0;
    const peak = (offloaded ? offloading : other) + kDevice * (trainable - offloaded);
    const psiTrainable = sum(specs.filter(s => s.trainable).map(s => s.numel));
    const fwd = totalNumel(layout) * p, rs = totalNumel(layout, true) * gR;
    // gathered again for backward: the units from the first one that trains on
    const trains = layout.chunks.filter(c => c.trainable).map(c => c.group);
    const first = trains.length ? Math.min(...trains) : Infinity;
    const bwd = sum(layout.chunks.filter(c => c.group >= first).map(c => c.chunk_numel)) * p;
    const interNumel = replicas > 1 ? totalNumel(layout, true) / nD : 0;
    return {
      psi_trainable: psiTrainable,
      psi_frozen: sum(specs.map(s => s.numel)) - psiTrainable,
      chunk_numel: layout.chunk_numel, chunks: layout.chunks.length,
      padding: totalNumel(layout) - usedNumel(layout),
      params: p * all, grad_shards: grads,
      optimizer_device: kDevice * (trainable - offloaded),
      // K_h: K, and without a master the host's copy of the weight (p)
      // and each shard's pinned staging buffer, a power of two (pinned_bytes)
      optimizer_host: (states.bytes + (states.master_bytes === 0 ? p : 0)) * offloaded
                      + sum([...onHost].map(i => pinnedBytes(data.staging_bytes * shards[i].numel))),
      gathered, grad_buffer: gradBuffer, accumulation, early_grads: earlyGrads, activations,
      activations_beside_grads: besideGrads, link_grads: linkGrads,
      offloaded_fraction: trainable ? offloaded / trainable : 0,
      peak, fits: peak <= inputs.device_bytes,
      all_gather: nD === 1 ? 0 : fwd + bwd, reduce_scatter: alone ? 0 : rs,
      all_reduce: interNumel * gR,
      wire_inside: ringWireBytes(fwd + bwd + rs, nD),
      wire_across: 2 * ringWireBytes(interNumel * gR, replicas),
      host_down: 4 * offloaded, host_up: p * offloaded,
    };
  }
  window.computeBudget = computeBudget;

  // ---------------------------------------------------------------------
  // planner/step_time.py: the roofline of one step, on `inputs.nodes` nodes
  // of `inputs.gpu`s, for the budget `result` of the same inputs
  // the family's N (another family's from the Python), and the attention
  // products' forward FLOPs a token, 4LTd (another family's a number times T)
  function matmulParams(m) {
    if (familyOf(m) !== NEOX) return m.matmul_params;
    const d = m.d_model;
    return m.n_layers * (4 * d * d + 2 * d * ffDim(m)) + d * m.n_vocab;
  }
  function attentionFlops(m, seq) {
    return familyOf(m) !== NEOX ? m.attention_flops * seq : 4.0 * m.n_layers * seq * m.d_model;
  }
  function modelFlopsPerToken(m, seq, finetune) {
    // the MFU's count: the fine-tune's FLOPs, recomputation not counted
    return hardwareFlopsPerToken(m, seq, finetune, false);
  }
  // LoRA's adapters: bytes a token and layer (step_time.py's adapter_widths)
  function adapterBytes(inputs, k) {
    if (inputs.finetune !== "lora") return 0;
    const linears = inputs.model.layer_linears;
    let dIn = 0, dOut = 0;
    for (const t of inputs.lora_targets) { dIn += linears[t][0]; dOut += linears[t][1]; }
    const [fIn, fOut] = k.adapter_forward, [bIn, bOut] = k.adapter_backward;
    return (1 + Number(inputs.checkpointing)) * (fIn * dIn + fOut * dOut)
      + bIn * dIn + bOut * dOut;
  }
  function hardwareFlopsPerToken(m, seq, finetune, checkpointing) {
    const n = matmulParams(m), d = m.d_model, L = m.n_layers;
    // the products whose weights train: every one, or GPT-NeoX's MLP for ffn
    const weights = finetune === "all" ? n
      : finetune === "ffn" && familyOf(m) === NEOX ? L * 2 * d * ffDim(m) : 0;
    const attention = attentionFlops(m, seq);
    let flops = 4.0 * n + 2.0 * weights + 3 * attention;
    if (checkpointing) flops += 2.0 * n + attention;
    return flops;
  }
  function updateBytesPerElement(inputs, data, alone) {
    const p = data.dtype_bytes[inputs.param_dtype];
    const states = data.state_layouts[inputs.states];
    const grad = alone && inputs.micro_batches === 1 ? p : data.grad_bytes;
    const param = states.master_bytes !== 0 ? p : 2 * p;
    return grad + 2 * states.bytes + param;
  }
  function exposedCollectives(comm, compute, units, microBatches, depth) {
    if (comm === 0) return 0.0;
    const g = comm / (microBatches * units), c = compute / (microBatches * units);
    const behindCompute = units * c + units * Math.max(0.0, g - depth * c);
    const perMicroBatch = Math.max(behindCompute, units * g) + g;
    return Math.max(0.0, microBatches * perMicroBatch - compute);
  }
  // devices.py's Cluster: `nodes` nodes of equal GPUs; the GPU's rates
  function gpuOf(inputs, data) {
    const gpu = data.gpus[inputs.gpu];
    if (!gpu) fail(`is not a GPU the planner knows`, "gpu");
    const world = inputs.world_size, nodes = inputs.nodes;
    if (!(Number.isInteger(nodes) && nodes >= 1))
      fail(`must be a whole number of at least 1, got ${nodes}`, "nodes");
    if (world % nodes !== 0)
      fail(`must divide the ${world} GPUs into equal nodes`, "nodes");
    return gpu;
  }
  function computeStepTime(inputs, result, data) {
    const gpu = gpuOf(inputs, data), world = inputs.world_size, nodes = inputs.nodes;
    const k = data.step_time, m = inputs.model, a = inputs.micro_batches;
    const tokens = inputs.batch * a * inputs.seq;  // per rank and step
    const flops = hardwareFlopsPerToken(m, inputs.seq, inputs.finetune, inputs.checkpointing);
    const matmul = tokens * flops / (k.matmul_efficiency * gpu.peak_flops);
    const passes = 3 + Number(inputs.checkpointing);  // forward, backward as two, recompute
    // the layers' element-wise kernels and the readout's at the GPU's own rate,
    // every fusion on (the job's `auto`): no plain twin's bytes to add
    const kernelsRate = gpu.elementwise_bandwidth || gpu.memory_bandwidth;
    let elementwise = (tokens * m.n_layers
                       * (k.elementwise_bytes * m.d_model * passes + adapterBytes(inputs, k))
                       / kernelsRate);
    if (inputs.compile) elementwise *= k.compiled_elementwise;
    // the readout and its loss run once a micro-batch, never recomputed
    const readout = tokens * k.readout_bytes * m.n_vocab / kernelsRate;
    const idle = a * m.n_layers * passes * k.layer_pass_idle;
    // the calculator offers no fp8 products: step_time.py's casts term is 0
    const casts = 0.0;
    const compute = matmul + elementwise + readout + idle + casts;
    const trainable = Math.floor(result.grad_shards / data.grad_bytes);
    const offloaded = Math.round(trainable * result.offloaded_fraction);
    const alone = world === 1 && result.reduce_scatter === 0;
    const update = ((trainable - offloaded) * updateBytesPerElement(inputs, data, alone)
                    / (k.update_bandwidth_share * gpu.memory_bandwidth));
    // ring collectives: the all-gathers and the reduce-scatter inside the
    // shard group (over NVLink where each group lies in one node), hybrid's
    // all-reduce across the replicas, twice the share
    const bus = nodes === 1 ? gpu.peer_bus_bandwidth : gpu.node_bus_bandwidth;
    const group = inputs.shard_group_size || world;
    const replicas = world / group;
    const groupBus = (world / nodes) % group === 0 ? gpu.peer_bus_bandwidth : bus;
    let comm = (group - 1) / group * (a * result.all_gather + result.reduce_scatter) / groupBus;
    if (result.all_reduce) comm += 2 * (replicas - 1) / replicas * result.all_reduce / bus;
    const commExposed = exposedCollectives(comm, compute, m.n_layers + 2, a,
                                           inputs.prefetch_depth);
    const host = offloaded
      ? Math.max(result.host_down, result.host_up) / gpu.host_link + offloaded / (gpu.host_update_rate || k.host_update_rate)
      : 0.0;
    const backward = compute / a * (inputs.checkpointing ? 3 : 2) / passes;
    const hostExposed = Math.max(0.0, host - backward);
    const total = compute + update + commExposed + hostExposed;
    const tokensPerS = inputs.batch * a * world * inputs.seq / total;
    return {
      matmul, elementwise, readout, idle, casts, compute, update, comm, comm_exposed: commExposed, host,
      host_exposed: hostExposed, total, tokens_per_s: tokensPerS,
      mfu: modelFlopsPerToken(m, inputs.seq, inputs.finetune) * tokensPerS / (world * gpu.peak_flops),
    };
  }
  window.computeStepTime = computeStepTime;

  // ---------------------------------------------------------------------
  // planner/search.py: plan, with nothing pinned and the host not checked.
  // The job keeps the form's model, what trains, T, states and its
  // G = B A N_d sequences a step; the planner chooses B, A, recomputation,
  // offload, prefetch depth and compilation, on the GPU's own memory.
  function flagsOf(s) {
    const out = [`--batch-size ${s.batch}`, `--grad-accum ${s.micro_batches}`];
    if (s.checkpointing) out.push("--activation-checkpointing");
    if (s.offload_fraction) out.push(`--offload-optimizer ${Number(s.offload_fraction.toPrecision(4))}`);
    out.push(`--prefetch-depth ${s.prefetch_depth}`);
    if (s.compile) out.push("--compile");
    return out.join(" ");
  }
  function computePlan(inputs, data) {
    const gpu = gpuOf(inputs, data), pl = data.planner, world = inputs.world_size;
    const limit = Math.floor((1 - pl.device_margin) * (gpu.memory_bytes - pl.cuda_context_bytes));
    const job = { ...inputs, reduce_dtype: "fp32", chunk_numel: null,
                  kernels: data.families[familyOf(inputs.model)].planner_kernels,
                  device_bytes: limit };
    const perRank = inputs.batch * inputs.micro_batches;
    const batches = [];
    for (let d = perRank; d >= 1; d--) if (perRank % d === 0) batches.push(d);
    const depths = world > 1 ? [1, 2] : [1];
    let tried = 0, best = null, bestKey = null, fitting = 0;
    for (const batch of batches) for (const checkpointing of [false, true])
      for (const prefetch_depth of depths) for (const compile of [false, true]) {
        tried += 1;
        let setting = { batch, micro_batches: perRank / batch, checkpointing,
                        offload_fraction: 0.0, prefetch_depth, compile };
        // with_offload: as it is, else the fewest chunks from the output end
        let b = computeBudget({ ...job, ...setting }, data);
        if (b.peak > limit) {
          const auto = computeBudget({ ...job, ...setting, offload_fraction: null }, data);
          if (!auto.fits) continue;
          setting = { ...setting, offload_fraction: auto.offloaded_fraction };
          b = computeBudget({ ...job, ...setting }, data);
          if (b.peak > limit) continue;
        }
        fitting += 1;
        const time = computeStepTime({ ...job, ...setting }, b, data);
        // fastest; on a tie the fewest micro-batches, no recomputation, the
        // shallowest prefetch, the least offload, no compilation
        const key = [Math.round(time.total * 1e9) / 1e9, setting.micro_batches,
                     Number(checkpointing), prefetch_depth, setting.offload_fraction,
                     Number(compile)];
        let better = best === null;
        for (let i = 0; !better && i < key.length; i++) {
          if (key[i] !== bestKey[i]) { better = key[i] < bestKey[i]; break; }
        }
        if (better) { best = { setting, budget: b, time }; bestKey = key; }
      }
    if (best === null) return null;
    const tokensPerS = perRank * world * inputs.seq / best.time.total;
    return { ...best, flags: flagsOf(best.setting), tokens_per_s: tokensPerS,
             mfu: modelFlopsPerToken(inputs.model, inputs.seq, inputs.finetune) * tokensPerS
               / (world * gpu.peak_flops),
             tried, fitting };
  }
  window.computePlan = computePlan;

})();
