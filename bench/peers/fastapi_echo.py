"""A plain FastAPI endpoint that echoes its input: the peer for bitserve's no-op model.

POST /predict {"x": [4 floats]} -> {"y": [4 floats]}. With no model work at all, the
comparison measures only what each server adds per request (HTTP, JSON, validation,
queueing). One uvicorn process, access log off, as one would deploy it.
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class Row(BaseModel):
    x: list[float]


def make_app(mode: str) -> FastAPI:
    app = FastAPI()

    if mode == "async":

        @app.post("/predict")
        async def echo_async(row: Row) -> dict:
            return {"y": row.x}

    else:

        @app.post("/predict")
        def echo_sync(row: Row) -> dict:
            return {"y": row.x}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    args = parser.parse_args()
    app = make_app(args.mode)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
