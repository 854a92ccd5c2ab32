// The console: health gates, the repository, live charts, rollouts, and the playground.
// Every request goes to the server's public APIs; admin ones carry the token typed in.
import { $, el, failure, fmt } from "./dom.js";
import { CHARTS, parse } from "./metrics.js";
import { Playground } from "./playground.js";

const params = new URLSearchParams(location.search);
const REFRESH_MS = Number(params.get("refresh")) || 2000;
const POINTS = 150;

const state = {
  token: null, // the admin token, in memory only: a reload forgets it
  models: [],
  admin: { enabled: false, model_control: "none" },
  prev: null, // the previous /metrics scrape and when it was taken
  charts: new Map(),
  chartModel: "",
};

// ------------------------------------------------------------------ health gates

async function gates() {
  const box = $("#gates");
  const rows = await Promise.all(
    [["live", "/v2/health/live"], ["ready", "/v2/health/ready"], ["startup", "/startupz"]].map(
      async ([name, url]) => {
        try {
          const r = await fetch(url);
          const why = r.ok ? await readyNote(r) : (await failure(r)).replace(/^\d+: /, "");
          return [name, r.ok, why];
        } catch (e) {
          return [name, false, "server unreachable"];
        }
      },
    ),
  );
  box.replaceChildren(
    ...rows.map(([name, ok, why]) =>
      el("span", { class: `gate ${ok ? "ok" : "bad"}`, "data-gate": name, title: why },
        `${name} ${ok ? "✓" : "✗"}`, why ? el("small", {}, ` ${why}`) : null),
    ),
  );
}

async function readyNote(response) {
  const text = await response.text();
  if (!text) return "";
  try {
    const doc = JSON.parse(text);
    return [doc.lazy_models && `lazy: ${doc.lazy_models.join(", ")}`,
      doc.degraded && `degraded: ${doc.degraded.join("; ")}`].filter(Boolean).join(" · ");
  } catch {
    return "";
  }
}

// ------------------------------------------------------------------ the repository

async function models() {
  const r = await fetch("/console/api/models");
  if (!r.ok) return;
  const doc = await r.json();
  state.models = doc.models;
  state.admin = doc.admin;
  renderModels();
  renderAdminForm();
  playground.update(state.models);
  updateChartModels();
}

function renderModels() {
  const admin = state.token != null;
  $("#model-table thead tr").replaceChildren(
    ...["model", "version", "state", "backend", "rollout", "reason"].map((h) => el("th", {}, h)),
    ...(admin ? [el("th", { class: "admin-control" }, "admin")] : []),
  );
  $("#model-table tbody").replaceChildren(
    ...state.models.map((m) =>
      el("tr", { "data-model": m.name, "data-state": m.state },
        el("td", {}, m.name),
        el("td", {}, m.version ?? "–"),
        el("td", {}, el("span", { class: `state ${m.state.toLowerCase()}` }, m.state)),
        el("td", {}, m.backend ?? "–"),
        el("td", {}, m.rollout ? "yes" : ""),
        el("td", { class: "reason" }, m.reason || ""),
        admin ? el("td", { class: "admin-control" }, adminButtons(m)) : null,
      ),
    ),
  );
}

function adminButtons(m) {
  if (state.admin.model_control === "none") return el("small", {}, "model control: none");
  const loaded = m.state === "READY" || m.state === "LOADING";
  return el("button", {
    class: "admin-control", "data-action": loaded ? "unload" : "load",
    onclick: () => adminCall(`/v2/repository/models/${encodeURIComponent(m.name)}/${loaded ? "unload" : "load"}`),
  }, loaded ? "unload" : "load");
}

async function adminCall(url, method = "POST", body = null, fromRollouts = false) {
  const status = $("#admin-status");
  status.textContent = `${method} ${url} …`;
  const r = await fetch(url, {
    method,
    headers: { authorization: `Bearer ${state.token}`, "content-type": "application/json" },
    body: body == null ? null : JSON.stringify(body),
  });
  status.textContent = r.ok ? `${method} ${url}: done` : await failure(r);
  if (fromRollouts) document.activeElement.blur(); // let the card show the new policy
  await Promise.all([models(), gates(), rollouts()]);
}

// ------------------------------------------------------------------ admin token

function renderAdminForm() {
  const form = $("#admin-form");
  if (!state.admin.enabled) {
    form.replaceChildren(el("small", {}, "read-only: the admin API is off (--admin-token)"));
    return;
  }
  if (form.dataset.built) return;
  form.dataset.built = "1";
  const input = el("input", { type: "password", id: "admin-token", placeholder: "admin token",
    autocomplete: "off" });
  form.replaceChildren(input, el("button", { type: "submit", id: "admin-unlock" }, "unlock"),
    el("span", { id: "admin-status" }, "read-only"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const token = input.value;
    const r = await fetch("/v2/repository/index", { headers: { authorization: `Bearer ${token}` } });
    if (r.ok) {
      state.token = token;
      input.value = "";
      $("#admin-status").textContent = "admin";
      document.body.classList.add("admin");
    } else {
      state.token = null;
      $("#admin-status").textContent = await failure(r);
    }
    renderModels();
    await rollouts();
  });
}

// ------------------------------------------------------------------ charts

function buildCharts() {
  const grid = $("#chart-grid");
  for (const [id, title, unit, series] of CHARTS) {
    const now = el("span", { class: "now", "data-chart": id }, "–");
    const box = el("div", { class: "chart", id: `chart-${id}` },
      el("h3", {}, title, " ", now, el("small", {}, ` ${unit}`)));
    grid.append(box);
    const palette = ["#2b6cb0", "#c05621", "#2f855a", "#6b46c1"];
    const plot = new uPlot({
      width: 360, height: 170, legend: { show: true },
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(hi * 1.1, 1)] } },
      series: [{}, ...series.map(([label], i) => ({ label, stroke: palette[i], width: 1.5,
        spanGaps: false }))],
      axes: [{}, { size: 50 }],
    }, [[], ...series.map(() => [])], box);
    state.charts.set(id, { plot, series, data: [[], ...series.map(() => [])], now });
  }
  $("#chart-model").addEventListener("change", (e) => {
    state.chartModel = e.target.value;
    for (const chart of state.charts.values()) chart.data = chart.data.map(() => []);
  });
}

function updateChartModels() {
  const select = $("#chart-model");
  const names = [...new Set(state.models.map((m) => m.name))];
  const have = [...select.options].map((o) => o.value).slice(1);
  if (have.join() === names.join()) return;
  select.replaceChildren(el("option", { value: "" }, "all models"),
    ...names.map((n) => el("option", { value: n, selected: n === state.chartModel }, n)));
}

async function scrape() {
  const r = await fetch("/metrics");
  if (!r.ok) return;
  const now = { snapshot: parse(await r.text()), t: Date.now() / 1000 };
  const prev = state.prev;
  state.prev = now;
  if (!prev) return;
  const dt = Math.max(now.t - prev.t, 1e-3);
  const model = state.chartModel;
  const keep = (labels) => !model || labels.model === model;
  for (const chart of state.charts.values()) {
    chart.data[0].push(now.t);
    chart.series.forEach(([, f], i) => {
      const v = f(prev.snapshot, now.snapshot, keep, dt);
      chart.data[i + 1].push(v == null || !Number.isFinite(v) ? null : v);
    });
    if (chart.data[0].length > POINTS) chart.data.forEach((a) => a.shift());
    chart.plot.setData(chart.data);
    const latest = chart.data[1][chart.data[1].length - 1];
    chart.now.textContent = fmt(latest);
    chart.now.dataset.value = latest ?? "";
  }
  document.body.dataset.scrapes = String(Number(document.body.dataset.scrapes || 0) + 1);
}

// ------------------------------------------------------------------ rollouts

async function rollouts() {
  const box = $("#rollout-list");
  if (box.contains(document.activeElement)) return; // someone is typing a traffic split
  const names = [...new Set(state.models.filter((m) => m.rollout).map((m) => m.name))];
  if (!names.length) {
    box.replaceChildren(el("p", { class: "muted" },
      "No model has a traffic policy ([traffic] in its config.toml, or the admin API)."));
    return;
  }
  const cards = await Promise.all(names.map(async (name) => {
    const r = await fetch(`/v2/models/${encodeURIComponent(name)}/rollout`);
    if (!r.ok) return el("div", { class: "card" }, el("h3", {}, name), await failure(r));
    return rolloutCard(await r.json());
  }));
  if (!box.contains(document.activeElement)) box.replaceChildren(...cards);
}

const interval = (i, unit = "") =>
  i ? `${fmt(i.value)}${unit} [${fmt(i.low)}, ${fmt(i.high)}]` : "–";

function rolloutCard(report) {
  const p = report.policy;
  const split = [`stable v${p.stable}`,
    p.canary != null && `canary v${p.canary} at ${fmt(p.canary_weight)}%`,
    p.shadow != null && `shadow v${p.shadow} sees ${fmt(p.shadow_percent)}%`].filter(Boolean);
  const level = `${Math.round(report.confidence_level * 100)}%`;
  const versions = el("table", {},
    el("tr", {}, ...["version", "role", "requests", "errors", `error rate (${level} CI)`,
      `p50 ms (${level} CI)`, `p99 ms (${level} CI)`].map((h) => el("th", {}, h))),
    ...report.versions.map((v) => el("tr", {},
      el("td", {}, v.version), el("td", {}, v.role), el("td", {}, v.requests),
      el("td", {}, v.errors), el("td", {}, interval(v.error_rate)),
      el("td", {}, interval(v.latency_ms.p50)), el("td", {}, interval(v.latency_ms.p99)))));
  const verdicts = report.candidates.map((c) => el("div", { class: "verdict", "data-role": c.role },
    el("strong", { class: `rec ${c.recommendation.replace(/ /g, "-")}` },
      `${c.role} v${c.version}: ${c.recommendation}`),
    el("div", {}, `latency difference vs v${c.baseline}: ${interval(c.latency_difference_ms, " ms")}`),
    c.agreement ? el("div", {}, `shadow agreement: ${agreementText(c.agreement)}`) : null,
    el("ul", {}, ...c.reasons.map((r) => el("li", {}, r)))));
  return el("div", { class: "card", "data-rollout": report.model },
    el("h3", {}, report.model), el("p", {}, split.join(" · ")), versions, ...verdicts,
    state.token != null ? trafficForm(report.model, p) : null);
}

function agreementText(agreement) {
  return Object.entries(agreement).map(([output, a]) =>
    `${output}: ${Object.entries(a).filter(([, v]) => typeof v === "number")
      .map(([k, v]) => `${k} ${fmt(v)}`).join(", ")}`).join("; ");
}

function trafficForm(model, policy) {
  const base = `/v2/repository/models/${encodeURIComponent(model)}/traffic`;
  const weight = el("input", { type: "number", min: 0, max: 100, step: 1,
    value: policy.canary_weight, class: "admin-control", "data-traffic": "weight" });
  const button = (action, label, call) =>
    el("button", { class: "admin-control", "data-traffic": action, onclick: call }, label);
  return el("div", { class: "admin-control traffic" },
    "canary weight % ", weight,
    button("set", "set split", () => adminCall(base, "PATCH",
      { canary_weight: Number(weight.value) }, true)),
    button("promote", "promote", () => adminCall(base + "/promote", "POST", null, true)),
    button("rollback", "roll back", () => adminCall(base + "/rollback", "POST", null, true)));
}

// ------------------------------------------------------------------ main loop

const playground = new Playground($("#play-model"), $("#play-panel"));

async function serverName() {
  const r = await fetch("/v2");
  if (r.ok) $("#server-version").textContent = `v${(await r.json()).version}`;
}

async function tick(n) {
  // the rollout report bootstraps its intervals: fetched every third tick
  const repository = models().then(() => (n % 3 === 0 ? rollouts() : null));
  await Promise.allSettled([repository, gates(), scrape()]);
}

buildCharts();
serverName();
let n = 0;
(async function loop() {
  await tick(n++);
  setTimeout(loop, REFRESH_MS);
})();
