"""Diffusion models: rows batched step by step on the step loop their in-process
instances share (diffusion/engine.py), so requests skip the dynamic batcher and a
cancelled one leaves at the next step, running or not. Out of process (an isolated
instance) a diffusion model is a batched one.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from bitserve.inference import InferRequest
from bitserve.repository.paths.base import Ticket
from bitserve.repository.paths.batched import BatchedPath

if TYPE_CHECKING:
    from bitserve.diffusion.engine import DiffusionEngine


class DiffusionPath(BatchedPath):
    @property
    def engine(self) -> DiffusionEngine | None:
        """The step loop this version's in-process instances share, or None."""
        for instance in self.instances:
            if (engine := getattr(instance.model, "engine", None)) is not None:
                return engine
        return None

    def serving(self, task: str) -> Any:
        if task != "images":
            return super().serving(task)
        if self.engine is None:
            raise self.unsupported(task, " served in this process")
        return self

    def start(self, request: InferRequest, background: bool = False) -> Ticket:
        engine = self.engine
        if engine is None:
            return super().start(request, background)
        from bitserve.backends.diffusion import request_params

        return self.diffuse(request_params(self.config, request.inputs))  # 400s

    def diffuse(self, params: list) -> Ticket:
        """Images for `params` (GenerationParams) on the step loop; the result is
        {"image": uint8 [n, H, W]}. A cancel (or an error) takes every row out of the
        loop at its next step, running or queued. Raises Overloaded before anything
        stays queued."""
        import torch

        from bitserve.diffusion.sampler import to_uint8

        engine = self.engine
        assert engine is not None
        lease = self.version.begin()
        rows = []  # filled as submitted: an Overloaded midway still cancels the earlier ones
        try:
            for p in params:
                rows.append(engine.submit(p))
        except BaseException:
            for row in rows:
                engine.cancel(row)
            lease.release()
            raise

        async def images() -> dict:
            try:
                done = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in rows))
                return {"image": to_uint8(torch.stack(done))}
            finally:
                for row in rows:  # an error or a cancel: the rest leave at the next step
                    engine.cancel(row)
                lease.release()

        task = asyncio.ensure_future(images())
        return Ticket(task, lambda _: task.cancel())
