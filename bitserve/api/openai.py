"""The OpenAI API apart from HTTP: request schemas and their validation, sampling
parameters, and response bodies built from engine outputs (errors: api/errors.py).

The server's routes (server/openai.py) and `bitserve batch` (offline/executor.py) both
build on it, so a batch output body is exactly what the server answers. Parameters
beyond OpenAI's (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `priority`, `speculative`) are accepted as extra fields, as vLLM does.

The sampling fields are taken as sent and checked once, by `SamplingParams` (built by
`backends.llm.sampling`, the one builder of every door), so an out-of-range value gets
the same message here as on v2 generate, v2 infer, gRPC and batch lines; the schema
publishes their types and ranges (api/sampling.py). The rest (`n`, `messages`, `tools`,
...) is OpenAI's own and checked by the schema.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_validator

from bitserve.api.errors import APIError
from bitserve.api.sampling import field_schema
from bitserve.backends.llm import SAMPLING_FIELDS, LLMService, sampling
from bitserve.batching.collate import shape_key
from bitserve.inference import InferRequest
from bitserve.llm import tools
from bitserve.llm.outputs import RequestOutput
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.structured import GUIDED_FIELDS, Guide, guide_from
from bitserve.repository.version import ModelVersion

# ------------------------------------------------------------------- schemas


# Strict: no string where a number goes, no number where a bool goes, no inf or NaN.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _sampled(name: str) -> Any:
    """A sampling field as sent; SamplingParams checks it (types and ranges, once for
    every door) and the published schema is SamplingParams' own."""
    return WithJsonSchema(field_schema(name))


TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class JSONSchemaFormat(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        return self


class _Request(BaseModel):
    model_config = STRICT

    model: str
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    temperature: Annotated[Any, _sampled("temperature")] = 1.0
    top_p: Annotated[Any, _sampled("top_p")] = 1.0
    stop: Annotated[Any, _sampled("stop")] = None
    seed: Annotated[Any, _sampled("seed")] = None
    presence_penalty: Annotated[Any, _sampled("presence_penalty")] = 0.0
    frequency_penalty: Annotated[Any, _sampled("frequency_penalty")] = 0.0
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: Annotated[Any, _sampled("top_k")] = -1
    min_p: Annotated[Any, _sampled("min_p")] = 0.0
    repetition_penalty: Annotated[Any, _sampled("repetition_penalty")] = 1.0
    ignore_eos: Annotated[Any, _sampled("ignore_eos")] = False
    min_tokens: Annotated[Any, _sampled("min_tokens")] = 0
    stop_token_ids: Annotated[Any, _sampled("stop_token_ids")] = []
    prompt_logprobs: Annotated[Any, _sampled("prompt_logprobs")] = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    skip_special_tokens: Annotated[Any, _sampled("skip_special_tokens")] = True
    include_stop_str_in_output: Annotated[Any, _sampled("include_stop_str_in_output")] = False
    speculative: Annotated[Any, _sampled("speculative")] = True  # false: opt out (llm/speculative)
    # structured outputs: OpenAI's response_format, or vLLM's guided_* (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None

    def guide(self) -> Guide | None:
        fields = {name: getattr(self, name) for name in GUIDED_FIELDS}
        if self.response_format is not None:
            fields["response_format"] = self.response_format.model_dump(by_alias=True)
        return guide_from(fields)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[Any, _sampled("max_tokens")] = 16
    logprobs: Annotated[Any, _sampled("logprobs")] = None
    echo: bool = False
    best_of: int | None = None

    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt back, scored, nothing generated (how
        lm-eval's local-completions asks for loglikelihoods)."""
        return self.echo and _plain_int(self.max_tokens) and self.max_tokens == 0


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class Function(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    model_config = STRICT
    name: FunctionName


class NamedTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[Any, _sampled("max_tokens")] = None
    max_completion_tokens: Annotated[Any, _sampled("max_tokens")] = None
    logprobs: bool = False
    top_logprobs: Annotated[Any, _sampled("logprobs")] = None
    few_shot: bool = True  # bitserve: prepend the model's system prompt and examples
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def calls_tools(self) -> bool:
        """Whether the output is parsed for tool calls (tools given, choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool(self) -> tuple[bool, str | None]:
        """(a call is required, the one function it must be)."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return False, None
        if isinstance(self.tool_choice, NamedTool):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise APIError(
                    400, f"tool_choice names '{name}', not among the tools", param="tool_choice"
                )
            return True, name
        return True, None


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    model: str
    input: str | Annotated[list[str], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str
    tokens: list[TokenId]


# pydantic names the union member in an error's location ("prompt.str"): not a field
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|literal\[.*|function-.*|.*\[.*\])$")


def parse(schema: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body against a request schema: 400 naming the field."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            message = f"malformed JSON: {err['ctx'].get('error', err['msg'])}"
            raise APIError(400, message, "invalid_request_error") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise APIError(
                400, "the request body must be a JSON object", "invalid_request_error"
            ) from None
        param = ".".join(str(p) for p in err["loc"] if not _TYPE_TAG.match(str(p))) or None
        raise APIError(400, f"{param}: {err['msg']}", "invalid_request_error", param) from None


# ------------------------------------------------------------------ responses


class Responses:
    """Builds OpenAI response bodies from finished engine outputs, apart from any HTTP,
    so that `bitserve batch` writes exactly what the server answers."""

    def __init__(self, llm: LLMService, req: Any, jobs: list, chat: bool):
        self.llm, self.req, self.jobs, self.chat = llm, req, jobs, chat
        self.echo_only = isinstance(req, CompletionRequest) and req.echo_only()
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def body(self, finals: dict[int, RequestOutput]) -> dict:
        """The non-streaming body, given the final output of every job."""
        choices = [self._choice(i, finals[i]) for i in range(len(self.jobs))]
        doc = self._envelope(choices, usage=self._usage(finals))
        if self.chat and self.req.prompt_logprobs is not None:  # one prompt: vLLM's top level
            doc["prompt_logprobs"] = self.prompt_logprobs(finals[0])
        return doc

    def _choice(self, index: int, out: RequestOutput) -> dict:
        completion = out.outputs[0]
        text = completion.text
        logprobs = None
        if self.chat:
            if completion.logprobs is not None:
                logprobs = {
                    "content": self._chat_logprobs(completion.token_ids, completion.logprobs)
                }
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = completion.finish_reason
            if self.req.calls_tools():
                content, calls = tools.parse(text, self.llm.tool_parser)
                if calls:
                    message = {"role": "assistant", "content": content}
                    message["tool_calls"] = [call.as_openai() for call in calls]
                    finish = "tool_calls"
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        ids, entries = self.generated(completion)
        text = "" if self.echo_only else text
        if self.req.echo:
            text = self.prompt_text(index) + text
        if completion.logprobs is not None:
            logprobs = (
                self.echo_logprobs(out, ids, entries)
                if self.req.echo
                else self._completion_logprobs(ids, entries, 0)
            )
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if self.echo_only else completion.finish_reason,
        }
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out)
        return choice

    # -- echo and prompt logprobs (completions) -------------------------------------

    def generated(self, completion: Any) -> tuple[list[int], list]:
        """The tokens (and logprob entries) the answer shows: none for echo-only, whose
        one sampled token only let the engine run the prompt."""
        if self.echo_only:
            return [], []
        return completion.token_ids, completion.logprobs or []

    def prompt_text(self, index: int) -> str:
        prompt = self.jobs[index][0]
        return prompt if isinstance(prompt, str) else self.llm.tokenizer.decode(prompt)

    def echo_logprobs(self, out: RequestOutput, ids: list[int], entries: list) -> dict:
        """OpenAI's legacy logprobs of an echoed prompt and what followed it: every prompt
        token but the first (which nothing predicts: null) scored by the model."""
        first = self._token(out.prompt_token_ids[0])
        rest = out.prompt_token_ids[1:], out.prompt_logprobs[1:]
        prompt = self._completion_logprobs(*rest, len(first))
        after = self._completion_logprobs(
            ids, entries, len(first) + sum(map(len, prompt["tokens"]))
        )
        heads = {"tokens": first, "token_logprobs": None, "top_logprobs": None, "text_offset": 0}
        return {key: [head, *prompt[key], *after[key]] for key, head in heads.items()}

    def prompt_logprobs(self, out: RequestOutput) -> list:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first, then the
        token's own logprob and the top n, keyed by token id."""
        return [
            None
            if entry is None
            else {
                str(t): {"logprob": lp, "decoded_token": self._token(t)}
                for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])
            }
            for entry in out.prompt_logprobs or []
        ]

    def _usage(self, outputs: dict[int, RequestOutput]) -> dict:
        prompts = {}
        for i, out in outputs.items():
            prompts[self.jobs[i][0] if isinstance(self.jobs[i][0], str) else i // self.req.n] = len(
                out.prompt_token_ids
            )
        prompt_tokens = sum(prompts.values())
        completion = sum(len(self.generated(o.outputs[0])[0]) for o in outputs.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _envelope(self, choices: list, usage: dict | None) -> dict:
        doc = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        if usage is not None:
            doc["usage"] = usage
        return doc

    def _token(self, token_id: int) -> str:
        return self.llm.decode_token(token_id)

    def _chat_logprobs(self, ids: list[int], logprobs: list[dict[int, float]]) -> list[dict]:
        content = []
        for token_id, entry in zip(ids, logprobs, strict=False):
            text = self._token(token_id)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.req.top_logprobs or 0]
            content.append(
                {
                    "token": text,
                    "logprob": entry[token_id],
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": self._token(t),
                            "logprob": lp,
                            "bytes": list(self._token(t).encode()),
                        }
                        for t, lp in top
                    ],
                }
            )
        return content

    def _completion_logprobs(
        self, ids: list[int], logprobs: list[dict[int, float]], offset: int
    ) -> dict:
        tokens = [self._token(t) for t in ids]
        offsets, position = [], offset
        for text in tokens:
            offsets.append(position)
            position += len(text)
        # distinct ids can decode to one text ("\ufffd" for partial bytes): keep the best
        top = [
            {self._token(t): lp for t, lp in sorted(entry.items(), key=lambda kv: kv[1])}
            for entry in logprobs
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [e[t] for t, e in zip(ids, logprobs, strict=False)],
            "top_logprobs": top,
            "text_offset": offsets,
        }


# ------------------------------------------------- engine jobs, embeddings, errors


def completion_jobs(req: CompletionRequest) -> list[tuple[Any, int, SamplingParams]]:
    """(prompt, choice index, sampling params) for every prompt times every choice."""
    if req.best_of not in (None, req.n):
        raise APIError(
            400, "best_of different from n is not supported", "invalid_request_error", "best_of"
        )
    prompts = _prompts(req.prompt)
    # echo-only: the engine samples one token, which the answer leaves out (as vLLM)
    params = _sampling(req, 1 if req.echo_only() else req.max_tokens, req.logprobs, {})
    if req.echo and params[0].logprobs is not None:  # echoed tokens come with their logprobs
        wanted = max(params[0].logprobs, params[0].prompt_logprobs or 0)
        params = [dataclasses.replace(sp, prompt_logprobs=wanted) for sp in params]
    return [(p, i, sp) for p in prompts for i, sp in enumerate(params)]


def chat_jobs(req: ChatRequest, llm: LLMService) -> list[tuple[Any, int, SamplingParams]]:
    """The rendered chat prompt (template, system prompt, few-shot turns, tools) per
    choice; a required or named tool call is enforced by a grammar."""
    messages = [_message(m, llm) for m in req.messages]
    prompt = llm.chat_prompt(messages, few_shot=req.few_shot, tools=req.tool_dicts() or None)
    names = {"logprobs": "top_logprobs"}
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:
        max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max(1, llm.max_model_len - len(prompt))
    if req.logprobs:
        top = 0 if req.top_logprobs is None else req.top_logprobs
    else:  # no logprobs asked for: top_logprobs is still checked, then unused
        top = None
        if req.top_logprobs is not None:
            sampling({"logprobs": req.top_logprobs}, names)
    params = _sampling(req, max_tokens, top, names)
    required, only = req.forced_tool()
    if required:
        if req.guide() is not None:
            raise APIError(
                400, "give tool_choice or response_format, not both", param="tool_choice"
            )
        call = tools.guide(req.tool_dicts(), only, llm.tool_parser, llm.guided_max_string)
        params = [dataclasses.replace(sp, guide=call) for sp in params]
    return [(prompt, i, sp) for i, sp in enumerate(params)]


def _message(message: Message, llm: LLMService) -> dict:
    """A message as the chat template takes it; past tool calls in the model's syntax."""
    doc: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        calls = [
            tools.call_text(c.function.name, c.function.arguments, llm.tool_parser)
            for c in message.tool_calls
        ]
        doc["content"] = doc["content"] + "".join(calls)
    if message.tool_call_id is not None:
        doc["tool_call_id"] = message.tool_call_id
    return doc


def embedding_texts(req: EmbeddingRequest) -> list[str]:
    return [req.input] if isinstance(req.input, str) else req.input


def embedding_body(
    req: EmbeddingRequest,
    texts: list[str],
    vectors: list,
    version: ModelVersion,
    count_tokens: Callable[[list[str]], int] | None,
) -> dict:
    """The /v1/embeddings body: vectors as float32 lists or base64, token usage."""
    tokens = count_tokens(texts) if count_tokens else 0
    data = []
    for i, vector in enumerate(vectors):
        value: Any = vector.astype(np.float32)
        if req.encoding_format == "base64":
            import base64

            value = base64.b64encode(value.tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "invalid_request_error", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


# the request fields that are SamplingParams fields of the same name and meaning
SAMPLED = sorted(SAMPLING_FIELDS & set(_Request.model_fields) - {"max_tokens", "logprobs"})


def _sampling(req: Any, max_tokens: Any, logprobs: Any, names: dict) -> list[SamplingParams]:
    """One SamplingParams per choice, through the one builder (`sampling`); choice i
    samples with `seed + i`."""
    fields = {name: getattr(req, name) for name in SAMPLED}
    fields["max_tokens"], fields["logprobs"] = max_tokens, logprobs
    if _plain_int(fields["min_tokens"]) and _plain_int(max_tokens):
        fields["min_tokens"] = min(fields["min_tokens"], max_tokens)
    base = sampling(fields, names, guide=req.guide())
    return [
        dataclasses.replace(base, seed=None if base.seed is None else base.seed + choice)
        for choice in range(req.n)
    ]


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embedding_requests(version: ModelVersion, texts: list[str]) -> Iterator[InferRequest]:
    """Texts as requests of at most max_batch_size rows (online and offline)."""
    config = version.config
    name = config.input[0].name
    limit = max(config.max_batch_size, 1)
    for start in range(0, len(texts), limit):
        chunk = texts[start : start + limit]
        array = np.empty((len(chunk), 1), dtype=object)
        array[:, 0] = [t.encode() for t in chunk]
        inputs = {name: array}
        yield InferRequest(inputs, len(chunk), shape_key(config, inputs))
