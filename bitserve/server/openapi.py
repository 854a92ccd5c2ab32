"""`GET /openapi.json`: the published schema of the v2 and OpenAI endpoints.

Generated, not hand-kept: the OpenAI bodies are the request models the server validates
with (bitserve/api/openai.py), and the sampling parameters of every door are
`SamplingParams` with the ranges of its own `LIMITS` (bitserve/api/sampling.py). The
v2 infer body is described here, as the KServe v2 protocol defines it. `model` is an
enum of the repository's models that the endpoint serves (LLMs for text generation, hf
models for embeddings, hf cross-encoders for rerank and score), so that a schema fuzzer
(tests/server/test_fuzz.py) reaches past the lookup.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from bitserve import __version__
from bitserve.api import sampling
from bitserve.api.openai import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from bitserve.api.rerank import RerankRequest, ScoreRequest
from bitserve.tensors import DATATYPES

REF = "#/components/schemas/{model}"
OPENAI_BODIES = [CompletionRequest, ChatRequest, EmbeddingRequest, TokenizeRequest]
OPENAI_BODIES += [DetokenizeRequest, RerankRequest, ScoreRequest]
ERROR_CODES = ("400", "404", "413", "429", "503", "504")


def document(tasks: dict[str, frozenset[str]]) -> dict:
    """The OpenAPI 3.1 document for a server whose models serve these tasks."""
    models = sorted(tasks)
    llms = [name for name in models if "generate" in tasks[name]] or models
    embedders = [name for name in models if "embed" in tasks[name]] or models
    scorers = [name for name in models if "score" in tasks[name]] or models
    _, defs = models_json_schema([(m, "validation") for m in OPENAI_BODIES], ref_template=REF)
    schemas: dict[str, Any] = defs["$defs"]
    for body in OPENAI_BODIES:
        served = embedders if body is EmbeddingRequest else llms
        served = scorers if body in (RerankRequest, ScoreRequest) else served
        schemas[body.__name__]["properties"]["model"] = {"type": "string", "enum": served}
    schemas["SamplingParameters"] = sampling.schema()
    schemas["GenerateRequest"] = {
        "type": "object",
        "required": ["text_input"],
        "properties": {
            "text_input": {"type": "string"},
            "parameters": {"$ref": REF.format(model="SamplingParameters")},
        },
    }
    schemas["InferRequest"] = infer_schema()
    schemas["Error"] = {"type": "object"}
    paths = {
        "/v2/health/live": _get("liveness"),
        "/v2/health/ready": _get("readiness"),
        "/v2": _get("server metadata"),
        "/v2/models/{model}": _get("model metadata", model=models),
        "/v2/models/{model}/ready": _get("model readiness", model=models),
        "/v2/models/{model}/infer": _post("InferRequest", model=models),
        "/v2/models/{model}/generate": _post("GenerateRequest", model=llms),
        "/v2/models/{model}/generate_stream": _post("GenerateRequest", model=llms),
        "/v1/models": _get("models"),
        "/v1/completions": _post("CompletionRequest"),
        "/v1/chat/completions": _post("ChatRequest"),
        "/v1/embeddings": _post("EmbeddingRequest"),
        "/tokenize": _post("TokenizeRequest"),
        "/detokenize": _post("DetokenizeRequest"),
        **{path: _post("RerankRequest") for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
        **{path: _post("ScoreRequest") for path in ("/v1/score", "/score")},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "bitserve", "version": __version__},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def infer_schema() -> dict:
    """A KServe v2 infer request body with JSON tensor data."""
    tensor = {
        "type": "object",
        "required": ["name", "shape", "datatype", "data"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": sorted(DATATYPES)},
            "parameters": {"type": "object"},
            "data": {"type": "array"},
        },
    }
    requested = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
    }
    return {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "items": tensor, "minItems": 1},
            "outputs": {"type": "array", "items": requested},
        },
    }


def _responses() -> dict:
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    answers: dict[str, Any] = {"200": {"description": "OK"}}
    answers.update({code: {"description": "error", **error} for code in ERROR_CODES})
    return answers


def _parameters(model: list[str] | None) -> list[dict]:
    if model is None:
        return []
    schema = {"type": "string", "enum": model}
    return [{"name": "model", "in": "path", "required": True, "schema": schema}]


def _get(summary: str, model: list[str] | None = None) -> dict:
    operation = {"summary": summary, "parameters": _parameters(model), "responses": _responses()}
    return {"get": operation}


def _post(body: str, model: list[str] | None = None) -> dict:
    content = {"application/json": {"schema": {"$ref": REF.format(model=body)}}}
    operation = {
        "parameters": _parameters(model),
        "requestBody": {"required": True, "content": content},
        "responses": _responses(),
    }
    return {"post": operation}
