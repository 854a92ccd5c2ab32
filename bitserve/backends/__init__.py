"""Backends run one instance of a model version behind one interface (`base.Model`).

Each backend module is imported only when a model uses it, so serving python models
never imports onnxruntime or transformers.
"""

from __future__ import annotations

import importlib
import threading

from bitserve.backends.base import Model

_MODULES = {
    "python": "bitserve.backends.python",
    "torch": "bitserve.backends.torch",
    "onnx": "bitserve.backends.onnx",
    "hf": "bitserve.backends.hf",
    "diffusion": "bitserve.backends.diffusion",
    "detector": "bitserve.vision.backend",  # an exported detector graph (onnxruntime)
}


def backend_class(name: str) -> type[Model]:
    """The `Model` subclass for a config's `backend` field."""
    return importlib.import_module(_MODULES[name]).BACKEND


_IMPORT_LOCK = threading.Lock()
_imported: set[str] = set()


def preimport(backends: set[str]) -> None:
    """Import the heavy libraries of these backends, one thread at a time.

    Model versions load in parallel on worker threads, but torch imports parts of itself
    lazily (torch._dynamo on a first export load or forward) and two threads doing that
    at once hit a circular-import race ("partially initialized module
    'torch._dynamo.source'"), intermittently. So every load calls this first (blocking:
    run it off the event loop); after the first call per backend it costs nothing."""
    with _IMPORT_LOCK:
        todo = backends - _imported
        if todo & {"torch", "llm", "hf"}:
            import torch._dynamo
            import torch.export  # noqa: F401
        if todo & {"llm", "hf"}:
            import transformers  # noqa: F401
            from transformers import AutoModel, AutoTokenizer  # noqa: F401
        if todo & {"onnx", "detector"}:
            import onnxruntime  # noqa: F401
        for name in todo & set(_MODULES):
            backend_class(name)
        _imported.update(todo)


__all__ = ["Model", "backend_class", "preimport"]
