// The server's /metrics (Prometheus text format) read in the browser: rates and
// quantiles between two scrapes, as PromQL's rate() and histogram_quantile() compute them.

// "name{a="x",b="y"} 1.5" lines -> Map(name -> [{labels, value}]); comments skipped.
export function parse(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const brace = line.indexOf("{");
    const space = brace < 0 ? line.indexOf(" ") : line.indexOf(" ", line.lastIndexOf("}"));
    const name = line.slice(0, brace < 0 ? space : brace);
    const labels = {};
    if (brace >= 0) {
      const body = line.slice(brace + 1, line.lastIndexOf("}"));
      for (const m of body.matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
        labels[m[1]] = m[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      }
    }
    const value = Number(line.slice(space + 1).trim().split(" ")[0]);
    if (!out.has(name)) out.set(name, []);
    out.get(name).push({ labels, value });
  }
  return out;
}

// The sum of a metric's samples whose model label passes `keep`.
export function total(snapshot, name, keep = () => true) {
  let sum = 0;
  for (const s of snapshot.get(name) || []) if (keep(s.labels)) sum += s.value;
  return sum;
}

// Per-second increase of a counter (a reset counts from zero, as rate() does).
export function rate(prev, now, name, keep, seconds) {
  const a = total(prev, name, keep), b = total(now, name, keep);
  return (b >= a ? b - a : b) / seconds;
}

// Bucket counts of a histogram summed over the kept series: [[le, cumulative count]].
function buckets(snapshot, name, keep) {
  const byLe = new Map();
  for (const s of snapshot.get(name + "_bucket") || []) {
    if (!keep(s.labels)) continue;
    const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return [...byLe.entries()].sort((x, y) => x[0] - y[0]);
}

// The q-quantile of the observations made between two scrapes (null when none),
// interpolated inside its bucket like histogram_quantile.
export function quantile(prev, now, name, keep, q) {
  const before = new Map(buckets(prev, name, keep));
  const delta = buckets(now, name, keep).map(([le, c]) => [le, c - (before.get(le) || 0)]);
  if (!delta.length) return null;
  const count = delta[delta.length - 1][1];
  if (!(count > 0)) return null;
  const rank = q * count;
  let lower = 0, below = 0;
  for (const [le, cumulative] of delta) {
    if (cumulative >= rank) {
      if (le === Infinity) return lower;
      return lower + (le - lower) * ((rank - below) / Math.max(cumulative - below, 1e-12));
    }
    lower = le;
    below = cumulative;
  }
  return lower;
}

// Mean of a histogram's observations between two scrapes (null when none).
export function mean(prev, now, name, keep) {
  const n = total(now, name + "_count", keep) - total(prev, name + "_count", keep);
  const s = total(now, name + "_sum", keep) - total(prev, name + "_sum", keep);
  return n > 0 ? s / n : null;
}

const ms = (x) => (x == null ? null : x * 1000);

// What each chart plots: [title, unit, [[series label, (prev, now, keep, dt) -> value]]].
export const CHARTS = [
  ["requests", "Requests/s", "req/s", [
    ["answered", (p, n, k, dt) =>
      rate(p, n, "bitserve_request_success_total", k, dt) +
      rate(p, n, "bitserve_llm_request_success_total", k, dt)],
    ["failed", (p, n, k, dt) => rate(p, n, "bitserve_request_failure_total", k, dt)],
  ]],
  ["latency", "Request latency", "ms", [
    ["p50", (p, n, k) => ms(quantile(p, n, "bitserve_request_duration_seconds", k, 0.5))],
    ["p99", (p, n, k) => ms(quantile(p, n, "bitserve_request_duration_seconds", k, 0.99))],
  ]],
  ["queue", "Queue depth", "requests", [
    ["batcher", (p, n, k) => total(n, "bitserve_queue_depth", k)],
    ["llm waiting", (p, n, k) => total(n, "bitserve_llm_num_requests_waiting", k)],
    ["llm running", (p, n, k) => total(n, "bitserve_llm_num_requests_running", k)],
  ]],
  ["batch", "Batch size", "rows", [
    ["mean batch", (p, n, k) => mean(p, n, "bitserve_batch_size", k)],
    ["diffusion rows/step", (p, n, k) => mean(p, n, "bitserve_diffusion_rows_per_step", k)],
  ]],
  ["tokens", "Tokens/s", "tok/s", [
    ["generated", (p, n, k, dt) => rate(p, n, "bitserve_llm_generation_tokens_total", k, dt)],
    ["prompt", (p, n, k, dt) => rate(p, n, "bitserve_llm_prompt_tokens_total", k, dt)],
  ]],
  ["ttft", "TTFT and TPOT", "ms", [
    ["TTFT p50", (p, n, k) =>
      ms(quantile(p, n, "bitserve_llm_time_to_first_token_seconds", k, 0.5))],
    ["TTFT p99", (p, n, k) =>
      ms(quantile(p, n, "bitserve_llm_time_to_first_token_seconds", k, 0.99))],
    ["TPOT p50", (p, n, k) =>
      ms(quantile(p, n, "bitserve_llm_time_per_output_token_seconds", k, 0.5))],
  ]],
  ["kv", "KV cache", "%", [
    ["used", (p, n, k) => 100 * max(n, "bitserve_llm_kv_cache_usage_perc", k)],
    ["waste", (p, n, k) => 100 * max(n, "bitserve_llm_kv_cache_waste_perc", k)],
  ]],
];

function max(snapshot, name, keep) {
  let m = 0;
  for (const s of snapshot.get(name) || []) if (keep(s.labels)) m = Math.max(m, s.value);
  return m;
}
