"""Loading one model instance, below everything that runs instances (threads,
processes, Ray replica actors): the device an instance group asks for, and the model
built and warmed up on it. A leaf: it imports nothing else of `repository`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bitserve.backends import Model, backend_class
from bitserve.backends.base import LoadError
from bitserve.batching.batcher import Request
from bitserve.batching.collate import dummy_inputs, run
from bitserve.config import ModelConfig
from bitserve.tensors import allow_tf32


def device_for(kind: str) -> str:
    """`instance_group.kind` as a torch device: cpu, or cuda where there is one."""
    if kind == "cpu":
        return "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            allow_tf32("cuda")
            return "cuda"
    except ImportError:
        pass
    if kind == "gpu":
        raise LoadError("instance_group.kind is 'gpu' but no CUDA device is available")
    return "cpu"


def build_model(config: ModelConfig, version_dir: Path, device: str, models: Any = None) -> Model:
    """Load the backend and run the config's warmup requests through the batch path.

    Versions load in parallel, each on its own worker thread. That is safe because the
    version imports the heavy libraries on one thread first (backends.preimport):
    torch imports parts of itself lazily, and two threads doing so at once race.
    `models` (python models on a server thread) is the BLS handle (backends/bls.py)."""
    extra = {"models": models} if models is not None else {}
    model = backend_class(config.backend)(config, version_dir, device, **extra)
    started = time.perf_counter()
    model.load()
    model.load_only_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for warmup in config.model_warmup:
        request = Request(
            dummy_inputs(config, warmup.batch_size, warmup.inputs), warmup.batch_size, 0.0
        )
        for _ in range(warmup.count):
            try:
                refused = [a for a in run(config, model, [request]) if isinstance(a, Exception)]
                if refused:
                    raise refused[0]
            except Exception as e:
                raise LoadError(
                    f"{version_dir}: warmup '{warmup.name}' failed: {type(e).__name__}: {e}"
                ) from e
    model.warmup_seconds = time.perf_counter() - started
    return model
