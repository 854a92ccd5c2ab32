"""Token timing from an OpenAI server-sent-event stream, and the record of one request.

vLLM's definitions: TTFT is the time from sending to the first chunk that carries text;
each later text chunk adds one inter-token latency (the gap since the previous one); the
output length is `usage.completion_tokens` when the server reports it (we ask for it
with `stream_options.include_usage`), else the number of text chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson


@dataclass
class Result:
    """One request as the client saw it. Times are seconds; `start` is perf_counter."""

    start: float
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    error: str | None = None  # kind: http_503, timeout, connection, stream_error, ...

    @property
    def ok(self) -> bool:
        return self.error is None


class StreamReader:
    """Fed body pieces as they arrive; splits SSE events and times the ones with text."""

    def __init__(self, start: float) -> None:
        self.start, self.last = start, 0.0
        self.buf = b""
        self.ttft, self.itl, self.chunks = 0.0, [], 0
        self.usage: dict | None = None
        self.error: str | None = None

    def feed(self, piece: bytes, now: float) -> None:
        self.buf += piece
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                return
            event, self.buf = self.buf[:end], self.buf[end + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip(), now)

    def _data(self, data: bytes, now: float) -> None:
        if data == b"[DONE]" or not data:
            return
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.error = "stream_error"
            return
        if "error" in doc:
            self.error = "stream_error"
            return
        if doc.get("usage"):
            self.usage = doc["usage"]
        if any(_text(c) for c in doc.get("choices") or ()):
            self._token(now)

    def _token(self, now: float) -> None:
        if self.chunks == 0:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def finish(self, result: Result) -> None:
        """Fill `result` (already holding latency and the client's prompt length)."""
        result.ttft, result.itl = self.ttft, self.itl
        result.output_len = self.chunks
        if self.usage:
            result.output_len = self.usage.get("completion_tokens") or self.chunks
            result.prompt_len = self.usage.get("prompt_tokens") or result.prompt_len
        if self.error:
            result.error = self.error
        elif self.chunks == 0:
            result.error = "no_tokens"


def _text(choice: dict) -> str:
    """Text of a completions (`text`) or chat (`delta.content`) stream choice."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


def read_full(result: Result, body: bytes) -> None:
    """A non-streamed response: TTFT is the whole latency (vLLM's rule); OpenAI bodies
    give their usage."""
    result.ttft = result.latency
    if b'"usage"' not in body:  # v2 bodies: not parsed, the client stays cheap
        return
    try:
        usage = orjson.loads(body).get("usage") or {}
    except orjson.JSONDecodeError:
        return
    if isinstance(usage, dict) and usage:
        result.output_len = usage.get("completion_tokens") or result.output_len
        result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
