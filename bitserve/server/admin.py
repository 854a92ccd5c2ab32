"""The repository extension (`/v2/repository/...`), behind an admin token.

Loading a model is running its code, so these endpoints are off unless the server was
started with `--admin-token` (or BITSERVE_ADMIN_TOKEN); then every call needs
`Authorization: Bearer <token>` (401 without it). In `--model-control none` load and
unload are refused (403), as in Triton; `explicit` and `poll` allow them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve.backends.base import LoadError
from bitserve.inference import InvalidRequest
from bitserve.server.errors import handle
from bitserve.server.http import json_response
from bitserve.server.state import ServerState


def routes(state: ServerState) -> list[Route]:
    return Admin(state).routes()


class Admin:
    def __init__(self, state: ServerState):
        self.server = state

    def routes(self) -> list[Route]:
        return [
            Route("/v2/repository/index", self._guard(self.index), methods=["POST", "GET"]),
            Route("/v2/repository/models/{model}/load", self._guard(self.load), methods=["POST"]),
            Route(
                "/v2/repository/models/{model}/unload", self._guard(self.unload), methods=["POST"]
            ),
            *self._traffic_routes(),
        ]

    # ------------------------------------------------- traffic (bitserve/rollout)

    def _traffic_routes(self) -> list[Route]:
        """GET the policy; PUT replaces it, PATCH merges fields into it, DELETE removes it
        (until the model reloads); POST promote or rollback. Changing traffic runs no new
        code, so any model-control mode allows it."""
        base = "/v2/repository/models/{model}/traffic"
        return [
            Route(base, self._guard(self.traffic), methods=["GET", "PUT", "PATCH", "DELETE"]),
            Route(base + "/promote", self._guard(self.promote), methods=["POST"]),
            Route(base + "/rollback", self._guard(self.rollback), methods=["POST"]),
        ]

    async def traffic(self, request: Request) -> Response:
        from bitserve.rollout import policy

        entry = self.server.repository.entry(request.path_params["model"])
        if entry.config is None:
            raise InvalidRequest(f"model '{entry.name}' has no valid config: {entry.error}")
        current = self._rollout(entry, required=False)
        if request.method == "DELETE":
            self.server.rollout.clear(entry)
            return json_response(None)
        if request.method != "GET":
            base = current.policy if current and request.method == "PATCH" else None
            try:
                doc = orjson.loads(await request.body())
                traffic = policy.parse(doc, sorted(entry.versions), base)
            except (orjson.JSONDecodeError, policy.PolicyError) as e:
                raise InvalidRequest(f"traffic policy: {e}") from None
            current = self.server.rollout.set(entry, traffic, "set", "admin API")
        return json_response(current.policy.model_dump(mode="json") if current else None)

    async def promote(self, request: Request) -> Response:
        return await self._change(request, "promote")

    async def rollback(self, request: Request) -> Response:
        return await self._change(request, "rollback")

    async def _change(self, request: Request, action: str) -> Response:
        from bitserve.rollout import policy

        entry = self.server.repository.entry(request.path_params["model"])
        rollout = self._rollout(entry, required=True)
        change = policy.promote if action == "promote" else policy.rollback
        try:
            traffic = change(rollout.policy)
        except policy.PolicyError as e:
            raise InvalidRequest(str(e)) from None
        self.server.rollout.set(entry, traffic, action, "by hand (admin API)")
        return json_response(traffic.model_dump(mode="json"))

    def _rollout(self, entry: Any, required: bool) -> Any:
        rollout = self.server.rollout.get(entry)
        if rollout is None and required:
            raise InvalidRequest(f"model '{entry.name}' has no traffic policy")
        return rollout

    def _guard(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """The admin token first, then the handler; errors map as everywhere else."""

        async def guarded(request: Request) -> Response:
            self.server.authorize(request.headers.get("authorization", ""))
            try:
                return await handler(request)
            except LoadError as e:
                raise InvalidRequest(f"failed to load: {e}") from None

        return handle(guarded)

    async def index(self, request: Request) -> Response:
        return json_response(self.server.repository.index())

    async def load(self, request: Request) -> Response:
        self.server.allow_changes()
        body = await request.body()
        try:
            params = (orjson.loads(body) if body.strip() else {}).get("parameters") or {}
        except (orjson.JSONDecodeError, AttributeError):
            raise InvalidRequest("load body must be a JSON object") from None
        if params:
            raise InvalidRequest(
                f"load parameters {sorted(params)} are not supported: edit config.toml and "
                "the version folders, then load"
            )
        await self.server.repository.load_model(request.path_params["model"])
        return Response(status_code=200)

    async def unload(self, request: Request) -> Response:
        self.server.allow_changes()
        await self.server.repository.unload_model(request.path_params["model"])
        return Response(status_code=200)
