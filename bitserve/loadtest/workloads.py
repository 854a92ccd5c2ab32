"""What a benchmark sends: request bodies for the v2 protocol and the OpenAI API.

Every body is built and encoded before the clock starts, so the load generator only
writes bytes. Prompt lengths are counted in words from a small vocabulary of short
common words (one token each in most BPE vocabularies); when the server reports
`usage.prompt_tokens`, that count replaces the client's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from bitserve.loadtest.client import build_request

_TEXT = (
    "the of and to in is it that for on was with as at by be this are or from had not but "
    "what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get"
)
WORDS = _TEXT.split()  # short common words: about one token each


@dataclass
class Request:
    """One pre-built HTTP request and what the client knows about its size."""

    raw: bytes
    stream: bool = False
    prompt_len: int = 0  # input tokens as counted by the client (words)
    output_len: int = 0  # max_tokens asked for; 0 for v2


@dataclass
class Lengths:
    """Prompt/output lengths: `fixed`, or `random` uniform in len*(1 -/+ range_ratio)."""

    input_len: int = 128
    output_len: int = 128
    dist: str = "random"
    range_ratio: float = 0.5

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self.dist == "fixed":
            return np.full(n, self.input_len), np.full(n, self.output_len)
        return self._uniform(self.input_len, n, rng), self._uniform(self.output_len, n, rng)

    def _uniform(self, center: int, n: int, rng: np.random.Generator) -> np.ndarray:
        lo = max(1, int(center * (1 - self.range_ratio)))
        hi = max(lo, int(center * (1 + self.range_ratio)))
        return rng.integers(lo, hi + 1, size=n)


def words(n: int, rng: np.random.Generator) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


# ---------------------------------------------------------------- v2


def v2_data(datatype: str, count: int, rng: np.random.Generator) -> list:
    """Random values of a v2 datatype, as JSON-ready Python values."""
    if datatype.startswith("FP") or datatype == "BF16":
        return [round(float(v), 5) for v in rng.standard_normal(count)]
    if datatype.startswith(("INT", "UINT")):
        return [int(v) for v in rng.integers(0, 100, size=count)]
    if datatype == "BOOL":
        return [bool(v) for v in rng.integers(0, 2, size=count)]
    if datatype == "BYTES":
        return [words(int(rng.integers(5, 15)), rng) for _ in range(count)]
    raise ValueError(f"cannot generate data for datatype {datatype}")


def v2_body(metadata: dict, rng: np.random.Generator, batch: int = 1, dim: int = 8) -> dict:
    """One infer request for the inputs in `GET /v2/models/M`: the batch dimension
    (-1 first) becomes `batch`, any other variable dimension becomes `dim`."""
    inputs = []
    for spec in metadata["inputs"]:
        shape = [int(d) for d in spec["shape"]]
        if shape and shape[0] == -1:
            shape[0] = batch
        shape = [dim if d < 0 else d for d in shape]
        count = int(np.prod(shape)) if shape else 1
        data = v2_data(spec["datatype"], count, rng)
        inputs.append(
            {"name": spec["name"], "shape": shape, "datatype": spec["datatype"], "data": data}
        )
    return {"inputs": inputs}


def v2_requests(
    host: str, model: str, metadata: dict, distinct: int = 64, seed: int = 0, batch: int = 1
) -> list[Request]:
    rng = np.random.default_rng(seed)
    path = f"/v2/models/{model}/infer"
    return [
        Request(build_request(host, path, orjson.dumps(v2_body(metadata, rng, batch))))
        for _ in range(distinct)
    ]


def jsonl_requests(host: str, path: str, file: Path) -> list[Request]:
    """Each non-empty line of `file` is a whole request body (e.g. a v2 infer request)."""
    lines = [line.strip() for line in file.read_bytes().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{file}: no requests")
    return [Request(build_request(host, path, line)) for line in lines]


# ---------------------------------------------------------------- OpenAI


@dataclass
class OpenAIOptions:
    """An OpenAI completions or chat workload (vLLM's `random` and `prefix` datasets)."""

    model: str
    api: str = "completions"  # or "chat"
    lengths: Lengths | None = None
    dataset: Path | None = None  # JSONL: {"prompt": str, "output_len": int}
    prefix_len: int = 0  # shared prefix words (prefix-caching workload)
    num_prefixes: int = 1
    ignore_eos: bool = False
    stream: bool = True


def openai_prompts(opts: OpenAIOptions, n: int, seed: int) -> list[tuple[str, int, int]]:
    """(prompt, prompt words, max_tokens) for n requests, from the dataset or lengths."""
    rng = np.random.default_rng(seed)
    if opts.dataset is not None:
        rows = [json.loads(line) for line in opts.dataset.read_text().splitlines() if line.strip()]
        default_out = opts.lengths.output_len if opts.lengths else 128
        picked = [rows[i % len(rows)] for i in range(n)]
        return [
            (r["prompt"], len(r["prompt"].split()), int(r.get("output_len", default_out)))
            for r in picked
        ]
    lengths = opts.lengths or Lengths()
    ins, outs = lengths.draw(n, rng)
    prefixes = [words(opts.prefix_len, rng) for _ in range(max(1, opts.num_prefixes))]
    out = []
    for i in range(n):
        body = words(int(ins[i]), rng)
        if opts.prefix_len:
            body = prefixes[i % len(prefixes)] + " " + body
        out.append((body, int(ins[i]) + opts.prefix_len, int(outs[i])))
    return out


def openai_body(opts: OpenAIOptions, prompt: str, max_tokens: int) -> dict:
    body: dict = {"model": opts.model, "max_tokens": max_tokens, "temperature": 0.0}
    if opts.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if opts.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


def openai_requests(host: str, opts: OpenAIOptions, n: int, seed: int = 0) -> list[Request]:
    path = "/v1/chat/completions" if opts.api == "chat" else "/v1/completions"
    return [
        Request(
            build_request(host, path, orjson.dumps(openai_body(opts, prompt, out))),
            stream=opts.stream,
            prompt_len=n_in,
            output_len=out,
        )
        for prompt, n_in, out in openai_prompts(opts, n, seed)
    ]
