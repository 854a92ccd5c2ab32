"""`/console`: the server's own web page, static files shipped in the package (console/).

The page reads only public APIs: the health probes, `/metrics` (parsed in the browser),
the v2 model routes and rollout report, the OpenAI routes for its playgrounds, and the
admin routes with the token a user types in. One JSON route is added here because no
public API lists every model with its state and failure reason without the admin token:

    GET /console/api/models  ->  {"admin": {"enabled", "model_control"},
                                  "models": [{"name", "version", "state", "reason",
                                              "backend", "kind", "rollout"}]}

`kind` picks the playground (chat, image, detector, embedding, infer). Reasons have
absolute paths cut to their last part, so the page shows no file system layout; the
admin token itself is never served, only whether one is set.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from bitserve.config import ModelConfig
from bitserve.repository.paths import tasks_of
from bitserve.server.http import error, json_response
from bitserve.server.state import ServerState

STATIC = Path(__file__).with_name("console")
# The page runs only its own scripts: no inline code, nothing from another origin.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_PATH = re.compile(r"(?<![\w:/.])(?:/[\w.+@-]+)+/([\w.+@-]+)")


def routes(state: ServerState) -> list[Route | Mount]:
    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=HEADERS)

    async def models(request: Request) -> Response:
        return json_response(summary(state))

    return [
        Route("/console", page),
        Route("/console/", page),
        Route("/console/api/models", models),
        Mount("/console/static", _Static(directory=STATIC), name="console"),
    ]


class _Static(StaticFiles):
    """Starlette's static files (it refuses paths outside the folder), with its 404 and 405
    answered here: the app has no exception middleware to turn them into responses."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except HTTPException as e:
            await error(e.status_code, f"{scope['path']}: {e.detail}")(scope, receive, send)


def summary(state: ServerState) -> dict:
    repository = state.repository
    rows = []
    for row in repository.index():
        entry = repository.models.get(row["name"])
        config = entry.config if entry is not None else None
        rows.append(
            {
                **row,
                "reason": scrub(row.get("reason", "")),
                "backend": config.backend if config else None,
                "kind": kind(config) if config else None,
                "rollout": entry is not None and state.rollout.get(entry) is not None,
            }
        )
    options = state.options
    admin = {"enabled": bool(options.admin_token), "model_control": options.model_control}
    return {"admin": admin, "models": rows}


def kind(config: ModelConfig) -> str:
    """Which playground fits a model: by the tasks its path serves, and a detector by its
    outputs (boxes, scores and classes), never by the backend's name."""
    tasks = tasks_of(config.backend)
    if "generate" in tasks:
        return "chat"
    if "images" in tasks:
        return "image"
    if "embed" in tasks and config.parameters.get("task", "embedding") == "embedding":
        return "embedding"
    if {"boxes", "scores", "classes"} <= {t.name for t in config.output}:
        return "detector"
    return "infer"


def scrub(text: str) -> str:
    """`text` with every absolute path cut to `…/last-part`."""
    return _PATH.sub(r"…/\1", text)
