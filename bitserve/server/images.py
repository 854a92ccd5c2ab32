"""`POST /v1/images/generations`, OpenAI's image API over a `diffusion` model, and the
diffusion engines' Prometheus metrics.

    {"model": "digits", "prompt": "seven", "n": 4, "response_format": "b64_json",
     "guidance_scale": 3.0, "steps": 30, "seed": 1, "eta": 0.0}
    -> {"created": ..., "data": [{"b64_json": <PNG>, "revised_prompt": "7", "seed": 1}, ...]}

`prompt` is a digit as a numeral or a word ("7", "seven"), or "none" for any digit;
image i of a request with `seed` uses seed + i. The images go straight into the
model's engine as rows (they join the step loop at its next step); a client that
disconnects cancels its rows, which leave at the next step. Errors use OpenAI's shape
and name the field: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve.api.jsonbody import json_object
from bitserve.backends.diffusion import defaults
from bitserve.diffusion.engine import DiffusionEngine
from bitserve.diffusion.params import GenerationParams, InvalidParams, parse_label
from bitserve.repository.version import ModelVersion
from bitserve.server.errors import handle
from bitserve.server.http import json_response, until_disconnect

if TYPE_CHECKING:
    from bitserve.server.state import ServerState as Server

MAX_IMAGES = 16  # n per request
NUMBER = (int, float)
OPTIONS = (("guidance_scale", NUMBER), ("steps", int), ("seed", int), ("eta", NUMBER))


@dataclass
class ImagesRequest:
    model: str
    prompt: str
    label: int | None
    n: int
    options: dict[str, Any]  # guidance_scale, steps, seed, eta as given


def parse_request(body: bytes) -> ImagesRequest:
    doc = json_object(body)
    if not isinstance(doc.get("model"), str):
        raise InvalidParams("field 'model' must be a string")
    n = doc.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_IMAGES:
        raise InvalidParams(f"field 'n': {n!r} is outside 1..{MAX_IMAGES}")
    if doc.get("response_format", "b64_json") not in ("b64_json", None):
        raise InvalidParams(
            f"field 'response_format': {doc['response_format']!r}; only 'b64_json' (PNG) "
            "is served (no image URLs)"
        )
    options = {}
    for name, kind in OPTIONS:
        if doc.get(name) is not None:
            options[name] = _typed(doc[name], name, kind)
    label = parse_label(doc.get("prompt"))
    return ImagesRequest(doc["model"], doc["prompt"], label, n, options)


def _typed(value: Any, name: str, kind: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidParams(f"field '{name}' must be a {'integer' if kind is int else 'number'}")
    return value


def image_params(req: ImagesRequest, defaults: dict, engine: DiffusionEngine) -> list:
    """One GenerationParams per image, checked against the model (InvalidParams)."""
    fields = {**defaults, **req.options}
    seed = fields.pop("seed", None)
    base = random.getrandbits(62) if seed is None else seed
    config = engine.model.config
    return [
        GenerationParams(label=req.label, seed=base + i, **fields).check(
            config.classes, engine.schedule.steps
        )
        for i in range(req.n)
    ]


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image, mode="L").save(out, format="PNG")
    return out.getvalue()


class Images:
    def __init__(self, server: Server):
        self.server = server

    async def generations(self, request: Request) -> Response:
        req = parse_request(await request.body())
        version, steps = await self._images(req.model)
        params = image_params(req, defaults(version.config), steps.engine)
        ticket = steps.diffuse(params)  # no await since the lookup: drain-safe
        images = await until_disconnect(request, ticket.result, lambda: ticket.cancel(None))
        pixels = await asyncio.to_thread(lambda: [png(a) for a in images["image"]])
        data = [
            {
                "b64_json": base64.b64encode(p).decode(),
                "revised_prompt": _revised(req),
                "seed": q.seed,
            }
            for p, q in zip(pixels, params, strict=True)
        ]
        version.m["success"].inc()
        return json_response({"created": int(time.time()), "data": data})

    async def _images(self, name: str) -> tuple[ModelVersion, Any]:
        """The version and its step loop's path (NotSupported: 400, param "model")."""
        await self.server.repository.ensure_loaded(name)
        version = self.server.serving(name)
        return version, version.serving("images")


def _revised(req: ImagesRequest) -> str:
    return "any digit" if req.label is None else str(req.label)


def routes(server: Server) -> list[Route]:
    """The image route, and the engines' metrics on the server's registry."""
    server.metrics.add_collector(functools.partial(collect, server))
    images = Images(server)
    generations = handle(images.generations, "openai")
    return [Route("/v1/images/generations", generations, methods=["POST"])]


# ------------------------------------------------------------------------ metrics


def engines(server: Server) -> Iterator[tuple[list[str], DiffusionEngine]]:
    for name, entry in sorted(server.repository.models.items()):
        for number, version in sorted(entry.versions.items()):
            if version.serves("images") and (engine := version.path.engine) is not None:
                yield [name, str(number)], engine


def collect(server: Server) -> Iterator[Metric]:
    """Scrape-time metrics read from the engines' counters: nothing on the step path."""
    mv = ["model", "version"]
    families = {
        "steps": CounterMetricFamily(
            "bitserve_diffusion_steps", "Denoising steps run (one batched forward each).", labels=mv
        ),
        "seconds": CounterMetricFamily(
            "bitserve_diffusion_step_seconds",
            "Time spent in denoising steps; steps / step_seconds = steps per second.",
            labels=mv,
        ),
        "images": CounterMetricFamily("bitserve_diffusion_images", "Images finished.", labels=mv),
        "cancelled": CounterMetricFamily(
            "bitserve_diffusion_cancelled", "Images cancelled (client gone).", labels=mv
        ),
        "uncond": CounterMetricFamily(
            "bitserve_diffusion_uncond_passes",
            "Unconditional halves run for guided rows (batched with the conditional).",
            labels=mv,
        ),
        "rate": GaugeMetricFamily(
            "bitserve_diffusion_steps_per_second", "Steps per busy second.", labels=mv
        ),
        "running": GaugeMetricFamily(
            "bitserve_diffusion_running_rows", "Images in the step loop.", labels=mv
        ),
        "waiting": GaugeMetricFamily(
            "bitserve_diffusion_waiting_rows", "Images waiting to join a step.", labels=mv
        ),
        "rows": HistogramMetricFamily(
            "bitserve_diffusion_rows_per_step", "Images in each denoising step.", labels=mv
        ),
        "queue": HistogramMetricFamily(
            "bitserve_diffusion_queue_seconds",
            "Time from submission to an image's first step.",
            labels=mv,
        ),
    }
    for labels, engine in engines(server):
        s = engine.stats
        families["steps"].add_metric(labels, s.steps)
        families["seconds"].add_metric(labels, s.step_seconds)
        families["images"].add_metric(labels, s.images)
        families["cancelled"].add_metric(labels, s.cancelled)
        families["uncond"].add_metric(labels, s.uncond_rows)
        families["rate"].add_metric(labels, s.steps_per_second)
        families["running"].add_metric(labels, len(engine.running))
        families["waiting"].add_metric(labels, len(engine.waiting))
        for key, hist in (("rows", s.rows), ("queue", s.queue)):
            buckets = [(str(b), c) for b, c in zip(hist.bounds, hist.counts, strict=True)]
            buckets.append(("+Inf", hist.count))
            families[key].add_metric(labels, buckets, hist.total)
    yield from families.values()
