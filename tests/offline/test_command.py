"""`bitserve batch` end to end: the online server's answers, error records, plain rows."""

from __future__ import annotations

import csv
import json

import httpx
import jsonschema
import numpy as np
import pytest

from tests.conftest import Server
from tests.offline.conftest import key, openai_line, read_output, run_batch

PROMPTS = ["the quick brown fox", "a b c", "hello there, how", "blocks and pages", "x"]


def good_lines() -> list[tuple[str, str, dict]]:
    lines = []
    for i, prompt in enumerate(PROMPTS * 4):
        body = {"model": "chat", "prompt": prompt, "max_tokens": 12 + i % 5, "temperature": 0}
        lines.append((f"cmp-{i}", "/v1/completions", body))
    for i, text in enumerate(PROMPTS):
        messages = [{"role": "user", "content": text}]
        body = {"model": "chat", "messages": messages, "max_tokens": 10, "temperature": 0}
        lines.append((f"chat-{i}", "/v1/chat/completions", body))
    for i, prompt in enumerate(PROMPTS[:3]):  # structured outputs ride in batch files too
        fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}
        body = {"model": "chat", "prompt": prompt, "max_tokens": 40, "response_format": fmt}
        lines.append((f"json-{i}", "/v1/completions", {**body, "temperature": 0}))
        choice = {"model": "chat", "prompt": prompt, "guided_choice": ["yes", "no"]}
        lines.append((f"choice-{i}", "/v1/completions", {**choice, "temperature": 0}))
    lines.append(("emb-0", "/v1/embeddings", {"model": "minilm", "input": PROMPTS}))
    lines.append(("emb-1", "/v1/embeddings", {"model": "minilm", "input": "one sentence"}))
    return lines


VERDICT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "wild"]}},
    "required": ["ok", "mood"],
    "additionalProperties": False,
}
BAD = [
    "{not json",
    openai_line("unknown", "/v1/completions", {"model": "nope", "prompt": "hi"}),
    openai_line("long", "/v1/completions", {"model": "chat", "prompt": "a b " * 200}),
    openai_line("badurl", "/v1/images", {"model": "chat"}),
    openai_line("badbody", "/v1/completions", {"model": "chat", "prompt": "x", "n": 99}),
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
    openai_line("cmp-0", "/v1/completions", {"model": "chat", "prompt": "again"}),
]
BAD_CODES = {
    "line:1": "invalid_json",
    "unknown": "model_not_found",
    "long": "context_length_exceeded",
    "badurl": "invalid_request",
    "badbody": "invalid_request_error",
}


@pytest.fixture(scope="module")
def online(batch_repo):
    server = Server(batch_repo)
    yield server
    server.stop()


def strip(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_output_equals_online_server_and_bad_lines_become_errors(batch_repo, online, tmp_path):
    good = good_lines()
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([BAD[0], *(openai_line(*g) for g in good), *BAD[1:]]) + "\n")
    out = tmp_path / "out.jsonl"
    summary = run_batch(batch_repo, inp, out)
    assert f"done {len(good)}, failed {len(BAD)}" in summary
    docs = read_output(out)
    by_key = {key(d): d for d in docs}
    assert len(docs) == len(by_key) == len(good) + len(BAD)
    for custom_id, url, body in good:
        answer = httpx.post(online.url + url, json=body, timeout=60).json()
        got = by_key[custom_id]
        assert got["error"] is None and got["response"]["status_code"] == 200
        if url.endswith("embeddings"):
            for a, b in zip(answer["data"], got["response"]["body"]["data"], strict=True):
                np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)
            assert answer["usage"] == got["response"]["body"]["usage"]
        else:
            assert strip(got["response"]["body"]) == strip(answer), custom_id
        if custom_id.startswith("json-"):
            jsonschema.validate(json.loads(answer["choices"][0]["text"]), VERDICT)
        if custom_id.startswith("choice-"):
            assert answer["choices"][0]["text"] in ("yes", "no")
    no_id = f"line:{len(good) + 6}"  # the line without a custom_id: keyed by its number
    for name, code in {**BAD_CODES, no_id: "invalid_request"}.items():
        error = by_key[name]["error"]
        assert error["code"] == code and error["message"], (name, error)
    duplicate = [d for d in docs if d["error"] and d["error"]["code"] == "duplicate_custom_id"]
    assert len(duplicate) == 1 and duplicate[0]["custom_id"] is None


def test_plain_rows_csv_and_parquet(batch_repo, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "vec": [i, i + 0.5], "name": f"n{i}"} for i in range(40)]
    csv_path = tmp_path / "rows.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["id", "vec", "name"])
        writer.writeheader()
        writer.writerows({**r, "vec": json.dumps(r["vec"])} for r in rows)
        writer.writerow({"id": "bad", "vec": "[1, 2, 3]", "name": "too long"})
    parquet_path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet_path)
    args = ("--model", "double", "--map", "x=vec", "--map", "label=name", "--id-column", "id")
    for path in (csv_path, parquet_path):
        out = tmp_path / (path.name + ".out.jsonl")
        run_batch(batch_repo, path, out, *args)
        docs = {d["custom_id"]: d for d in read_output(out)}
        for r in rows:
            body = docs[r["id"]]["response"]["body"]
            assert body["model_name"] == "double"
            assert body["outputs"][0]["data"] == [2 * v for v in r["vec"]]
        if path.suffix == ".csv":
            assert "does not match" in docs["bad"]["error"]["message"]


async def test_an_answer_that_cannot_be_kept_fails_the_run() -> None:
    """If taking an answer raises (e.g. it cannot be serialised), run_records raises
    instead of dropping that record while the run goes on to be marked complete."""
    import asyncio

    from bitserve.offline.executor import Work
    from bitserve.offline.pipeline import run_records
    from bitserve.offline.records import Record

    class Echo:
        def prepare(self, record):
            async def run():
                return {"custom_id": record.raw}

            return Work(record.raw, record.line, 1, run)

        async def run(self, work):
            return await work.run()

    def on_answer(doc):
        if doc["custom_id"] == "b":
            raise TypeError("not serialisable")

    records = [Record(i, raw) for i, raw in enumerate("abc")]
    with pytest.raises(TypeError, match="not serialisable"):
        await run_records(Echo(), records, on_answer, asyncio.Semaphore(2))
