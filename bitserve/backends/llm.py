"""The `llm` backend: a Hugging Face model folder run on bitserve's own engine.

An LLM batches itself (continuous batching in the engine), so it does not use the
dynamic batcher: a model version holds one `LLMService` instead of instances. The
service owns the engine, the chat template and few-shot turns, admission control (a
bounded waiting queue, 429 past it), and a stall detector on the engine's step loop.

It also supervises the engine: if the step loop dies, the model turns not ready at once
(`restarting` says why; health reads it), the requests in flight and those arriving
meanwhile fail with 503 and Retry-After, and the loop is started again over the same
weights (a tensor-parallel engine is rebuilt whole) and warmed up before the model is
ready again. `restarts` counts it for the metrics.

    backend = "llm"
    [parameters]
    max_model_len = 256            # and any other EngineConfig field, e.g.
    batch_wait = 0.05              # new prompts wait 5% of their predicted prefill (at
                                   # most 50 ms) for requests arriving with them
    max_queued_requests = 64       # requests admitted but not yet generating
    max_queued_tokens = 65536      # their prompt tokens
    stall_timeout_s = 60           # a step loop silent this long with work = not live
    restart_backoff_s = 0          # pause before restarting a dead engine (doubles, 30 s max)
    guided_max_string = 64         # structured outputs: cap free JSON strings (weak models)
    tool_parser = "hermes"         # the model's tool-call syntax: hermes, llama3_json, mistral
    system_prompt = "You are a helpful assistant."
    few_shot = [{ role = "user", content = "Hi" }, { role = "assistant", content = "Hello!" }]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.backends.base import LoadError
from bitserve.config import ModelConfig
from bitserve.inference import InvalidRequest, Overloaded, text_inputs
from bitserve.llm.async_engine import AsyncLLMEngine, EngineDead
from bitserve.llm.config import EngineConfig, check_type
from bitserve.llm.lora import LoRAManager
from bitserve.llm.outputs import RequestOutput
from bitserve.llm.sampling_params import SamplingError, SamplingParams
from bitserve.llm.structured import GUIDED_FIELDS, Guide, guide_from
from bitserve.llm.tools import SYNTAXES, instructions

log = logging.getLogger("bitserve.llm")

SERVICE_KEYS = {
    "max_queued_requests",
    "max_queued_tokens",
    "stall_timeout_s",
    "system_prompt",
    "few_shot",
    "restart_backoff_s",
    "tool_parser",
}
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "hf_config"}
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"guide"}
# Tests inject faults inside steps with "module:function" (engine.FaultHook); unset in use.
FAULT_HOOK_ENV = "BITSERVE_LLM_FAULT_HOOK"
MAX_RESTART_BACKOFF_S = 30.0


def _param(params: dict, name: str, hint: Any, default: Any, where: Path) -> Any:
    """A service parameter of the model's config.toml, refused naming it when it is not
    a `hint` (strictly, as EngineConfig's fields) or is a float that is not finite."""
    value = params.get(name, default)
    try:
        check_type(f"parameter {name!r}", value, hint)
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise LoadError(f"{where}: parameter {name!r} must be finite, got {value!r}")
    return value


class NoChatTemplate(InvalidRequest):
    """The model's tokenizer_config.json has no chat template (400)."""


class LLMService:
    def __init__(self, config: ModelConfig, version_dir: Path):
        self.config = config
        self.version_dir = version_dir
        params = dict(config.parameters)
        unknown = set(params) - SERVICE_KEYS - ENGINE_KEYS - {"path"}
        if unknown:
            raise LoadError(
                f"{version_dir.parent / 'config.toml'}: unknown llm parameters {sorted(unknown)}"
            )
        self.folder = _folder(params.get("path"), version_dir)
        self.engine_args = {k: v for k, v in params.items() if k in ENGINE_KEYS}
        self.adapter = self._adapter_version(params, version_dir)
        where = version_dir.parent / "config.toml"
        self.max_queued_requests = _param(params, "max_queued_requests", int, 256, where)
        self.max_queued_tokens = _param(params, "max_queued_tokens", int, 1 << 20, where)
        self.stall_timeout = float(_param(params, "stall_timeout_s", float, 60.0, where))
        self.restart_backoff = float(_param(params, "restart_backoff_s", float, 0.0, where))
        self.tool_parser = _param(params, "tool_parser", str, "hermes", where)
        if self.tool_parser not in SYNTAXES:
            raise LoadError(f"tool_parser {self.tool_parser!r} is not one of {sorted(SYNTAXES)}")
        self.system_prompt: str | None = _param(params, "system_prompt", str | None, None, where)
        self.few_shot: list[dict] = _param(params, "few_shot", list, [], where)
        self.engine: AsyncLLMEngine | None = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.waiting = 0  # admitted, no token yet
        self.waiting_tokens = 0
        self.running = 0
        self.last_progress = time.monotonic()
        self.warmup_seconds = 0.0
        self.restarting: str | None = None  # why the engine is being restarted
        self.restarts = 0
        self._died = asyncio.Event()
        self._supervisor: asyncio.Task | None = None

    def _adapter_version(self, params: dict, version_dir: Path) -> str | None:
        """A version folder holding a PEFT adapter is that adapter over the base model at
        `path` (llm/lora.py): every request of the version generates with it, so the
        rollout canaries or shadows an adapter as any other version."""
        if not (version_dir / "adapter_config.json").is_file():
            return None
        if "path" not in params:
            raise LoadError(f"{version_dir}: an adapter version needs the base model's `path`")
        name, modules = f"{self.config.name}/{version_dir.name}", params.get("lora_modules", {})
        if not isinstance(modules, dict):
            raise LoadError(f"{version_dir.parent / 'config.toml'}: lora_modules must be a table")
        modules = {**modules, name: str(version_dir)}
        self.engine_args |= {"lora_modules": modules, "max_loras": params.get("max_loras") or 1}
        return name

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load the engine on a thread, then a real warm-up generation."""
        await self._build()
        self.tokenizer = self.engine.engine.tokenizer
        if self.tokenizer is None:
            raise LoadError(f"{self.folder}: no tokenizer.json / tokenizer_config.json")
        self.max_model_len = int(self.engine.engine.config.max_model_len)
        self.warmup_seconds = await self._warm_up()
        self._supervisor = asyncio.create_task(self._supervise())

    async def _build(self) -> None:
        try:
            self.engine = await asyncio.to_thread(AsyncLLMEngine, self.folder, **self.engine_args)
        except Exception as e:
            raise LoadError(f"{self.folder}: cannot start the LLM engine: {e}") from e
        loop = asyncio.get_running_loop()
        self.engine.on_death = lambda _: loop.call_soon_threadsafe(self._died.set)
        self.engine.engine.fault_hook = _fault_hook()

    async def _warm_up(self) -> float:
        assert self.engine is not None
        started = time.perf_counter()
        async for _ in self.engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0)):
            pass
        return time.perf_counter() - started

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    # ------------------------------------------------------------ supervision

    async def _supervise(self) -> None:
        while True:
            await self._died.wait()
            self._died.clear()
            await self._restart()

    async def _restart(self) -> None:
        """Not ready until the engine serves again; retried with a growing pause."""
        assert self.engine is not None
        self.restarting = f"engine loop died: {self.engine.dead!r}; restarting"
        self.restarts += 1
        log.error("model %s: %s (restart %d)", self.config.name, self.restarting, self.restarts)
        pause = self.restart_backoff
        while True:
            await asyncio.sleep(pause)
            pause = min(max(2 * pause, 1.0), MAX_RESTART_BACKOFF_S)
            try:
                if self.engine.engine.workers is None:  # the weights are safe: keep them
                    await asyncio.to_thread(self.engine.revive)
                else:  # a worker may be gone: start them all again
                    await asyncio.to_thread(self.engine.shutdown)
                    await self._build()
                await self._warm_up()
            except Exception as e:
                log.error("model %s: engine restart failed: %r", self.config.name, e)
                if self.engine.dead is not None:  # died again: this attempt failed
                    self._died.clear()
                    continue
            break
        self.restarting = None
        log.info("model %s: engine restarted, ready again", self.config.name)

    @property
    def lora(self) -> LoRAManager | None:
        """The engine's LoRA adapters (llm/lora.py); None when it serves none."""
        return self.engine.engine.lora if self.engine is not None else None

    @property
    def guided_max_string(self) -> int | None:
        assert self.engine is not None
        return self.engine.engine.config.guided_max_string

    def down(self) -> str | None:
        """Why the engine cannot take requests now: restarting, or its loop dead."""
        if self.restarting is not None:
            return self.restarting
        if self.engine is not None and self.engine.dead is not None:
            return f"engine loop died: {self.engine.dead!r}"
        return None

    def healthy(self) -> str | None:
        """Why the engine loop is not healthy (None when it is)."""
        if (why := self.down()) is not None:
            return why
        silent = time.monotonic() - self.last_progress
        if (self.running or self.waiting) and silent > self.stall_timeout:
            return f"engine loop stalled: no progress for {silent:.0f} s with work queued"
        return None

    # ------------------------------------------------------------ the front door

    def hold(self) -> Hold:
        """A place in the waiting queue, taken before the costly part of the front door
        (a chat template, tokenization): under overload a request is refused at once
        instead of after the encoding of every request ahead of it (raises Overloaded).
        `process` gives it back as it admits the request's real count."""
        self.admit(0)
        self.waiting += 1
        return Hold(self)

    def process(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        queue: bool = True,
        hold: Hold | None = None,
    ) -> list[EngineRequest]:
        """The one way in, whichever protocol a request came from (vLLM's
        `Processor.process_inputs`): every prompt is encoded and checked against the one
        set of limits, then the whole API request is admitted once. It raises before
        anything is queued, so a stream's headers go out only for a request that can
        run: a dead or restarting engine (503, retry), an empty prompt, token ids
        outside the vocabulary, a prompt past the context (RequestTooLong: the
        scheduler's own check), a guide that cannot compile (400; compiled once per
        guide and cached), a full waiting queue (Overloaded, 429). `queue=False` (batch
        jobs: nobody to answer 429, only an engine to keep full) skips the last."""
        try:
            encoded = self._checked(prompts, params)
        finally:
            if hold is not None:  # no await from here to the admission below
                hold.release()
        if queue:
            self.admit(max(map(len, encoded)), count=len(encoded))
        return [self._reserve(ids, sp) for ids, sp in zip(encoded, params, strict=True)]

    def _checked(self, prompts: list[str | list[int]], params: list[SamplingParams]) -> list:
        if (why := self.down()) is not None:
            raise EngineDead(f"model '{self.config.name}': {why}")
        vocab = self.vocab_size()
        encoded = [self.encode(p) for p in prompts]
        for ids, sp in zip(encoded, params, strict=True):
            if not ids:
                raise InvalidRequest("prompt: the prompt is empty")
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequest(f"prompt: token ids must be in [0, {vocab})")
            sp.check_vocab(vocab)
            self._check_fit(ids, sp)
        return encoded

    def vocab_size(self) -> int:
        assert self.engine is not None
        hf = self.engine.engine.config.hf_config
        return int(hf.get("vocab_size") or len(self.tokenizer))

    def _check_fit(self, ids: list[int], sp: SamplingParams) -> None:
        """The engine's own checks: the adapter, the length (the scheduler's) and the
        guide (compiled once per guide and cached)."""
        assert self.engine is not None
        engine = self.engine.engine
        sp.lora = sp.lora or self.adapter  # an adapter version's own by default
        engine.check_lora(sp.lora)
        engine.scheduler.check_length(len(ids), sp.max_tokens)
        if sp.guide is not None:
            engine.grammars().template(sp.guide)

    def _reserve(self, ids: list[int], params: SamplingParams) -> EngineRequest:
        self.waiting += 1
        self.waiting_tokens += len(ids)
        return EngineRequest(ids, params, self)

    def _unreserve(self, prompt_tokens: int) -> None:
        self.waiting -= 1
        self.waiting_tokens -= prompt_tokens

    # ------------------------------------------------------------ prompts

    def chat_prompt(
        self, messages: list[dict], few_shot: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Render messages (after the configured system prompt and few-shot turns). Tools
        go to the template as transformers passes them; a template that knows no tools
        (or no "tool" role) gets them as a system prompt and results as user turns."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise NoChatTemplate(
                f"model '{self.config.name}' has no chat template in tokenizer_config.json; "
                "use /v1/completions"
            )
        prefix: list[dict] = []
        if few_shot:
            if self.system_prompt and not (messages and messages[0]["role"] == "system"):
                prefix.append({"role": "system", "content": self.system_prompt})
            prefix.extend(self.few_shot)
        template = self.tokenizer.chat_template
        if tools and "tools" not in template:
            prefix.insert(0, {"role": "system", "content": instructions(tools, self.tool_parser)})
            tools = None
        if "tool" not in template.replace("tools", ""):
            messages = [_plain(m) for m in messages]
        rendered = self.tokenizer.apply_chat_template(
            prefix + messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    # ------------------------------------------------------------ generation

    def admit(self, prompt_tokens: int, count: int = 1) -> None:
        """Reserve room in the waiting queue, or raise Overloaded."""
        if (
            self.waiting + count > self.max_queued_requests
            or self.waiting_tokens + prompt_tokens * count > self.max_queued_tokens
        ):
            per_request = 0.5  # a rough drain estimate; whole seconds for Retry-After
            retry = max(1, math.ceil(self.waiting * per_request / max(self.running, 1)))
            raise Overloaded(
                f"model '{self.config.name}': {self.waiting} requests are already waiting "
                f"(max_queued_requests {self.max_queued_requests}, max_queued_tokens "
                f"{self.max_queued_tokens})",
                retry,
            )

    async def generate(
        self,
        request: EngineRequest,
        request_id: str | None = None,
        priority: int = 0,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of a request the front door admitted (`process`); its
        place in the waiting queue is this generation's from the first step. Closing the
        iterator early aborts the request at once."""
        assert self.engine is not None
        prompt_ids = request.take()
        started = False
        try:
            async for out in self.engine.generate(
                prompt_ids, request.params, request_id, priority, stream
            ):
                self.last_progress = time.monotonic()
                if not started:
                    started = True
                    self._start_running(len(prompt_ids))
                yield out
        finally:
            if started:
                self.running -= 1
            else:
                self._unreserve(len(prompt_ids))

    async def complete(self, request: EngineRequest) -> str:
        """The finished text of one admitted request (no stream)."""
        text = ""
        async for out in self.generate(request):
            text = out.outputs[0].text
        return text

    def text_request(self, inputs: dict[str, np.ndarray]) -> EngineRequest:
        """A v2 request's tensors as Triton's vLLM backend reads them (`text_input`,
        BYTES, and an optional JSON `sampling_parameters`), through the front door (v2
        infer; its answer is `text_output`)."""
        prompt, parameters = text_inputs(inputs)
        return self.process([prompt], [sampling(parameters)])[0]

    async def text_output(self, request: EngineRequest) -> dict[str, np.ndarray]:
        """v2 infer on an llm model, as Triton's vLLM backend: -> `text_output`."""
        result = np.empty(1, dtype=object)
        result[0] = (await self.complete(request)).encode()
        return {"text_output": result}

    def _start_running(self, prompt_tokens: int) -> None:
        self.waiting -= 1
        self.waiting_tokens -= prompt_tokens
        self.running += 1

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class Hold:
    """`LLMService.hold`'s place in the waiting queue, given back once (by `process`,
    or when dropped: a request that failed before it was processed)."""

    def __init__(self, service: LLMService):
        self.service: LLMService | None = service

    def release(self) -> None:
        if self.service is not None:
            self.service.waiting -= 1
            self.service = None

    def __del__(self) -> None:
        self.release()


class EngineRequest:
    """One prompt the front door admitted: its token ids and sampling parameters, and
    its place in the service's waiting queue, held until a generation takes it (or
    given back by `release`, or when dropped: a response that never started)."""

    def __init__(self, ids: list[int], params: SamplingParams, service: LLMService):
        self.ids, self.params = ids, params
        self.service: LLMService | None = service

    def take(self) -> list[int]:
        if self.service is None:
            raise RuntimeError("an admitted request generates once")
        self.service = None
        return self.ids

    def release(self) -> None:
        if self.service is not None:
            self.service._unreserve(len(self.ids))
            self.service = None

    def __del__(self) -> None:
        self.release()


def _plain(message: dict) -> dict:
    """A tool result as a user turn, for templates with no "tool" role."""
    if message["role"] != "tool":
        return message
    return {
        "role": "user",
        "content": f"Result of {message.get('tool_call_id')}: {message['content']}",
    }


def sampling(
    parameters: Any, names: dict[str, str] | None = None, guide: Guide | None = None
) -> SamplingParams:
    """The one way to build a request's SamplingParams, from its JSON fields as sent
    (every door: OpenAI bodies, v2 generate's `parameters`, v2 infer's and gRPC's
    `sampling_parameters`, batch lines). Types and ranges are SamplingParams' own, so
    a value out of range gets the same message from every door, naming the field;
    `names` renames a field in that message (OpenAI's `top_logprobs` is `logprobs`);
    `guide` is one the caller read already (OpenAI's `response_format`)."""
    if not isinstance(parameters, dict):
        raise InvalidRequest("'parameters' must be a JSON object")
    unknown = set(parameters) - SAMPLING_FIELDS - {"stream", "guide", *GUIDED_FIELDS}
    if unknown:
        raise InvalidRequest(f"unknown sampling parameters {sorted(unknown)}")
    if "stream" in parameters and not isinstance(parameters["stream"], bool):
        raise InvalidRequest("stream: must be a bool")
    try:
        guide = guide if guide is not None else guide_from(parameters)
        fields = {k: v for k, v in parameters.items() if k in SAMPLING_FIELDS}
        return SamplingParams(**fields, guide=guide)
    except SamplingError as e:
        name = (names or {}).get(e.field)
        if name is None:
            raise
        raise SamplingError(name, str(e).removeprefix(f"{e.field}: ")) from None


def _fault_hook() -> Any:
    """The test hook named by BITSERVE_LLM_FAULT_HOOK ("module:function"), if any."""
    target = os.environ.get(FAULT_HOOK_ENV)
    if not target:
        return None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _folder(value: str | None, version_dir: Path) -> Path:
    if value is None:
        return version_dir
    path = Path(value).expanduser()
    return path if path.is_absolute() else version_dir / path
