"""The `python` backend: a class in `<version>/model.py`, as simple as LitServe's LitAPI.

    class Model:
        def setup(self, device):               # optional; may also take model_dir, config
            self.scale = 2.0

        def predict(self, inputs):             # a whole batch: {name: np.ndarray}
            return {"y": inputs["x"] * self.scale}

The class is the one named by `parameters.class` in config.toml, else the only class
defined in model.py that has a `predict` or an `execute` method.

`execute(self, requests)` (Triton's name) instead of `predict` takes the batch as its
requests, each one's inputs by name, and returns each one's outputs, so that a request's
outputs may have their own shape (a tokenizer's token ids); an exception in a request's
place fails that request alone (a ValueError is a 400, the caller's mistake). Either
may be `async def`: it then runs on an event loop of the model's own thread, where BLS
calls can be awaited together. A `setup` that takes `models` gets the BLS handle
(backends/bls.py) to call any served model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.backends.base import LoadError, Model
from bitserve.config import ModelConfig


class PythonModel(Model):
    platform = "python"

    def __init__(
        self, config: ModelConfig, version_dir: Path, device: str = "cpu", models: Any = None
    ):
        super().__init__(config, version_dir, device)
        self.models = models  # the BLS handle, when the model runs on a server thread
        self.execute: Callable[[list[dict]], list[dict]] | None = None  # per-request form
        self._loop: asyncio.AbstractEventLoop | None = None  # for async def predict/execute

    def load(self) -> None:
        path = self.require_file("model.py")
        module_name = f"bitserve_user_{self.config.name}_{self.version_dir.name}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise LoadError(f"{path}: import failed: {type(e).__name__}: {e}") from e
        cls = self._find_class(module, path)
        try:
            self.user = cls()
            setup = getattr(self.user, "setup", None)
            if setup is not None:
                offered = {
                    "device": self.device,
                    "model_dir": self.version_dir,
                    "config": self.config,
                    "models": self.models,
                }
                accepted = inspect.signature(setup).parameters
                if "models" in accepted and self.config.instance_group.isolation != "thread":
                    raise LoadError(f"{path}: BLS (setup's models) needs isolation 'thread'")
                setup(**{k: v for k, v in offered.items() if k in accepted})
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"{path}: {cls.__name__}.setup failed: {type(e).__name__}: {e}") from e
        if hasattr(self.user, "execute"):
            if self.config.instance_group.isolation != "thread":
                raise LoadError(
                    f"{path}: execute(requests) needs instance_group.isolation 'thread'"
                )
            self.execute = self._execute

    def _find_class(self, module: Any, path: Any) -> type:
        wanted = self.config.parameters.get("class")
        if wanted is not None:
            cls = getattr(module, wanted, None)
            if not inspect.isclass(cls):
                raise LoadError(f"{path}: parameters.class names {wanted!r}, not a class there")
            return cls
        candidates = [
            c
            for c in vars(module).values()
            if inspect.isclass(c)
            and c.__module__ == module.__name__
            and (hasattr(c, "predict") or hasattr(c, "execute"))
        ]
        if len(candidates) != 1:
            raise LoadError(
                f"{path}: expected one class with a predict or execute method, found "
                f"{[c.__name__ for c in candidates]}; set parameters.class"
            )
        return candidates[0]

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        return self._settle(self.user.predict(inputs))

    def _execute(self, requests: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        outputs = self._settle(self.user.execute(requests))
        if not isinstance(outputs, list | tuple) or len(outputs) != len(requests):
            raise RuntimeError(
                f"model '{self.config.name}': execute must return one dict per request "
                f"({len(requests)}), got {type(outputs).__name__}"
            )
        return list(outputs)

    def _settle(self, result: Any) -> Any:
        """An `async def` method's coroutine, run to its end on this thread's loop."""
        if not inspect.isawaitable(result):
            return result
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(result)

    def unload(self) -> None:
        teardown = getattr(self.user, "teardown", None)
        if teardown is not None:
            teardown()
        if self._loop is not None:
            self._loop.close()


BACKEND = PythonModel
