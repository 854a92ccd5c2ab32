"""A deliberately slow server with known latencies, for `bitserve bench` tests.

v2: `GET /v2/models/slow` (metadata) and `POST /v2/models/slow/infer`, answered after
`--delay-ms`. OpenAI: `/v1/completions` and `/v1/chat/completions`, streamed: the first
token after `--prefill-ms`, then one every `--token-ms`, max_tokens in all, with usage.
Delays are asyncio sleeps, so concurrent requests do not queue behind each other and
every request should take what it was built to take. `--jitter-ms J` adds a seeded
uniform 0..J to each token's delay, so answers finish in a shuffled order, as a real
engine's do; `GET /prompts` lists every prompt received, in order of arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

META = {
    "name": "slow",
    "versions": ["1"],
    "platform": "python",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
}


def make_app(delay: float, prefill: float, step: float, jitter: float = 0.0) -> Starlette:
    prompts: list[str] = []
    rng = random.Random(0)

    async def metadata(request: Request) -> JSONResponse:
        return JSONResponse(META)

    async def infer(request: Request) -> JSONResponse:
        body = await request.json()
        await asyncio.sleep(delay)
        x = body["inputs"][0]
        return JSONResponse({"model_name": "slow", "outputs": [{**x, "name": "y"}]})

    async def generate(request: Request) -> StreamingResponse:
        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        n, p = body["max_tokens"], len(prompt.split())
        prompts.append(prompt)

        async def events():
            await asyncio.sleep(prefill)
            for i in range(n):
                if i:
                    await asyncio.sleep(step + rng.uniform(0.0, jitter))
                choice = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
                yield f"data: {json.dumps({'choices': [{'index': 0, **choice}]})}\n\n"
            usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def received(request: Request) -> JSONResponse:
        return JSONResponse(prompts)

    return Starlette(
        routes=[
            Route("/v2/models/slow", metadata),
            Route("/v2/models/slow/infer", infer, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/prompts", received),
            Route("/health", metadata),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--prefill-ms", type=float, default=40.0)
    parser.add_argument("--token-ms", type=float, default=10.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    args = parser.parse_args()
    ms = (args.delay_ms, args.prefill_ms, args.token_ms, args.jitter_ms)
    app = make_app(*(v / 1e3 for v in ms))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop")


if __name__ == "__main__":
    main()
