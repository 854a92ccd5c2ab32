"""Backends run one instance of a model version behind one interface (`base.Model`).

Each backend module is imported only when a model uses it, so serving python models
never imports onnxruntime or transformers.
"""

from __future__ import annotations

import importlib

from bitserve.backends.base import Model

_MODULES = {
    "python": "bitserve.backends.python",
    "torch": "bitserve.backends.torch",
    "onnx": "bitserve.backends.onnx",
    "hf": "bitserve.backends.hf",
}


def is_llm(backend: str) -> bool:
    """llm models run on the engine (continuous batching), not on instances."""
    return backend == "llm"


def backend_class(name: str) -> type[Model]:
    """The `Model` subclass for a config's `backend` field."""
    return importlib.import_module(_MODULES[name]).BACKEND


__all__ = ["Model", "backend_class"]
