// Small DOM and HTTP helpers. Text from the server is only ever set as text, never as HTML.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value == null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value; // CSSOM: allowed by the page's CSP
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child == null) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export const $ = (selector, root = document) => root.querySelector(selector);

// The message of an error answer, in v2 ({"error": "..."}) or OpenAI ({"error": {...}}) shape.
export async function failure(response) {
  const text = await response.text();
  try {
    const doc = JSON.parse(text);
    const e = doc.error;
    return `${response.status}: ${typeof e === "string" ? e : e?.message ?? text}`;
  } catch {
    return `${response.status}: ${text || response.statusText}`;
  }
}

// POST JSON, answer parsed JSON or throw the server's message.
export async function postJSON(url, body, headers = {}) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", ...headers },
    body: JSON.stringify(body),
  });
  if (!response.ok) throw new Error(await failure(response));
  return response.json();
}

export const fmt = (x, digits = 3) =>
  x == null || Number.isNaN(x) ? "–" : String(Number(Number(x).toPrecision(digits)));
