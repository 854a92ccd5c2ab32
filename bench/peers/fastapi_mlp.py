"""A plain FastAPI endpoint serving the 2.1M-parameter MLP: the "Flask + model.predict" peer.

POST /predict {"x": [512 floats]} -> {"y": [512 floats]}, one row per request, no
batching, one uvicorn process: what a Python engineer writes before reaching for a
server. `--mode async` runs the forward on the event loop, `--mode sync` in FastAPI's
thread pool; the benchmark uses whichever is faster. The weights are seeded random:
speed does not depend on their values, and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

DIMS = (512, 1024, 1024, 512)


def build_mlp() -> torch.nn.Module:
    """512 -> 1024 -> 1024 -> 512 with ReLU between: 2.1M FP32 parameters."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(DIMS)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).eval()


class Row(BaseModel):
    x: list[float]


def make_app(mode: str) -> FastAPI:
    torch.set_num_threads(1)
    model = build_mlp()
    app = FastAPI()

    def forward(row: Row) -> dict:
        with torch.inference_mode():
            y = model(torch.tensor(row.x, dtype=torch.float32).unsqueeze(0))
        return {"y": y[0].tolist()}

    if mode == "async":

        @app.post("/predict")
        async def predict_async(row: Row) -> dict:
            return forward(row)

    else:

        @app.post("/predict")
        def predict_sync(row: Row) -> dict:
            return forward(row)

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
