"""Ensembles: a pipeline of served models as one model (Triton's ensemble scheduler).

`ensemble_scheduling.step` lists the steps; each maps its model's inputs and outputs to
the ensemble's tensors (config.py's `EnsembleStep`). The graph is checked when the
config is read (a tensor nobody writes, written twice, a cycle) and again at load
against each step's model (unknown model, a name its config does not declare, an input
left unmapped, datatypes that disagree): every error names the step.

A request runs as data flows: a step starts as soon as every tensor it reads is there,
so independent steps run at once. Each step is an ordinary request to its model
(repository/calls.py): it queues at that model's batcher, so concurrent ensemble
requests batch together at every step. The ensemble has no instances of its own; it is
ready while every step's model can answer, and counts each request it answers as one
execution in its statistics. A step that fails fails the request with the step's own
error (its status kept), its message prefixed by the ensemble and the step; the steps
still running are cancelled, and so are all of them when the caller goes away.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from bitserve import coldstart
from bitserve.backends.base import LoadError
from bitserve.batching.batcher import BatchStats
from bitserve.config import EnsembleStep, ModelConfig, step_name
from bitserve.inference import InferRequest
from bitserve.repository.paths.base import ExecutionPath, Report, Ticket


class EnsemblePath(ExecutionPath):
    platform = "ensemble"

    def __init__(self, version: Any):
        super().__init__(version)
        self.scheduling = self.config.ensemble_scheduling
        assert self.scheduling is not None
        self.stats = BatchStats()

    async def load(self) -> tuple[list[tuple[coldstart.Span, coldstart.Span]], float]:
        """Check every step against its model's config (read by the repository's scan)."""
        calls = self.version.calls
        if calls is None:
            raise LoadError(f"ensemble '{self.config.name}' is served only from a repository")
        types = {t.name: t.datatype for t in self.config.input}
        for i in self.scheduling.order(set(types), [t.name for t in self.config.output]):
            self._check_step(i, calls.repository, types)
        for t in self.config.output:
            if types[t.name] != t.datatype:
                raise LoadError(
                    f"ensemble '{self.config.name}': output '{t.name}' is {t.datatype} but "
                    f"its step writes {types[t.name]}"
                )
        return [], 0.0

    def _check_step(self, i: int, repository: Any, types: dict[str, str]) -> None:
        step, where = self.scheduling.step[i], self._where(i)
        if step.model_name == self.config.name:
            raise LoadError(f"{where}: an ensemble cannot call itself")
        entry = repository.models.get(step.model_name)
        if entry is None or entry.config is None:
            why = entry.error if entry is not None else "no such model in the repository"
            raise LoadError(f"{where}: unknown model '{step.model_name}' ({why})")
        model: ModelConfig = entry.config
        for key, tensor in step.input_map.items():
            spec = model.input_spec(key)
            if spec is None:
                raise LoadError(f"{where}: input_map names '{key}', not an input of the model")
            if types[tensor] != spec.datatype:
                raise LoadError(
                    f"{where}: input '{key}' is {spec.datatype} but '{tensor}' is {types[tensor]}"
                )
        unmapped = [t.name for t in model.input if not t.optional and t.name not in step.input_map]
        if unmapped:
            raise LoadError(f"{where}: the model's inputs {unmapped} are not mapped")
        declared = {t.name: t.datatype for t in model.output}
        for key, tensor in step.output_map.items():
            if key not in declared:
                raise LoadError(f"{where}: output_map names '{key}', not an output of the model")
            types[tensor] = declared[key]
        if 0 < model.max_batch_size < self.config.max_batch_size:
            raise LoadError(
                f"{where}: the model's max_batch_size {model.max_batch_size} is below the "
                f"ensemble's {self.config.max_batch_size}"
            )

    def _where(self, i: int) -> str:
        return f"ensemble '{self.config.name}' {step_name(self.scheduling, i)}"

    def ready(self) -> bool:
        """Ready while every step's model has a version that can answer."""
        return self._blocked() is None

    def restarting(self) -> str | None:
        """Why it cannot answer now (health reports it): a step whose model cannot."""
        blocked = self._blocked()
        return None if blocked is None else f"waiting for {blocked}, which cannot answer"

    def _blocked(self) -> str | None:
        repository = self.version.calls.repository if self.version.calls else None
        for i, step in enumerate(self.scheduling.step):
            entry = repository.models.get(step.model_name) if repository else None
            if entry is None or not any(
                v.ready or v.state == "lazy" for v in entry.versions.values()
            ):
                return step_name(self.scheduling, i)
        return None

    def report(self) -> Report:
        return Report(batch=self.stats, healthy=1 if self.ready() else 0)

    def describe(self) -> str:
        return " -> ".join(s.model_name for s in self.scheduling.step)

    # ------------------------------------------------------------- requests

    def start(self, request: InferRequest, background: bool = False) -> Ticket:
        lease = self.version.begin()
        task = asyncio.ensure_future(self._run(request))
        task.add_done_callback(lambda _: lease.release())
        return Ticket(task, lambda _: task.cancel())

    async def _run(self, request: InferRequest) -> dict[str, np.ndarray]:
        """Start each step once the tensors it reads exist; end when none is left."""
        tensors = dict(request.inputs)
        absent = {t.name for t in self.config.input if t.name not in tensors}  # optional
        waiting = list(range(len(self.scheduling.step)))
        running: dict[asyncio.Future, int] = {}
        try:
            while waiting or running:
                for i in [i for i in waiting if self._can_start(i, tensors, absent)]:
                    waiting.remove(i)
                    running[asyncio.ensure_future(self._step(i, tensors, request))] = i
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    del running[task]
                failed = [t.exception() for t in done if t.exception() is not None]
                if failed:
                    raise failed[0]  # the step's own error, named
                for task in done:
                    tensors.update(task.result())
        finally:
            for task in running:
                task.cancel()
        self._count(request.rows)
        return {t.name: tensors[t.name] for t in self.config.output}

    def _can_start(self, i: int, tensors: dict, absent: set[str]) -> bool:
        return all(t in tensors or t in absent for t in self.scheduling.step[i].input_map.values())

    async def _step(self, i: int, tensors: dict, request: InferRequest) -> dict[str, np.ndarray]:
        """One step: its model's request, built from the ensemble's tensors. (The place
        for a tracing span per ensemble step.)"""
        step: EnsembleStep = self.scheduling.step[i]
        inputs = {key: tensors[t] for key, t in step.input_map.items() if t in tensors}
        try:
            outputs = await self.version.calls.infer(
                step.model_name,
                inputs,
                outputs=list(step.output_map),
                version=step.model_version,
                timeout_us=request.timeout_us,
                priority=request.priority,
            )
        except Exception as e:
            raise named(e, self._where(i)) from e
        return {step.output_map[key]: array for key, array in outputs.items()}

    def _count(self, rows: int) -> None:
        s = self.stats
        s.execution_count += 1
        s.inference_count += rows
        s.batch_sizes[rows] = s.batch_sizes.get(rows, 0) + 1


def named(error: Exception, where: str) -> Exception:
    """The step's error, its type (so its status and Retry-After) kept, its message
    prefixed with the step that raised it."""
    renamed = type(error).__new__(type(error), f"{where}: {error}")  # no __init__: any type
    renamed.__dict__.update(error.__dict__)
    return renamed
