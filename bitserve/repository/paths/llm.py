"""LLMs: one `LLMService` (backends/llm.py) on bitserve's engine, which batches itself
(continuous batching), so there are no instances and no dynamic batcher. "generate" is
the service's front door (every protocol's way in); v2 infer reads `text_input` and
`sampling_parameters` through the same door. The service supervises the engine: while
it restarts the version is not ready.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bitserve import coldstart
from bitserve.inference import InferRequest
from bitserve.repository.paths.base import ExecutionPath, Report, Ticket


class LLMPath(ExecutionPath):
    platform = "bitserve_llm"

    def __init__(self, version: Any):
        super().__init__(version)
        self.service: Any = None  # backends.llm.LLMService, once loaded

    async def load(self) -> tuple[list[tuple[coldstart.Span, coldstart.Span]], float]:
        from bitserve.backends.llm import LLMService
        from bitserve.repository.llmprocess import ProcessLLMService
        from bitserve.repository.llmreplicas import RayLLMService

        started = time.perf_counter()
        isolation = self.config.instance_group.isolation
        kinds = {"ray": RayLLMService, "process": ProcessLLMService}
        kind = kinds.get(isolation, LLMService)
        service = kind(self.config, self.version.version_dir)
        await service.start()
        self.service = service
        elapsed, warmup = time.perf_counter() - started, service.warmup_seconds
        return [coldstart.spans(time.time(), elapsed - warmup, warmup)], warmup

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()

    def ready(self) -> bool:
        return self.service is None or self.service.restarting is None

    def problem(self) -> str | None:
        if self.service is not None and self.version.state in ("ready", "draining"):
            return self.service.healthy()
        return None

    def restarting(self) -> str | None:
        return None if self.service is None else self.service.restarting

    def report(self) -> Report:
        service = self.service
        if service is None or self.version.state != "ready":
            return Report()
        if hasattr(service, "replicas"):  # on Ray or engine processes: their engines summed
            healthy = sum(r.usable() for r in service.replicas)
            return Report(engine=service.metrics() or None, healthy=healthy)
        if service.engine is None:
            return Report()
        snapshot = service.engine.metrics().as_dict()
        return Report(engine=snapshot, engine_restarts=service.restarts)

    def describe(self) -> str:
        return f"LLM engine, warm-up generation {self.service.warmup_seconds:.2f} s"

    def serving(self, task: str) -> Any:
        if task == "generate" and self.service is not None:
            return self.service
        return super().serving(task)

    def start(self, request: InferRequest, background: bool = False) -> Ticket:
        assert self.service is not None
        admitted = self.service.text_request(request.inputs)  # 4xx/503 before it starts
        lease = self.version.begin()

        async def text() -> dict:
            try:
                return await self.service.text_output(admitted)
            finally:
                lease.release()

        task = asyncio.ensure_future(text())
        return Ticket(task, lambda _: task.cancel())
