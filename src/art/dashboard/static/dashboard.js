/* art dashboard: polls this server's JSON API every 2 s and redraws what changed.
   No framework and nothing fetched from elsewhere (uPlot is served beside this file), so the
   page works offline. Every text from a run is put in the page with textContent, never as HTML. */
"use strict";

const API = "/dashboard/api";
const POLL_MS = 2000;
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];
const ROW_KEYS = new Set(["step", "split", "recorded_at", "training_step"]);

const state = {
  runs: [],            // /api/runs entries
  selected: new Set(), // run keys whose curves are drawn
  colors: new Map(),   // run key -> colour, stable across polls
  focus: null,         // the run whose samples are shown
  history: new Map(),  // run key -> {rows, next}
  steps: {},           // the focused run's {split: [steps]}
  split: null,
  step: null,           // null: the split's latest step, once the steps are read
  trajectory: null,     // the trajectory whose tokens are open (its line in the step's file)
  stepData: null,
  shownStep: null,      // "run|split|step" of stepData
  shownTokens: null,    // "run|split|step|trajectory" of the token view
  filter: "all",
  xmode: "step",
  metric: "",
  charts: {},
  rendered: false,
};

const $ = (id) => document.getElementById(id);
const runKey = (run) => `${run.project}/${run.name}`;
const fmt = (v, digits = 3) => (typeof v === "number" ? v.toFixed(digits) : "–");
const signed = (v) => (typeof v === "number" ? (v >= 0 ? "+" : "") + v.toFixed(3) : "–");

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k === "title" || k === "type") node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

async function getJSON(path) {
  // same-origin: the login cookie of a keyed `art serve` goes along (HttpOnly: never read here).
  const response = await fetch(API + path, { headers: { accept: "application/json" }, credentials: "same-origin" });
  // The session ended (logged out elsewhere, or the server's key changed): back to the login form.
  if (response.status === 401) { location.assign("/dashboard/"); throw new Error("logged out"); }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error((body.error && body.error.message) || `HTTP ${response.status}`);
  return body;
}

function showError(error) {
  const node = $("updated");
  node.textContent = error ? `error: ${error.message}` : `updated ${new Date().toLocaleTimeString()}`;
  node.classList.toggle("error", Boolean(error));
}

function runPath(key) {
  const [project, name] = key.split("/");
  return `/runs/${encodeURIComponent(project)}/${encodeURIComponent(name)}`;
}

// -- runs -----------------------------------------------------------------------------------

function colorOf(key) {
  if (!state.colors.has(key)) state.colors.set(key, COLORS[state.colors.size % COLORS.length]);
  return state.colors.get(key);
}

function renderRuns() {
  const body = $("runs").tBodies[0];
  body.replaceChildren();
  $("no-runs").hidden = state.runs.length > 0;
  for (const run of state.runs) {
    const key = runKey(run);
    const box = el("input", { type: "checkbox", checked: state.selected.has(key), "data-run": key });
    // A link to the run's place: a new tab opens on it; a plain click is handled in wire().
    const name = el("a", { href: hashOf({ run: key }), class: "run-name", "data-run": key,
                           title: run.base_model ? `base model ${run.base_model}` : "" },
      `${run.project}/`, el("wbr"), run.name);  // a long name wraps after its project
    const status = el("span", { class: `status ${run.status}`, text: run.status });
    const row = el("tr", { "data-run": key, class: key === state.focus ? "focus" : "" },
      el("td", {}, el("span", { class: "swatch" }), box), el("td", { class: "name" }, name),
      el("td", { class: "step", text: run.step ?? run.last_logged_step ?? "–" }),
      el("td", { class: "reward", text: fmt(run.reward) }), el("td", {}, status));
    row.querySelector(".swatch").style.background = colorOf(key);
    body.append(row);
  }
}

async function pollRuns() {
  const data = await getJSON("/runs");
  state.runs = data.runs;
  const known = new Set(state.runs.map(runKey));
  for (const key of [...state.selected]) if (!known.has(key)) state.selected.delete(key);
  if (state.selected.size === 0 && state.runs.length) {
    const latest = [...state.runs].sort((a, b) => (b.updated_at || 0) - (a.updated_at || 0))[0];
    state.selected.add(runKey(latest));
  }
  if (!state.focus || !known.has(state.focus)) {  // none yet, or a linked run that is not here
    state.focus = [...state.selected][0] || null;
    Object.assign(state, { steps: {}, split: null, step: null, trajectory: null });
  }
  renderRuns();
}

// -- history and curves ---------------------------------------------------------------------

async function pollHistory() {
  let changed = false;
  for (const key of state.selected) {
    const seen = state.history.get(key) || { rows: [], next: 0 };
    const data = await getJSON(`${runPath(key)}/history?since=${seen.next}`);
    if (data.reset) seen.rows = [];
    if (data.rows.length || data.reset) changed = true;
    seen.rows.push(...data.rows);
    seen.next = data.next;
    state.history.set(key, seen);
  }
  return changed;
}

function metricNames() {
  const names = new Set();
  for (const key of state.selected) {
    for (const row of (state.history.get(key) || { rows: [] }).rows) {
      for (const [k, v] of Object.entries(row)) if (!ROW_KEYS.has(k) && typeof v === "number") names.add(k);
    }
  }
  return [...names].sort();
}

/* The metric the chart opens on: the reward (`train/reward`, else the first `<split>/reward`). */
function preferredMetric(names) {
  if (names.includes("train/reward")) return "train/reward";
  return names.find((n) => /^[^/]+\/reward$/.test(n)) || names.find((n) => n.endsWith("/reward")) || names[0] || "";
}

function renderMetricSelect() {
  const select = $("metric");
  const names = metricNames();
  if (!names.includes(state.metric)) state.metric = preferredMetric(names);
  if (select.dataset.names !== names.join("\n")) {
    // One option group per section (train, val, data, time, costs, ...): ART's taxonomy is long.
    const sections = new Map();
    for (const n of names) {
      const section = n.includes("/") ? n.slice(0, n.indexOf("/")) : "other";
      if (!sections.has(section)) sections.set(section, el("optgroup", { label: section }));
      sections.get(section).append(el("option", { value: n, text: n }));
    }
    select.replaceChildren(...sections.values());
    select.dataset.names = names.join("\n");
  }
  select.value = state.metric;
  $("metric-title").textContent = state.metric || "metric";
}

/* {x: [...], y: [...], lo, hi} of one run's metric, one point per x (the last row wins). */
function seriesOf(key, metric, band) {
  const points = new Map();
  for (const row of (state.history.get(key) || { rows: [] }).rows) {
    const y = row[metric];
    if (typeof y !== "number") continue;
    const x = state.xmode === "time" ? row.recorded_at : row.step;
    if (typeof x !== "number") continue;
    const sd = band ? row[band] : undefined;
    points.set(x, [y, typeof sd === "number" ? sd : null]);
  }
  const xs = [...points.keys()].sort((a, b) => a - b);
  return { xs, ys: xs.map((x) => points.get(x)[0]), sds: xs.map((x) => points.get(x)[1]) };
}

const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];

/* Tick labels with 3 significant digits, so a loss of 0.0003 does not print as "-0". */
function ticks(_chart, values) {
  return values.map((v) => (v === 0 ? "0" : Math.abs(v) < 1e-3 || Math.abs(v) >= 1e6 ? v.toExponential(1)
    : String(Number(v.toPrecision(3)))));
}

function drawChart(id, metric, band) {
  const box = $(id);
  if (state.charts[id]) { state.charts[id].destroy(); delete state.charts[id]; }
  box.replaceChildren();
  const tables = [], series = [{}], bands = [];
  let points = 0;
  for (const key of state.selected) {
    const { xs, ys, sds } = seriesOf(key, metric, band);
    if (!xs.length) continue;
    const color = colorOf(key);
    points += ys.length;
    const withBand = band && sds.some((s) => s !== null);
    const table = [xs, ys];
    series.push({ label: key, stroke: color, width: 2, points: { show: xs.length < 60 } });
    if (withBand) {
      table.push(ys.map((y, i) => (sds[i] === null ? null : y + sds[i])), ys.map((y, i) => (sds[i] === null ? null : y - sds[i])));
      const first = series.length;
      series.push({ label: `${key} +std`, stroke: color + "55", width: 1, points: { show: false } },
                  { label: `${key} -std`, stroke: color + "55", width: 1, points: { show: false } });
      bands.push({ series: [first, first + 1], fill: color + "22" });
    }
    tables.push(table);
  }
  box.dataset.points = String(points);
  box.dataset.metric = metric;
  if (!tables.length) {
    box.append(el("p", { class: "muted empty", text: metric ? `no ${metric} logged yet` : "nothing logged yet" }));
    return;
  }
  const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
  const options = {
    width: Math.max(320, box.clientWidth || 600), height: 220, series, bands,
    scales: { x: { time: state.xmode === "time" } },
    axes: state.xmode === "time" ? [{}, { values: ticks, size: 60 }]
      : [{ label: "step", incrs: STEP_INCRS, values: ticks }, { values: ticks, size: 60 }],
    legend: { show: true },
  };
  const chart = new uPlot(options, data, box);
  if (state.xmode === "step") {
    chart.over.addEventListener("click", () => {
      const i = chart.cursor.idx;
      if (i != null && state.focus) go({ step: data[0][i], trajectory: null }).catch(showError);
    });
  }
  state.charts[id] = chart;
}

function drawCharts() {
  renderMetricSelect();
  drawChart("chart-reward", "train/reward", "train/reward_std_dev");
  drawChart("chart-loss", "train/loss");
  drawChart("chart-metric", state.metric);
  if (!state.rendered && Number($("chart-reward").dataset.points) > 0) {
    state.rendered = true;
    window.__dashboardRenderedAt = performance.now();  // what benchmarks/dashboard_load.py reads
    document.body.dataset.rendered = "1";
  }
}

// -- the place: run, split, step and trajectory, kept in the URL ---------------------------

/* The samples shown are a place, #run=…&split=…&step=…&trajectory=… in the URL's fragment, so
   a step or a trajectory can be linked and back/forward walk the places visited. A click
   pushes a new place (go); what the page fills in itself (the default split, the latest step)
   replaces the current one; back, forward or an edited URL is read again (popstate). */

function readPlace() {
  const params = new URLSearchParams(location.hash.slice(1));
  const index = (value) => (value !== null && /^\d{1,15}$/.test(value) ? Number(value) : null);
  return { run: params.get("run"), split: params.get("split"), step: index(params.get("step")),
           trajectory: index(params.get("trajectory")) };
}

function hashOf(place) {
  const params = new URLSearchParams();
  for (const key of ["run", "split", "step", "trajectory"]) {
    if (place[key] !== null && place[key] !== undefined && place[key] !== "") params.set(key, place[key]);
  }
  const text = params.toString();
  return text ? `#${text}` : "";
}

const here = () => ({ run: state.focus, split: state.split, step: state.step, trajectory: state.trajectory });

function savePlace(push) {
  const hash = hashOf(here());
  if (hash === location.hash) return;
  const url = location.pathname + location.search + hash;
  if (push) history.pushState(null, "", url); else history.replaceState(null, "", url);
}

/* Move to a place (a click): the fields given change, the URL gets a new entry, samples follow. */
async function go(change) {
  applyPlace({ ...here(), ...change });
  fillPlace();
  savePlace(true);
  renderRuns();
  await pollSteps();
}

function applyPlace(place) {
  const run = place.run || state.focus;
  if (run !== state.focus) {
    state.focus = run;
    state.selected.add(run);  // a run that is not listed is dropped again by pollRuns
    state.steps = {};
  }
  state.split = place.split || null;
  state.step = place.step ?? null;
  state.trajectory = place.trajectory ?? null;
}

/* The default split (train, else the first) and its latest step, once the run's steps are read. */
function fillPlace() {
  const splits = Object.keys(state.steps);
  if (!splits.length) return;
  if (!splits.includes(state.split)) {
    state.split = splits.includes("train") ? "train" : splits[0];
    state.step = null;
    state.trajectory = null;
  }
  const steps = state.steps[state.split];
  if (state.step === null && steps.length) state.step = steps[steps.length - 1];
}

// -- samples --------------------------------------------------------------------------------

async function pollSteps() {
  if (!state.focus) return;
  const focus = state.focus;
  const steps = await getJSON(`${runPath(focus)}/steps`);
  if (focus !== state.focus) return;  // another run was picked meanwhile
  state.steps = steps;
  fillPlace();
  savePlace(false);
  const splits = Object.keys(state.steps);
  const select = $("split");
  if ([...select.options].map((o) => o.value).join() !== splits.join()) {
    select.replaceChildren(...splits.map((s) => el("option", { value: s, text: s })));
  }
  select.value = state.split || "";
  $("samples-run").textContent = state.focus;
  await showPlace();
}

function renderSteps() {
  const steps = (state.steps[state.split] || []).slice().reverse();
  const box = $("steps");
  const wanted = steps.join(",") + "|" + state.step;
  if (box.dataset.shown === wanted) return;
  box.dataset.shown = wanted;
  box.replaceChildren(...steps.map((s) => el("button", { class: s === state.step ? "step on" : "step",
    "data-step": s, text: `step ${s}` })));
  if (!steps.length) box.append(el("span", { class: "muted", text: "no samples logged for this run" }));
}

let placeShown = 0;  // counts showPlace calls: an answer that arrives after a newer call is dropped

/* Make the samples and the token view show the current place, reading only what changed. */
async function showPlace() {
  const call = ++placeShown;
  renderSteps();
  const stepKey = `${state.focus}|${state.split}|${state.step}`;
  if (state.step === null || !state.split) {
    state.stepData = null; state.shownStep = null; state.shownTokens = null;
    renderGroups();
    $("tokens").hidden = true;
    return;
  }
  if (state.shownStep !== stepKey) {
    let data;
    try {
      data = await getJSON(`${runPath(state.focus)}/steps/${encodeURIComponent(state.split)}/${state.step}`);
    } catch (error) {
      if (call !== placeShown) return;
      state.stepData = null; state.shownStep = null;  // read again at the next poll
      $("groups").replaceChildren(el("p", { class: "muted", text: error.message }));
      $("tokens").hidden = true;
      return;
    }
    if (call !== placeShown) return;
    state.stepData = data; state.shownStep = stepKey; state.shownTokens = null;
    renderGroups();
  }
  markSelected();
  const tokensKey = `${stepKey}|${state.trajectory}`;
  if (state.trajectory === null) {
    state.shownTokens = null;
    $("tokens").hidden = true;
  } else if (state.shownTokens !== tokensKey) {
    let data = null, failure = null;
    try {
      data = await getJSON(`${runPath(state.focus)}/steps/${encodeURIComponent(state.split)}/${state.step}` +
                           `/trajectories/${state.trajectory}/tokens`);
    } catch (error) {
      failure = error;  // a linked trajectory that is not there: said once, in the token view
    }
    if (call !== placeShown) return;
    state.shownTokens = tokensKey;
    if (data) showTokens(data);
    else {
      $("tokens").hidden = false;
      $("tokens-title").textContent = `trajectory #${state.trajectory}: ${failure.message}`;
      $("token-text").replaceChildren();
    }
  }
}

function markSelected() {
  for (const node of document.querySelectorAll("#groups .trajectory")) {
    node.classList.toggle("selected", Number(node.dataset.index) === state.trajectory);
  }
}

function filtered(groups) {
  const pick = (group, better) => {
    if (!group.trajectories.length) return [];
    return [group.trajectories.reduce((a, b) => (better(b.reward, a.reward) ? b : a))];
  };
  switch (state.filter) {
    case "best": return groups.map((g) => ({ ...g, trajectories: pick(g, (x, y) => x > y) })).filter((g) => g.trajectories.length);
    case "worst": return groups.map((g) => ({ ...g, trajectories: pick(g, (x, y) => x < y) })).filter((g) => g.trajectories.length);
    case "exceptions": return groups.filter((g) => g.exceptions.length);
    case "zero": return groups.filter((g) => g.zero_variance);
    default: return groups;
  }
}

function renderMessage(message) {
  const node = el("div", { class: `msg role-${message.role}${message.trained ? " trained" : ""}` },
    el("span", { class: "role", text: message.role + (message.name ? ` (${message.name})` : "") +
      (message.tool_call_id ? ` → ${message.tool_call_id}` : "") + (message.choice ? (message.trained ? " · sampled, trained" : " · sampled, no logprobs") : "") }));
  if (message.content) node.append(el("pre", { text: message.content }));
  for (const call of message.tool_calls || []) {
    node.append(el("div", { class: "tool-call" }, el("span", { class: "role", text: `tool call ${call.id || ""}` }),
      el("pre", { text: `${call.name}(${call.arguments ?? ""})` })));
  }
  return node;
}

function renderMetadata(metadata) {
  const entries = Object.entries(metadata || {});
  if (!entries.length) return null;
  return el("div", { class: "metadata" }, el("span", { class: "role", text: "metadata" }),
    el("dl", {}, ...entries.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v === null ? "null" : String(v) })])));
}

function renderTrajectory(trajectory) {
  const metrics = Object.entries(trajectory.metrics).map(([k, v]) => `${k}=${typeof v === "number" ? fmt(v) : v}`).join("  ");
  const tokens = el("button", { class: "show-tokens", "data-index": trajectory.index, text: "tokens" });
  const advClass = trajectory.advantage > 0 ? "pos" : trajectory.advantage < 0 ? "neg" : "zero";
  // "#N" links to this trajectory (its tokens open): copy it, or open it in a new tab.
  const link = el("a", { class: "traj-link", text: `#${trajectory.index}`, "data-index": trajectory.index,
    href: hashOf({ ...here(), trajectory: trajectory.index }) });
  return el("div", { class: "trajectory", "data-index": trajectory.index, "data-reward": trajectory.reward },
    el("div", { class: "traj-head" },
      link, el("span", { text: `reward ${fmt(trajectory.reward)}` }),
      el("span", { class: `adv ${advClass}`, text: `advantage ${signed(trajectory.advantage)}` }),
      el("span", { class: "muted", text: metrics }), tokens),
    renderMetadata(trajectory.metadata),
    ...trajectory.messages.map(renderMessage),
    trajectory.logs.length ? el("pre", { class: "logs", text: trajectory.logs.join("\n") }) : null);
}

function renderGroups() {
  const box = $("groups");
  const data = state.stepData;
  if (!data) { box.replaceChildren(); return; }
  const groups = filtered(data.groups);
  box.replaceChildren(el("p", { class: "muted", text: `${data.split} step ${data.step}: ${data.groups.length} groups, ` +
    `${data.groups.reduce((n, g) => n + g.trajectories.length, 0)} trajectories; advantages scaled as ` +
    `scale_rewards=${JSON.stringify(data.scale_rewards)}` }));
  if (!groups.length) box.append(el("p", { class: "muted empty", text: "no group matches this filter" }));
  for (const group of groups) {
    const head = el("h4", {}, el("span", { text: `group ${group.index}` }),
      el("span", { class: "muted", text: ` mean ${fmt(group.reward_mean)} · std ${fmt(group.reward_std)}` }),
      group.zero_variance ? el("span", { class: "badge", text: "zero variance: no signal" }) : null,
      group.exceptions.length ? el("span", { class: "badge bad", text: `${group.exceptions.length} exception(s)` }) : null);
    const node = el("div", { class: "group", "data-group": group.index }, head);
    for (const exc of group.exceptions) {
      node.append(el("details", { class: "exception" }, el("summary", { text: `${exc.type}: ${exc.message}` }),
        el("pre", { text: exc.traceback })));
    }
    node.append(...group.trajectories.map(renderTrajectory));
    box.append(node);
  }
  markSelected();
}

// -- tokens ---------------------------------------------------------------------------------

function tokenColor(advantage) {
  const alpha = 0.2 + 0.6 * Math.min(1, Math.abs(advantage) / 2);
  return advantage > 0 ? `rgba(22, 163, 74, ${alpha})` : advantage < 0 ? `rgba(220, 38, 38, ${alpha})` : "rgba(202, 138, 4, 0.25)";
}

function showTokens(data) {
  const section = $("tokens");
  section.hidden = false;
  const gaps = data.tokens.filter((t) => t.trainer_logprob !== null && t.sampler_logprob !== null)
    .map((t) => Math.abs(t.trainer_logprob - t.sampler_logprob));
  $("tokens-title").textContent = `${state.focus} · ${data.split} step ${data.step} · trajectory #${data.index} · ` +
    `reward ${fmt(data.reward)} · advantage ${signed(data.advantage)} · ${data.trained_tokens} trained tokens` +
    (gaps.length ? ` · |trainer − sampler| logprob mean ${fmt(gaps.reduce((a, b) => a + b, 0) / gaps.length, 5)}, ` +
      `max ${fmt(Math.max(...gaps), 5)}` : ` · ${data.trainer_logprob_note}`) +
    (data.has_text ? "" : " · no tokenizer on this machine: ids shown");
  const box = $("token-text");
  box.replaceChildren();
  let sequence = null;
  for (const token of data.tokens) {
    if (token.sequence !== sequence) {
      if (sequence !== null) box.append(el("hr"));
      sequence = token.sequence;
    }
    const text = token.text === null ? `⟨${token.id}⟩` : token.text.replace(/\n/g, "↵\n");
    const kind = !token.trained ? "ctx" : token.advantage > 0 ? "pos" : token.advantage < 0 ? "neg" : "zero";
    const sampler = token.sampler_logprob === null ? "n/a" : token.sampler_logprob.toFixed(4);
    const trainer = token.trainer_logprob === null ? "n/a" : token.trainer_logprob.toFixed(4);
    const both = token.sampler_logprob !== null && token.trainer_logprob !== null;
    const difference = both ? (token.trainer_logprob - token.sampler_logprob).toFixed(5) : "n/a";
    const span = el("span", { class: `tok ${kind}`, text, "data-trained": token.trained ? "1" : "0",
      "data-advantage": token.advantage,
      title: `token ${token.id} · ${token.trained ? `trained, advantage ${signed(token.advantage)}` : "not trained"}\n` +
        `sampler logprob ${sampler}\ntrainer logprob ${trainer}\ndifference (trainer − sampler) ${difference}` });
    if (token.trained) span.style.backgroundColor = tokenColor(token.advantage);
    box.append(span);
  }
  for (const b of data.breaks) {
    box.append(el("p", { class: "badge bad", text: `break at choice ${b.choice}: its prompt differs at position ` +
      `${b.position}; training starts a new sequence there` }));
  }
  box.scrollTop = 0;
  section.scrollIntoView({ block: "nearest" });
  scrollToTrained(box);
}

/* A long context puts the trained tokens below the box's fold: open at the first of them, with
   a few lines of the context before it still in view. */
function scrollToTrained(box) {
  const first = box.querySelector('.tok[data-trained="1"]');
  if (!first) return;
  const lines = 3 * (parseFloat(getComputedStyle(box).lineHeight) || 20);
  box.scrollTop = Math.max(0, box.scrollTop + first.getBoundingClientRect().top - box.getBoundingClientRect().top - lines);
  first.scrollIntoView({ block: "nearest" });  // and the page, where the box itself is taller than the window
}

// -- wiring ---------------------------------------------------------------------------------

let polling = false;

async function poll() {
  if (polling) return;  // a slow poll is not stacked under the next one
  polling = true;
  try {
    await pollRuns();
    const changed = await pollHistory();
    if (changed || !state.rendered) drawCharts();
    await pollSteps();
    showError(null);
  } catch (error) {
    showError(error);
  } finally {
    polling = false;
  }
}

function wire() {
  $("runs").addEventListener("click", (event) => {
    const target = event.target;
    const key = target.dataset && target.dataset.run;
    if (!key) return;
    if (target.type === "checkbox") {
      if (target.checked) state.selected.add(key); else state.selected.delete(key);
      renderRuns();
    } else {
      if (event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) return;  // a new tab: its own place
      event.preventDefault();
      state.selected.add(key);
      go({ run: key, split: null, step: null, trajectory: null }).catch(showError);
    }
    poll().then(drawCharts);
  });
  $("xmode").addEventListener("change", (e) => { state.xmode = e.target.value; drawCharts(); });
  $("metric").addEventListener("change", (e) => { state.metric = e.target.value; drawCharts(); });
  $("split").addEventListener("change", (e) => go({ split: e.target.value, step: null, trajectory: null }).catch(showError));
  $("steps").addEventListener("click", (e) => {
    if (e.target.dataset.step) go({ step: Number(e.target.dataset.step), trajectory: null }).catch(showError);
  });
  document.querySelector(".filters").addEventListener("click", (e) => {
    if (!e.target.dataset.filter) return;
    state.filter = e.target.dataset.filter;
    for (const b of document.querySelectorAll(".filters button")) b.classList.toggle("on", b === e.target);
    renderGroups();
  });
  $("groups").addEventListener("click", (e) => {
    const link = e.target.classList.contains("traj-link") && !(e.ctrlKey || e.metaKey || e.shiftKey);
    if (link) e.preventDefault();
    if (link || e.target.classList.contains("show-tokens")) {
      go({ trajectory: Number(e.target.dataset.index) }).catch(showError);
    }
  });
  $("tokens-close").addEventListener("click", () => go({ trajectory: null }).catch(showError));
  // Back, forward, or a URL edited by hand: show the place it names.
  window.addEventListener("popstate", () => {
    if (hashOf(here()) === location.hash) return;
    applyPlace(readPlace());
    renderRuns();
    pollSteps().catch(showError);
    poll().then(drawCharts);
  });
  let resize = null;
  window.addEventListener("resize", () => { clearTimeout(resize); resize = setTimeout(drawCharts, 200); });
}

applyPlace(readPlace());
wire();
poll().then(() => setInterval(poll, POLL_MS));
