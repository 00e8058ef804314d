// The lens page (served by vllm_lens.frontend.http.routes_page). It calls the server's own
// HTTP API (/v1/completions with vllm_xargs, /detokenize, /v1/lens/model, /v1/lens/saes,
// /v1/steering) as any client does, asks for the "lists" transport (plain numbers, so no
// decompression library is needed) and loads nothing from anywhere else.
"use strict";

const $ = (id) => document.getElementById(id);

// What the page has read and drawn; the browser test compares it with the API's answers.
const state = {
  model: null, facts: null, saes: [], presets: [], strings: new Map(),
  run: null, lens: null, attention: null, sae: null, feature: null, steer: null,
};
window.lensState = state;

// ---- the API ---------------------------------------------------------------------------

async function api(path, body) {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value;
  if (key) headers.Authorization = "Bearer " + key;
  const init = body === undefined ? { headers } : { method: "POST", headers, body: JSON.stringify(body) };
  const response = await fetch(path, init);
  let data = null;
  try { data = await response.json(); } catch (_) { /* not JSON */ }
  if (response.ok && data === null) throw new Error(`${path}: HTTP ${response.status}: the answer is not JSON`);
  if (!response.ok) {
    const err = data && data.error;
    const message = err ? (err.message || JSON.stringify(err)) : (data && data.detail) || response.statusText;
    throw new Error(`${path}: HTTP ${response.status}: ${typeof message === "string" ? message : JSON.stringify(message)}`);
  }
  return data;
}

// vllm_xargs carries strings, numbers and flat lists: objects and nested lists travel as
// JSON strings, as vllm_lens.client.encode_xargs sends them.
function encodeXargs(xargs) {
  const out = {};
  for (const [key, value] of Object.entries(xargs)) {
    const flat = Array.isArray(value) && value.every((v) => v === null || typeof v !== "object");
    if (value === true) out[key] = "true";
    else if (value !== null && typeof value === "object" && !flat) out[key] = JSON.stringify(value);
    else out[key] = value;
  }
  return out;
}

async function complete(prompt, maxTokens, xargs) {
  const body = { model: state.model, prompt, max_tokens: maxTokens, temperature: 0, return_token_ids: true };
  if (xargs) body.vllm_xargs = encodeXargs(xargs);
  const answer = await api("/v1/completions", body);
  return answer.choices[0];
}

// A tensor of the "lists" transport: {dtype, shape, values} with non-finite floats as strings.
const NON_FINITE = { nan: NaN, inf: Infinity, "-inf": -Infinity };
function tensor(record) {
  return { shape: record.shape, values: record.values.map((v) => (typeof v === "string" ? NON_FINITE[v] : v)) };
}
function get(t, ...index) {
  let offset = 0;
  for (let i = 0; i < t.shape.length; i++) offset = offset * t.shape[i] + (index[i] || 0);
  return t.values[offset];
}

async function loadStrings(ids) {
  const missing = [...new Set(ids)].filter((id) => id >= 0 && !state.strings.has(id));
  for (let i = 0; i < missing.length; i += 8) {
    await Promise.all(missing.slice(i, i + 8).map(async (id) => {
      const answer = await api("/detokenize", { model: state.model, tokens: [id] });
      state.strings.set(id, answer.prompt);
    }));
  }
}
const shown = (id) => (state.strings.has(id) ? state.strings.get(id).replace(/\n/g, "⏎") : `#${id}`);

// ---- the page ------------------------------------------------------------------------------

function showError(error) {
  $("error").hidden = false;
  $("error").textContent = String(error && error.message ? error.message : error);
  $("status").textContent = "";
}
function clearError() { $("error").hidden = true; $("error").textContent = ""; }

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = value; o.textContent = text;
  select.appendChild(o);
}

function parseLayers(text, n) {
  text = text.trim();
  if (text === "" || text === "all") return [...Array(n).keys()];
  const layers = new Set();
  for (const part of text.split(",")) {
    const m = part.trim().match(/^(\d+)(?:\s*-\s*(\d+))?$/);
    if (!m) throw new Error(`Layers: cannot read ${JSON.stringify(part.trim())}; write all, 0-29 or 0,5,10`);
    const lo = +m[1], hi = m[2] === undefined ? lo : +m[2];
    for (let l = lo; l <= hi; l++) layers.add(l);
  }
  return [...layers].sort((a, b) => a - b);
}

function cell(tag, text) {
  const c = document.createElement(tag);
  c.textContent = text;
  return c;
}

function shade(value, hue) {  // 0..1 -> a background from white to a saturated hue
  const v = Math.max(0, Math.min(1, value));
  return `hsl(${hue}, 80%, ${Math.round(100 - 55 * v)}%)`;
}

async function start() {
  try {
    const models = await api("/v1/models");
    state.model = models.data[0].id;
    state.facts = await api("/v1/lens/model");
    $("model").textContent = `${state.model} · ${state.facts.model_class} · ${state.facts.n_layers} layers`;
    if (state.facts.unsupported) throw new Error(`This engine refuses lens requests: ${state.facts.unsupported}`);
    for (let l = 0; l < state.facts.n_layers; l++) option($("attn-layer"), l, l);
    for (let h = 0; h < state.facts.n_heads; h++) option($("attn-head"), h, h);
    state.saes = (await api("/v1/lens/saes")).data;
    for (const s of state.saes) option($("sae-name"), s.name, `${s.name} (${s.hook_name || s.point})`);
    if (!state.saes.length) option($("sae-name"), "", "none served (VLLM_LENS_SAES)");
    state.presets = (await api("/v1/steering")).data;
    for (const p of state.presets) option($("steer-preset"), p.name, p.name);
  } catch (error) {
    showError(error);
  }
}

async function run() {
  clearError();
  $("status").textContent = "running…";
  $("run").disabled = true;  // one run at a time
  try {
    const prompt = $("prompt").value;
    const maxTokens = +$("max-tokens").value;
    const layers = parseLayers($("layers").value, state.facts.n_layers);
    const xargs = {
      activations_transport: "lists",
      apply_hooks: [{ name: "logit_lens_topk", layer_indices: layers, args: { k: 3 }, pre: false }],
    };
    const sae = $("sae-name").value;
    if (sae) xargs.output_sae_features = [{ sae, top_k: 32, positions: "all" }];
    const choice = await complete(prompt, maxTokens, xargs);
    const ids = [...choice.prompt_token_ids, ...choice.token_ids];
    state.run = { prompt, maxTokens, layers, ids, text: choice.text, choice };
    drawLogitLens(choice.hook_results["0"], layers);
    if (sae) drawSae(choice.sae_features[0], sae);
    await loadStrings([...ids, ...state.lens.cells.map((c) => c.top[0].id), ...state.lens.cells.flatMap((c) => c.top.map((t) => t.id))]);
    renderLogitLens();
    renderSaeTokens();
    await runAttention();
    $("status").textContent = `${choice.prompt_token_ids.length} prompt tokens, ${choice.token_ids.length} generated: ${JSON.stringify(choice.text)}`;
  } catch (error) {
    showError(error);
  } finally {
    $("run").disabled = false;
  }
}

// ---- logit lens ------------------------------------------------------------------------

function drawLogitLens(saved, layers) {
  const cells = [];
  for (const layer of layers) {
    const ids = tensor(saved.token_ids[layer]), logprobs = tensor(saved.logprobs[layer]);
    const positions = tensor(saved.positions[layer]).values;
    positions.forEach((position, row) => {
      const top = [];
      for (let j = 0; j < ids.shape[1]; j++) top.push({ id: get(ids, row, j), prob: Math.exp(get(logprobs, row, j)) });
      cells.push({ layer, position, top });
    });
  }
  state.lens = { layers, cells, positions: [...new Set(cells.map((c) => c.position))].sort((a, b) => a - b) };
}

function renderLogitLens() {
  const table = $("logit-lens");
  table.replaceChildren();
  const head = document.createElement("tr");
  head.appendChild(cell("th", "layer"));
  for (const p of state.lens.positions) head.appendChild(cell("th", shown(state.run.ids[p])));
  table.appendChild(head);
  const byKey = new Map(state.lens.cells.map((c) => [`${c.layer}:${c.position}`, c]));
  for (const layer of [...state.lens.layers].reverse()) {  // the last layer on top
    const tr = document.createElement("tr");
    tr.appendChild(cell("th", layer));
    for (const p of state.lens.positions) {
      const c = byKey.get(`${layer}:${p}`);
      const td = cell("td", c ? shown(c.top[0].id) : "");
      if (c) {
        td.dataset.layer = layer; td.dataset.position = p;
        td.dataset.tokenId = c.top[0].id; td.dataset.prob = c.top[0].prob;
        td.style.background = shade(c.top[0].prob, 210);
        td.title = c.top.map((t) => `${JSON.stringify(shown(t.id))} ${t.prob.toFixed(3)}`).join("\n");
      }
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
}

// ---- attention -------------------------------------------------------------------------

// Most positions the attention grid draws (a table of n × n cells).
const MAX_ATTENTION_POSITIONS = 256;
let attentionCalls = 0;  // layer or head changed again meanwhile: only the latest is drawn

async function runAttention() {
  if (!state.run) return;
  const call = ++attentionCalls;
  const layer = +$("attn-layer").value, head = +$("attn-head").value;
  // The run's own tokens as the prompt (all but the last, which the model never read), so
  // the pattern is of exactly the positions the other views show.
  const ids = state.run.ids.slice(0, -1);
  if (ids.length > MAX_ATTENTION_POSITIONS) {
    throw new Error(`Attention: ${ids.length} positions; the page draws at most ${MAX_ATTENTION_POSITIONS} (use vllm_lens.plot for more)`);
  }
  const choice = await complete(ids, 1, {
    activations_transport: "lists", output_qk: { layers: [layer], heads: [head] } });
  if (call !== attentionCalls) return;
  const acts = choice.activations;
  const q = tensor(acts.attn_q), k = tensor(acts.attn_k);
  const weights = attentionWeights(q, k, acts.qk_meta[0]);
  state.attention = { layer, head, ids, weights, positions: tensor(acts.attn_q_positions).values };
  renderAttention();
}

// As vllm_lens.attention.compute_attention_weights for one head: scale, soft cap, ALiBi,
// causal and sliding-window masks, sinks.
function attentionWeights(q, k, meta) {
  const n = q.shape[1], d = q.shape[3];
  const [left, right] = meta.sliding_window;
  const slope = meta.alibi_slopes ? meta.alibi_slopes[0] : null;
  const sink = meta.sinks ? meta.sinks[0] : null;
  const weights = [];
  for (let i = 0; i < n; i++) {
    const scores = [];
    for (let j = 0; j < n; j++) {
      const masked = j > i || (left >= 0 && j < i - left) || (right >= 0 && j > i + right);
      if (masked) { scores.push(-Infinity); continue; }
      let s = 0;
      for (let c = 0; c < d; c++) s += get(q, 0, i, 0, c) * get(k, 0, j, 0, c);
      s *= meta.scale;
      if (meta.logits_soft_cap) s = meta.logits_soft_cap * Math.tanh(s / meta.logits_soft_cap);
      if (slope !== null) s += slope * (j - i);
      scores.push(s);
    }
    const top = Math.max(...scores, sink === null ? -Infinity : sink);
    const e = scores.map((s) => Math.exp(s - top));
    const total = e.reduce((a, b) => a + b, 0) + (sink === null ? 0 : Math.exp(sink - top));
    weights.push(e.map((x) => x / total));
  }
  return weights;
}

function renderAttention() {
  const table = $("attention");
  table.replaceChildren();
  const { weights, positions } = state.attention;
  const head = document.createElement("tr");
  head.appendChild(cell("th", ""));
  for (const p of positions) head.appendChild(cell("th", shown(state.run.ids[p])));
  table.appendChild(head);
  weights.forEach((row, i) => {
    const tr = document.createElement("tr");
    tr.appendChild(cell("th", shown(state.run.ids[positions[i]])));
    row.forEach((w, j) => {
      const td = cell("td", "");
      td.dataset.query = positions[i]; td.dataset.key = positions[j]; td.dataset.weight = w;
      td.style.background = shade(Math.sqrt(w), 20);
      td.title = `${JSON.stringify(shown(state.run.ids[positions[i]]))} → ${JSON.stringify(shown(state.run.ids[positions[j]]))}: ${w.toFixed(4)}`;
      tr.appendChild(td);
    });
    table.appendChild(tr);
  });
}

// ---- SAE features ----------------------------------------------------------------------

function drawSae(entry, name) {
  const indices = tensor(entry.indices), values = tensor(entry.values);
  const positions = tensor(entry.positions).values;
  const rows = positions.map((position, r) => {
    const top = [];
    for (let j = 0; j < indices.shape[1]; j++) {
      const feature = get(indices, r, j);
      if (feature >= 0) top.push({ feature, value: get(values, r, j) });
    }
    return { position, top };
  });
  state.sae = { name, rows, labels: entry.labels || {}, selected: null };
  const last = rows[rows.length - 1];
  if (last && last.top.length) state.feature = last.top[0].feature;
  $("sae-feature").value = state.feature === null ? "" : state.feature;
}

function featureValue(row, feature) {
  const found = row.top.find((t) => t.feature === feature);
  return found ? found.value : null;
}

function renderSaeTokens() {
  const box = $("sae-tokens");
  box.replaceChildren();
  if (!state.sae) return;
  const values = state.sae.rows.map((row) => featureValue(row, state.feature));
  const most = Math.max(1e-9, ...values.filter((v) => v !== null));
  state.sae.rows.forEach((row, r) => {
    const span = cell("span", shown(state.run.ids[row.position]));
    span.dataset.position = row.position;
    span.dataset.value = values[r] === null ? "" : values[r];
    if (values[r] !== null) span.style.background = shade(values[r] / most, 130);
    if (state.sae.selected === row.position) span.classList.add("selected");
    span.addEventListener("click", () => selectToken(row.position));
    box.appendChild(span);
  });
}

function selectToken(position) {
  state.sae.selected = position;
  const row = state.sae.rows.find((r) => r.position === position);
  const list = $("sae-top");
  list.replaceChildren();
  for (const t of row.top) {
    const label = state.sae.labels[t.feature];
    const li = cell("li", `#${t.feature}  ${t.value.toFixed(3)}${label ? "  " + label : ""}`);
    li.dataset.feature = t.feature; li.dataset.value = t.value;
    li.addEventListener("click", () => chooseFeature(t.feature));
    list.appendChild(li);
  }
  renderSaeTokens();
}

function chooseFeature(feature) {
  state.feature = feature;
  $("sae-feature").value = feature;
  $("steer-feature").value = feature;
  renderSaeTokens();
}

// ---- steering --------------------------------------------------------------------------

let steerCalls = 0;  // a slider moved several steps: only the latest call's answers are shown

async function steer() {
  clearError();
  const call = ++steerCalls;
  try {
    const prompt = $("prompt").value;
    const kind = $("steer-kind").value;
    const scale = +$("steer-scale").value;
    let item;
    if (kind === "preset") {
      if (!$("steer-preset").value) throw new Error("Steering: this server has no presets (VLLM_LENS_STEERING_PRESETS)");
      item = "preset:" + $("steer-preset").value;
    } else {
      if (!$("sae-name").value) throw new Error("Steering: choose an SAE");
      item = { sae: $("sae-name").value, feature: +$("steer-feature").value, scale };
    }
    $("steer-steered").textContent = "…";
    const maxTokens = Math.max(16, +$("max-tokens").value);
    const plain = await complete(prompt, maxTokens, null);
    const steered = await complete(prompt, maxTokens, { apply_steering_vectors: [item] });
    if (call !== steerCalls) return;
    state.steer = { item, scale: kind === "preset" ? null : scale, maxTokens, plain: plain.text, steered: steered.text };
    $("steer-plain").textContent = plain.text;
    $("steer-steered").textContent = steered.text;
  } catch (error) {
    if (call === steerCalls) showError(error);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("run").addEventListener("click", run);
  $("attn-layer").addEventListener("change", () => runAttention().catch(showError));
  $("attn-head").addEventListener("change", () => runAttention().catch(showError));
  $("sae-feature").addEventListener("change", () => chooseFeature(+$("sae-feature").value));
  $("steer-scale").addEventListener("input", () => { $("steer-scale-value").textContent = $("steer-scale").value; });
  $("steer-scale").addEventListener("change", steer);
  $("steer-run").addEventListener("click", steer);
  start();
});
