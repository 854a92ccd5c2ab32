// One playground per kind of model, each over the public API that kind speaks:
// chat (OpenAI, streamed), infer (v2, a form built from the model's metadata),
// embedding (v2: cosine similarity of sentences), image (OpenAI images), detector (v2).
import { el, failure, fmt, postJSON } from "./dom.js";

export class Playground {
  constructor(select, panel) {
    this.select = select;
    this.panel = panel;
    this.current = null; // the model name whose panel is shown
    select.addEventListener("change", () => this.show(select.value));
  }

  // Called with the repository on every refresh: only a new choice rebuilds the panel.
  update(models) {
    const ready = new Map();
    for (const m of models) if (m.state === "READY" && m.kind) ready.set(m.name, m.kind);
    this.kinds = ready;
    const names = [...ready.keys()];
    const have = [...this.select.options].map((o) => o.value);
    if (have.join() !== names.join()) {
      this.select.replaceChildren(...names.map((n) =>
        el("option", { value: n, selected: n === this.current }, `${n} (${ready.get(n)})`)));
    }
    if (this.current == null && names.length) this.show(this.select.value);
    else if (this.current != null && !ready.has(this.current) && !this.busy) {
      this.panel.replaceChildren(el("p", { class: "muted" }, `${this.current} is not ready`));
      this.current = null;
    }
  }

  show(name) {
    this.current = name;
    const kind = this.kinds.get(name);
    this.panel.dataset.kind = kind;
    const build = { chat, embedding, image, detector, infer }[kind] || infer;
    this.panel.replaceChildren(...build(name, this));
  }
}

const field = (label, input) => el("label", {}, label, " ", input);
const number = (id, value, attrs = {}) =>
  el("input", { type: "number", id, value, step: "any", ...attrs });

// ------------------------------------------------------------------ chat (LLM)

function chat(model, owner) {
  const messages = [];
  const log = el("div", { id: "chat-log", class: "log" });
  const input = el("textarea", { id: "chat-input", rows: 2, placeholder: "Say something" },
    "And God said");
  const schema = el("textarea", { id: "chat-schema", rows: 3,
    placeholder: 'Structured output: a JSON schema, e.g. {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}. Empty: free text.' });
  const status = el("div", { id: "chat-status", class: "muted" }, "idle");
  const settings = {
    temperature: number("chat-temperature", 0.8, { min: 0, max: 2 }),
    top_p: number("chat-top-p", 1, { min: 0, max: 1 }),
    top_k: number("chat-top-k", -1, { step: 1 }),
    max_tokens: number("chat-max-tokens", 128, { min: 1, step: 1 }),
    seed: number("chat-seed", "", { step: 1 }),
  };
  const ignoreEos = el("input", { type: "checkbox", id: "chat-ignore-eos" });
  const send = el("button", { id: "chat-send" }, "send");
  const stop = el("button", { id: "chat-stop", disabled: true }, "stop");
  const clear = el("button", { id: "chat-clear" }, "clear");
  let controller = null;

  send.addEventListener("click", async () => {
    const body = { model, messages: [...messages, { role: "user", content: input.value }],
      stream: true };
    for (const [key, box] of Object.entries(settings)) {
      if (box.value !== "") body[key] = Number(box.value);
    }
    if (ignoreEos.checked) body.ignore_eos = true;
    if (schema.value.trim()) {
      try {
        body.response_format = { type: "json_schema",
          json_schema: { name: "console", schema: JSON.parse(schema.value) } };
      } catch (e) {
        status.textContent = `schema is not JSON: ${e.message}`;
        return;
      }
    }
    messages.push(body.messages[body.messages.length - 1]);
    log.append(el("div", { class: "msg user" }, input.value));
    const answer = el("div", { class: "msg assistant", id: "chat-answer" });
    log.querySelectorAll("#chat-answer").forEach((n) => n.removeAttribute("id"));
    log.append(answer);
    input.value = "";
    controller = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    owner.busy = true;
    const started = performance.now();
    let tokens = 0, first = null, finish = null;
    try {
      const r = await fetch("/v1/chat/completions", { method: "POST", signal: controller.signal,
        headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
      if (!r.ok) throw new Error(await failure(r));
      status.textContent = "streaming…";
      for await (const event of sse(r)) {
        if (event.error) throw new Error(event.error.message);
        const choice = event.choices?.[0];
        const text = choice?.delta?.content;
        if (text) {
          first ??= performance.now() - started;
          tokens += 1;
          answer.append(text);
          status.textContent = `streaming… ${tokens} chunks, first after ${fmt(first)} ms`;
        }
        if (choice?.finish_reason) finish = choice.finish_reason;
      }
      messages.push({ role: "assistant", content: answer.textContent });
      status.textContent = `done (${finish}): ${tokens} chunks, first after ${fmt(first)} ms`;
    } catch (e) {
      messages.pop();
      if (e.name === "AbortError") status.textContent = `stopped after ${tokens} chunks`;
      else status.textContent = `error ${e.message}`;
      answer.classList.add(e.name === "AbortError" ? "stopped" : "error");
    } finally {
      send.disabled = false;
      stop.disabled = true;
      owner.busy = false;
      controller = null;
    }
  });
  // Aborting the fetch closes the connection: the server aborts the request and frees its KV.
  stop.addEventListener("click", () => controller?.abort());
  clear.addEventListener("click", () => {
    messages.length = 0;
    log.replaceChildren();
  });
  return [
    log,
    el("div", { class: "row" }, input, send, stop, clear),
    el("div", { class: "row settings" },
      ...Object.entries(settings).map(([k, box]) => field(k, box)),
      field("ignore_eos", ignoreEos)),
    schema,
    status,
  ];
}

// The events of a server-sent-event stream, parsed, until `data: [DONE]`.
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ------------------------------------------------------------------ v2 infer (any model)

function infer(model) {
  const form = el("div", { id: "infer-form" }, el("p", { class: "muted" }, "loading metadata…"));
  const out = el("pre", { id: "infer-output", class: "output" });
  (async () => {
    const [meta, config] = await Promise.all(
      [`/v2/models/${model}`, `/v2/models/${model}/config`].map(async (url) => {
        const r = await fetch(url);
        if (!r.ok) throw new Error(await failure(r));
        return r.json();
      }));
    const optional = new Set((config.input || []).filter((t) => t.optional).map((t) => t.name));
    const rows = meta.inputs.map((t) => {
      const shape = t.shape.map((d) => (d < 0 ? 1 : d));
      const count = shape.reduce((a, b) => a * b, 1);
      const sample = t.datatype === "BYTES" ? Array(count).fill("hello")
        : t.datatype === "BOOL" ? Array(count).fill(false) : Array(count).fill(0);
      return {
        tensor: t,
        shape: el("input", { class: "shape", "data-input": t.name, value: JSON.stringify(shape) }),
        data: el("textarea", { class: "data", "data-input": t.name, rows: 2 },
          optional.has(t.name) ? "" : JSON.stringify(sample)),
      };
    });
    const run = el("button", { id: "infer-run" }, "infer");
    run.addEventListener("click", async () => {
      out.textContent = "…";
      try {
        const inputs = [];
        for (const row of rows) {
          if (!row.data.value.trim()) continue; // an optional input left out
          inputs.push({ name: row.tensor.name, datatype: row.tensor.datatype,
            shape: JSON.parse(row.shape.value), data: JSON.parse(row.data.value) });
        }
        const answer = await postJSON(`/v2/models/${model}/infer`, { inputs });
        out.textContent = answer.outputs.map((o) =>
          `${o.name} ${o.datatype} ${JSON.stringify(o.shape)}\n${preview(o.data)}`).join("\n\n");
      } catch (e) {
        out.textContent = e.message;
      }
    });
    form.replaceChildren(
      el("table", {}, el("tr", {}, el("th", {}, "input"), el("th", {}, "datatype"),
        el("th", {}, "shape"), el("th", {}, "data (JSON, flat or nested)")),
      ...rows.map((r) => el("tr", {},
        el("td", {}, r.tensor.name, optional.has(r.tensor.name) ? " (optional)" : ""),
        el("td", {}, r.tensor.datatype), el("td", {}, r.shape), el("td", {}, r.data)))),
      el("p", { class: "muted" }, "outputs: ",
        meta.outputs.map((t) => `${t.name} ${t.datatype} ${JSON.stringify(t.shape)}`).join(", ")),
      run);
  })().catch((e) => form.replaceChildren(el("p", { class: "error" }, e.message)));
  return [form, out];
}

function preview(data) {
  const flat = Array.isArray(data) ? data.flat(Infinity) : [data];
  const shown = flat.slice(0, 32).map((x) => (typeof x === "number" ? fmt(x, 4) : JSON.stringify(x)));
  return `[${shown.join(", ")}${flat.length > 32 ? `, … ${flat.length - 32} more` : ""}]`;
}

// ------------------------------------------------------------------ embeddings

function embedding(model) {
  const text = el("textarea", { id: "embed-text", rows: 4 },
    "A cat sat on the mat.\nA kitten rested on the rug.\nThe stock market fell sharply today.");
  const run = el("button", { id: "embed-run" }, "compare");
  const out = el("div", { id: "embed-output" });
  run.addEventListener("click", async () => {
    const lines = text.value.split("\n").map((s) => s.trim()).filter(Boolean);
    out.textContent = "…";
    try {
      const answer = await postJSON(`/v2/models/${model}/infer`, {
        inputs: [{ name: "text", datatype: "BYTES", shape: [lines.length, 1], data: lines }] });
      const o = answer.outputs[0];
      const dim = o.shape[1];
      const flat = o.data.flat(Infinity);
      const vectors = lines.map((_, i) => flat.slice(i * dim, (i + 1) * dim));
      const norm = (v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0));
      const cos = (a, b) => a.reduce((s, x, i) => s + x * b[i], 0) / (norm(a) * norm(b));
      out.replaceChildren(el("p", { class: "muted" }, `cosine similarity of ${dim}-d embeddings`),
        el("table", { class: "matrix" },
          el("tr", {}, el("th", {}), ...lines.map((_, j) => el("th", {}, `#${j + 1}`))),
          ...lines.map((line, i) => el("tr", {}, el("th", { title: line }, `#${i + 1} ${line}`),
            ...vectors.map((v, j) => {
              const c = cos(vectors[i], v);
              return el("td", { "data-cos": c, style: `background: rgba(43,108,176,${Math.max(c, 0) * 0.6})` }, fmt(c));
            })))));
    } catch (e) {
      out.textContent = e.message;
    }
  });
  return [el("p", { class: "muted" }, "One sentence a line."), text, run, out];
}

// ------------------------------------------------------------------ image generation

function image(model) {
  const prompt = el("select", { id: "image-prompt" },
    ...[..."0123456789"].map((d) => el("option", { value: d }, d)),
    el("option", { value: "none" }, "any digit"));
  const guidance = number("image-guidance", 3, { min: 0 });
  const steps = number("image-steps", 30, { min: 1, max: 1000, step: 1 });
  const seed = number("image-seed", "", { step: 1 });
  const n = number("image-n", 4, { min: 1, max: 16, step: 1 });
  const run = el("button", { id: "image-run" }, "generate");
  const out = el("div", { id: "image-output", class: "images" });
  run.addEventListener("click", async () => {
    out.textContent = "…";
    const body = { model, prompt: prompt.value, n: Number(n.value),
      guidance_scale: Number(guidance.value), steps: Number(steps.value) };
    if (seed.value !== "") body.seed = Number(seed.value);
    try {
      const r = await fetch("/v1/images/generations", { method: "POST",
        headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
      if (!r.ok) throw new Error(await failure(r));
      const text = await r.text();
      // seeds are 64-bit: read them from the text, a JS number would round them
      const seeds = [...text.matchAll(/"seed":\s*(-?\d+)/g)].map((m) => m[1]);
      out.replaceChildren(...JSON.parse(text).data.map((d, i) =>
        el("figure", {}, el("img", { src: `data:image/png;base64,${d.b64_json}`, class: "pixelated" }),
          el("figcaption", { "data-seed": seeds[i] }, `seed ${seeds[i]}`))));
    } catch (e) {
      out.textContent = e.message;
    }
  });
  return [el("div", { class: "row settings" }, field("digit", prompt), field("guidance", guidance),
    field("steps", steps), field("seed", seed), field("n", n), run), out];
}

// ------------------------------------------------------------------ detector

function detector(model) {
  const file = el("input", { type: "file", id: "det-file", accept: "image/*" });
  const threshold = number("det-threshold", 0.3, { min: 0, max: 1 });
  const canvas = el("canvas", { id: "det-canvas", width: 0, height: 0 });
  const status = el("div", { id: "det-status", class: "muted" }, "upload an image");
  const list = el("table", { id: "det-list" });
  let bitmap = null;
  const run = async () => {
    if (!bitmap) return;
    status.textContent = "…";
    const { width: w, height: h } = bitmap;
    const scratch = new OffscreenCanvas(w, h).getContext("2d");
    scratch.drawImage(bitmap, 0, 0);
    const rgba = scratch.getImageData(0, 0, w, h).data;
    const grey = new Uint8Array(w * h); // the detector reads grey digits: C = 1
    for (let i = 0; i < w * h; i++) {
      grey[i] = Math.round(0.299 * rgba[4 * i] + 0.587 * rgba[4 * i + 1] + 0.114 * rgba[4 * i + 2]);
    }
    try {
      const answer = await binaryInfer(model, grey, [1, h, w, 1], Number(threshold.value));
      const get = (name) => answer.outputs.find((o) => o.name === name).data.flat(Infinity);
      const count = get("num_detections")[0];
      const boxes = get("boxes"), scores = get("scores"), classes = get("classes");
      const found = [...Array(count).keys()].map((i) => ({
        box: boxes.slice(4 * i, 4 * i + 4), score: scores[i], cls: classes[i] }));
      draw(canvas, bitmap, found);
      status.textContent = `${count} detection${count === 1 ? "" : "s"} in ${w}×${h}`;
      list.replaceChildren(el("tr", {}, ...["class", "score", "x1", "y1", "x2", "y2"].map((x) =>
        el("th", {}, x))), ...found.map((d) => el("tr", { class: "detection",
        "data-class": d.cls, "data-score": d.score, "data-box": d.box.join(",") },
      el("td", {}, d.cls), el("td", {}, fmt(d.score)), ...d.box.map((v) => el("td", {}, fmt(v, 4))))));
    } catch (e) {
      status.textContent = e.message;
    }
  };
  file.addEventListener("change", async () => {
    if (!file.files.length) return;
    bitmap = await createImageBitmap(file.files[0]);
    await run();
  });
  threshold.addEventListener("change", run);
  return [el("div", { class: "row settings" }, file, field("score threshold", threshold)),
    status, el("div", { class: "row" }, canvas, list)];
}

// The v2 binary tensor extension: the JSON header, then the image's raw bytes.
async function binaryInfer(model, pixels, shape, threshold) {
  const header = new TextEncoder().encode(JSON.stringify({
    inputs: [
      { name: "image", datatype: "UINT8", shape, parameters: { binary_data_size: pixels.length } },
      { name: "score_threshold", datatype: "FP32", shape: [1, 1], data: [threshold] },
    ],
  }));
  const body = new Uint8Array(header.length + pixels.length);
  body.set(header);
  body.set(pixels, header.length);
  const r = await fetch(`/v2/models/${model}/infer`, { method: "POST", body,
    headers: { "content-type": "application/octet-stream",
      "inference-header-content-length": String(header.length) } });
  if (!r.ok) throw new Error(await failure(r));
  return r.json();
}

function draw(canvas, bitmap, found) {
  const scale = Math.min(512 / Math.max(bitmap.width, bitmap.height), 4);
  canvas.width = Math.round(bitmap.width * scale);
  canvas.height = Math.round(bitmap.height * scale);
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  ctx.lineWidth = 2;
  ctx.font = "bold 14px sans-serif";
  for (const { box: [x1, y1, x2, y2], score, cls } of found) {
    ctx.strokeStyle = ctx.fillStyle = "#e53e3e";
    ctx.strokeRect(x1 * scale, y1 * scale, (x2 - x1) * scale, (y2 - y1) * scale);
    ctx.fillText(`${cls} ${fmt(score, 2)}`, x1 * scale + 2, Math.max(y1 * scale - 4, 12));
  }
}
