"""LoRA adapters over HTTP: vLLM's load/unload routes (behind the admin token), and an
adapter's name as the OpenAI API's `model` (bitserve/llm/lora.py serves them).

`POST /v1/load_lora_adapter {"lora_name", "lora_path", "model"?}` registers a PEFT folder
on the LLM model that has LoRA on (`max_loras` in its config.toml; `model` names it when
several have); `POST /v1/unload_lora_adapter {"lora_name"}` removes it, and a request
for it is then a 404, as for any unknown model. Adapter names share the models'
namespace: one cannot take a model's name. `/v1/models` lists each adapter with its
`parent`, the base model's name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from bitserve.inference import InvalidRequest
from bitserve.llm.lora import AdapterNotFound
from bitserve.repository.repository import ModelNotFound
from bitserve.server.errors import handle
from bitserve.server.state import ServerState


def routes(state: ServerState) -> list[Route]:
    api = LoRARoutes(state)
    return [
        Route("/v1/load_lora_adapter", handle(api.load, "openai"), methods=["POST"]),
        Route("/v1/unload_lora_adapter", handle(api.unload, "openai"), methods=["POST"]),
    ]


def managers(state: ServerState) -> Iterator[tuple[str, Any]]:
    """(model name, its LoRA manager) for every ready model that serves adapters."""
    for name, entry in sorted(state.repository.models.items()):
        for _, version in sorted(entry.versions.items()):
            if version.ready and version.serves("generate"):
                lora = version.serving("generate").lora
                if lora is not None:
                    yield name, lora
                    break


def resolve(state: ServerState, model: str) -> tuple[str, str | None]:
    """An OpenAI `model`: (the model to run, the adapter or None). A model's own name
    wins; an unknown name stays as it is (its lookup is the 404)."""
    if model not in state.repository.models:
        for name, lora in managers(state):
            if model in lora.adapters:
                return name, model
    return model, None


def with_adapter(jobs: list, adapter: str | None) -> list:
    """An OpenAI request's (prompt, ..., SamplingParams) jobs, generating with `adapter`."""
    if adapter is not None:
        for job in jobs:
            job[-1].lora = adapter
    return jobs


def cards(state: ServerState) -> list[dict]:
    """/v1/models' entries for the adapters."""
    return [
        {
            "id": adapter.name,
            "object": "model",
            "created": 0,
            "owned_by": "bitserve",
            "root": str(adapter.path),
            "parent": name,
        }
        for name, lora in managers(state)
        for adapter in lora.adapters.values()
    ]


class LoRARoutes:
    def __init__(self, state: ServerState):
        self.state = state

    async def body(self, request: Request, fields: tuple[str, ...]) -> dict:
        self.state.authorize(request.headers.get("authorization", ""))
        self.state.allow_changes()  # an adapter is new weights: as loading a model
        try:
            doc = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            raise InvalidRequest("the body must be a JSON object")
        for key in fields:
            if not isinstance(doc.get(key), str) or not doc[key]:
                raise InvalidRequest(f"{key}: a non-empty string is required")
        return doc

    def manager(self, model: str | None) -> tuple[str, Any]:
        found = dict(managers(self.state))
        if model is not None:
            if model not in found:
                raise InvalidRequest(f"model: '{model}' is not a ready model with max_loras > 0")
            return model, found[model]
        if len(found) != 1:
            which = ", ".join(found) or "none"
            raise InvalidRequest(f"model: name the base model (serving LoRA: {which})")
        return next(iter(found.items()))

    async def load(self, request: Request) -> Response:
        doc = await self.body(request, ("lora_name", "lora_path"))
        model = doc.get("model") or doc.get("base_model_name")
        name, lora = self.manager(model if isinstance(model, str) else None)
        lora_name = doc["lora_name"]
        if lora_name in self.state.repository.models:
            raise InvalidRequest(f"lora_name: '{lora_name}' is the name of a model")
        await asyncio.to_thread(lora.register, lora_name, doc["lora_path"])
        return PlainTextResponse(f"Success: LoRA adapter '{lora_name}' added to '{name}'.")

    async def unload(self, request: Request) -> Response:
        doc = await self.body(request, ("lora_name",))
        lora_name = doc["lora_name"]
        for _, lora in managers(self.state):
            try:
                lora.unregister(lora_name)
            except AdapterNotFound:
                continue
            return PlainTextResponse(f"Success: LoRA adapter '{lora_name}' removed.")
        raise ModelNotFound(f"LoRA adapter '{lora_name}' is not loaded")
