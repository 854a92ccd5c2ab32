"""Execution paths: how a request runs on each kind of model, behind one contract
(base.py: start a request, await or cancel its result, the tasks it serves, report,
watch, stop). `ModelVersion` keeps the lifecycle (load, ready, drain, unload) and hands
every request to its path; front-ends, the shadow mirror and batch jobs call the path
through the version and never ask what kind of model it is.

- batched.py: instances (threads, processes, Ray replicas) behind the dynamic batcher
- llm.py: the LLM engine behind its service's front door (backends/llm.py)
- diffusion.py: the diffusion step loop, rows batched step by step
- ensemble.py: a pipeline of served models, each step queued at its model's batcher

`path_for` is the one place that picks a path by the model's backend, and `tasks_of`
(base.py) the one that says what each backend serves.
"""

from __future__ import annotations

from typing import Any

from bitserve.repository.paths.base import ExecutionPath, NotSupported, Report, Ticket, tasks_of

__all__ = ["ExecutionPath", "NotSupported", "Report", "Ticket", "path_for", "tasks_of"]


def path_for(version: Any) -> ExecutionPath:
    backend = version.config.backend
    if backend == "llm":
        from bitserve.repository.paths.llm import LLMPath

        return LLMPath(version)
    if backend == "diffusion":
        from bitserve.repository.paths.diffusion import DiffusionPath

        return DiffusionPath(version)
    if backend == "ensemble":
        from bitserve.repository.paths.ensemble import EnsemblePath

        return EnsemblePath(version)
    from bitserve.repository.paths.batched import BatchedPath

    return BatchedPath(version)
